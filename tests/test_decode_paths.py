"""The rollout's fast paths (issue: faster than the peers): the LM head only at the read positions,
the in-place KV cache, and at most one device->host read per denoising step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_models_hf import megatron_tp1  # noqa: F401  (module-scoped Megatron TP=1 state)
from torch.overrides import TorchFunctionMode

from stabledrl_mcore.diffusion import block_elbo_staircase, generate_llada, generate_sdar
from stabledrl_mcore.diffusion.sampling_common import masked_first, read_count
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.models import AttentionLayout, KVCache, build_model, get_preset, staircase_position_ids
from stabledrl_mcore.models.masks import padding_mask


def _model(name, seed=0):
    torch.manual_seed(seed)
    return build_model(get_preset(name, init_std=0.2)).eval()


# ------------------------------------------------------------------ the head at read positions
@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_logit_positions_equal_the_full_forward_at_the_read_positions(megatron_tp1, arch):
    model = _model(f"{arch}-tiny")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 250, (3, 16), generator=g)
    valid = torch.ones(3, 16, dtype=torch.bool)
    valid[0, :3] = False
    if arch == "llada":
        cases = [(ids, None, padding_mask(valid)), (ids, None, None)]
    else:  # the staircase over [x_t | x_0] and the block-causal layout
        cases = [
            (torch.cat([ids, ids], 1), staircase_position_ids(16), AttentionLayout.staircase(4)),
            (ids, None, AttentionLayout.block_causal(4, pad=(3, 0, 0))),
        ]
    with torch.no_grad():
        for x, pos, mask in cases:
            full = model(x, position_ids=pos, attention_mask=mask)
            shard = model(x, position_ids=pos, attention_mask=mask, gather_output=False)
            for span in (slice(0, 16), slice(5, 9), slice(15, 16), slice(3, None)):
                part = model(x, position_ids=pos, attention_mask=mask, logit_positions=span)
                assert part.shape == full[:, span].shape
                assert torch.allclose(part, full[:, span], atol=1e-5, rtol=0), span
                part = model(x, position_ids=pos, attention_mask=mask, logit_positions=span, gather_output=False)
                assert torch.allclose(part, shard[:, span], atol=1e-5, rtol=0), span
            none = model(x, position_ids=pos, attention_mask=mask, logit_positions=slice(0, 0))
            assert none.shape == (3, 0, full.shape[-1])


@pytest.mark.parametrize(
    "preset, options",
    [
        ("llada-tiny", {}),  # RoPE
        ("llada-tiny", {"position_embedding": "learned", "max_position_embeddings": 64}),
        ("sdar-tiny", {}),
        ("sdar-moe-tiny", {}),
    ],
)
def test_each_rows_own_read_positions_equal_the_full_forward_there(megatron_tp1, preset, options):
    """A decoding step reads each row's masked positions only (``logit_positions`` ``[B, n]``): the
    last layer's queries, output projection and MLP and the head run on those rows (a dense layer's;
    a MoE layer runs whole), and the logits equal the full forward's at them, padded or alone, on
    every kind of model we ship."""
    torch.manual_seed(0)
    model = build_model(get_preset(preset, init_std=0.2, **options)).eval()
    last = model.decoder.layers[-1]
    seen, projected = [], []
    last.mlp.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    last.self_attention.linear_proj.register_forward_pre_hook(lambda _, args: projected.append(args[0].shape[0]))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (3, 16), generator=g)
    valid = torch.ones(3, 16, dtype=torch.bool)
    valid[0, :3] = False
    read = torch.stack([torch.randperm(16, generator=g)[:5] for _ in range(3)])  # [3, 5], each row its own
    moe = getattr(last, "is_moe_layer", False)
    with torch.no_grad():
        for mask in (padding_mask(valid), None):
            full = model(ids, attention_mask=mask)
            seen.clear(), projected.clear()
            part = model(ids, attention_mask=mask, logit_positions=read)
            assert seen == projected == [16 if moe else 5], "the last layer's queries and MLP: the read rows only"
            expected = full.gather(1, read.unsqueeze(-1).expand(-1, -1, full.shape[-1]))
            torch.testing.assert_close(part, expected, atol=1e-5, rtol=0)
            shared = model(ids, attention_mask=mask, logit_positions=read[0])  # one set for every row
            torch.testing.assert_close(shared, full[:, read[0]], atol=1e-5, rtol=0)


def test_masked_first_reads_each_rows_masked_positions_then_the_others():
    masked = torch.tensor([[True, False, True, False], [False, False, False, True], [False] * 4])
    assert masked_first(masked, 3).tolist() == [[0, 2, 1], [3, 0, 1], [0, 1, 2]]
    assert [read_count(m, 32) for m in (32, 17, 0)] == [32, 17, 1]
    assert [read_count(m, 32, 4) for m in (32, 25, 24, 17, 9, 1, 0)] == [32, 32, 24, 24, 16, 8, 8]


def test_the_staircase_likelihood_reads_the_noisy_half_only(megatron_tp1):
    """block_elbo_staircase asks for the noisy half's logits, and gets the full forward's value."""
    model = _model("sdar-tiny")
    asked = []

    class FullHead(torch.nn.Module):  # the reference: the head everywhere, sliced afterwards
        def __init__(self):
            super().__init__()
            self.inner, self.dllm_config = model, model.dllm_config

        def forward(self, *args, logit_positions=None, **kwargs):
            asked.append(logit_positions)
            out = self.inner(*args, **kwargs)
            return out if logit_positions is None else out[:, logit_positions]

    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(1))
    comp = torch.zeros(2, 12, dtype=torch.bool)
    comp[:, 4:] = True
    with torch.no_grad():
        fast = block_elbo_staircase(model, ids, comp, num_mc=2, generator=torch.Generator().manual_seed(2))
        slow = block_elbo_staircase(FullHead(), ids, comp, num_mc=2, generator=torch.Generator().manual_seed(2))
    assert asked and all(a == slice(0, 12) for a in asked)
    assert torch.allclose(fast.seq, slow.seq, atol=1e-5, rtol=0)
    assert torch.allclose(fast.token, slow.token, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------ the in-place cache
class ConcatKVCache:
    """The reference: the concatenating cache the in-place one replaced (``[cached | current]`` by
    ``torch.cat`` in every layer and forward; what a forward writes is kept only when storing)."""

    def __init__(self):
        self.store, self._at, self._length = False, None, 0
        self._kv, self._pending = {}, {}

    length = property(lambda self: self._length)
    offset = property(lambda self: self._length if self._at is None else self._at)

    def key_length(self, seq_len):
        return max(self._length, self.offset + seq_len)

    @contextlib.contextmanager
    def storing(self):
        self.store = True
        try:
            yield self
        finally:
            self.store = False

    @contextlib.contextmanager
    def writing_at(self, position):
        self._at = position
        try:
            yield self
        finally:
            self._at = None

    def update(self, layer, key, value):
        start, end = self.offset, self.offset + key.shape[2]
        old_k, old_v = self._kv.get(layer, (key[:, :, :0], value[:, :, :0]))
        k = torch.cat([old_k[:, :, :start], key, old_k[:, :, end:]], 2)
        v = torch.cat([old_v[:, :, :start], value, old_v[:, :, end:]], 2)
        self._pending[layer] = (k, v, end)
        return k, v

    def commit(self):
        if self.store and self._pending:
            self._kv = {n: (k, v) for n, (k, v, _) in self._pending.items()}
            self._length = max(self._length, *(end for *_, end in self._pending.values()))
        self._pending = {}

    def discard_pending(self):
        self._pending = {}

    def reset(self):
        self._kv, self._length = {}, 0

    def truncate(self, length):
        self._kv = {n: (k[:, :, :length], v[:, :, :length]) for n, (k, v) in self._kv.items()}
        self._length = length

    def repeat_interleave(self, repeats):
        self._kv = {
            n: (k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0)) for n, (k, v) in self._kv.items()
        }

    def get(self, layer):
        return self._kv.get(layer) if self._length else None


def test_in_place_cache_equals_the_concatenating_cache_op_by_op():
    g = torch.Generator().manual_seed(0)
    kv = lambda b, s: (torch.randn(b, 2, s, 4, generator=g), torch.randn(b, 2, s, 4, generator=g))  # noqa: E731
    for capacity in (None, 4, 64):  # grown by doubling from too small, or allocated once
        ours, ref = KVCache(capacity=capacity), ConcatKVCache()

        def forward(b, s, store=False, at=None):
            inputs = {n: kv(b, s) for n in (1, 2)}
            outs = []
            for cache in (ours, ref):
                with contextlib.ExitStack() as stack:
                    if store:
                        stack.enter_context(cache.storing())
                    if at is not None:
                        stack.enter_context(cache.writing_at(at))
                    assert cache.key_length(s) == max(cache.length, cache.offset + s)
                    outs.append({n: cache.update(n, *inputs[n]) for n in inputs})
                    cache.commit()
            for n in inputs:
                for a, b_ in zip(outs[0][n], outs[1][n]):
                    assert torch.equal(a, b_)
            assert ours.length == ref.length and ours.offset == ref.offset

        forward(2, 6, store=True)  # prefill
        forward(2, 3)  # denoising steps: attend, keep nothing
        forward(2, 3)
        forward(2, 3, store=True)  # the finished block
        for n in (1, 2):
            assert all(torch.equal(a, b) for a, b in zip(ours.get(n), ref.get(n)))
        ours.truncate(5)
        ref.truncate(5)
        forward(2, 4)
        ours.repeat_interleave(2)  # a prompt's prefix for its completions
        ref.repeat_interleave(2)
        forward(4, 3, store=True)
        forward(4, 2, at=3)  # an LLaDA cached step: overwrite positions 3..4
        forward(4, 2, at=3)
        forward(4, 9, store=True, at=0)  # refill from the start
        ours.reset()
        ref.reset()
        assert ours.get(1) is None
        forward(1, 5, store=True)  # an emptied cache takes a new batch shape
    with pytest.raises(ValueError, match="cannot write at position"):
        with KVCache().writing_at(1):
            pass


class AppendedReference(torch.nn.Module):
    """The samplers' slot-addressed forwards replayed through an appended cache (the
    concatenating reference): a forward writing slots ``[a, b)`` appends at ``a``
    (``writing_at(a)`` inside ``storing()``) and attends to the positions written so far, under
    the step's mask cut to those keys. Independent of the slot path's ``index_copy_`` writes and
    its attention over the whole fixed-capacity cache."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.dllm_config = model, model.dllm_config
        self.reference = ConcatKVCache()
        self.logits = []

    def forward(self, ids, position_ids=None, attention_mask=None, *, kv_cache=None, cache_slots=None, **kw):
        if cache_slots is None and kv_cache is not None:  # SDAR's prefill: the prompt rows, appended
            self.reference.reset()
            with self.reference.storing():
                out = self.inner(ids, position_ids, attention_mask, kv_cache=self.reference, **kw)
        elif cache_slots is None:
            out = self.inner(ids, position_ids, attention_mask, **kw)
        else:
            start = int(cache_slots[0])
            assert torch.equal(cache_slots, torch.arange(start, start + ids.shape[1]))
            if start == 0:
                self.reference.reset()
            rows = next(iter(self.reference._kv.values()))[0].shape[0] if self.reference.length else ids.shape[0]
            if rows != ids.shape[0]:  # a prompt's prefill shared by its completions
                self.reference.repeat_interleave(ids.shape[0] // rows)
            if isinstance(attention_mask, AttentionLayout):
                attention_mask = attention_mask.over_slots(cache_slots, kv_cache.capacity)
            with self.reference.writing_at(start), self.reference.storing():
                keys = self.reference.key_length(ids.shape[1])
                mask = None if attention_mask is None else attention_mask[..., :keys]
                pos = cache_slots[None] if position_ids is None else position_ids
                out = self.inner(ids, pos, mask, kv_cache=self.reference, **kw)
        self.logits.append(out)
        return out


def _slot_and_appended_logits(generate, model, prompt, **kw):
    """Tokens and per-forward logits of the slot-addressed sampler and of its appended replay."""
    seen = []

    class Record(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.dllm_config = model, model.dllm_config

        def forward(self, *args, **kwargs):
            seen.append(self.inner(*args, **kwargs))
            return seen[-1]

    fast = generate(Record(), prompt, generator=torch.Generator().manual_seed(0), **kw)
    reference = AppendedReference(model)
    slow = generate(reference, prompt, generator=torch.Generator().manual_seed(0), **kw)
    return fast, slow, seen, reference.logits


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_llada_slot_addressed_decoding_equals_the_appended_cache(megatron_tp1, mode):
    model = _model("llada-tiny")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 250, (2, 6), generator=g)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, :2] = False
    kw = dict(gen_length=12, steps=6, block_length=4, prompt_valid=valid, cache=mode, progress=False, temperature=1.0)
    fast, slow, seen, reference = _slot_and_appended_logits(generate_llada, model, prompt, **kw)
    assert torch.equal(fast, slow)
    assert len(seen) == len(reference) == 6
    for a, b in zip(seen, reference):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_sdar_slot_addressed_decoding_equals_the_appended_cache(megatron_tp1):
    model = _model("sdar-tiny")
    prompt = torch.randint(0, 250, (2, 6), generator=torch.Generator().manual_seed(4))
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, :1] = False
    kw = dict(gen_length=12, steps=2, prompt_valid=valid, progress=False, temperature=1.0, repeats=2)
    fast, slow, seen, reference = _slot_and_appended_logits(generate_sdar, model, prompt, **kw)
    assert torch.equal(fast, slow)
    assert len(seen) == len(reference) == 8  # the prefill, 1 step for the prompt tail's block, 3 blocks x 2
    for a, b in zip(seen, reference):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_the_mask_over_cache_slots_is_the_layout_of_the_written_keys():
    """``over_slots`` for queries at the last ``sq`` of ``sk`` slots equals the layout's dense mask
    over those ``sk`` keys, and blocks every later slot for the block-causal pattern."""
    capacity = 20
    for layout in (
        AttentionLayout.block_causal(4),
        AttentionLayout.block_causal(4, pad=(0, 3, 9)),
        AttentionLayout.bidirectional(pad=(0, 3, 9)),
    ):
        for sq, sk in ((4, 12), (8, 12), (4, 16), (12, 12)):
            over = layout.over_slots(torch.arange(sk - sq, sk), capacity)
            dense = layout.dense(sq, sk)
            assert torch.equal(over[..., :sk].expand(-1, -1, sq, -1), dense.expand(-1, -1, sq, -1)), (layout, sq, sk)
            if layout.kind == "block_causal":
                assert over[..., sk:].all()
    assert AttentionLayout.bidirectional().over_slots(torch.arange(4), capacity) is None
    with pytest.raises(ValueError, match="staircase"):
        AttentionLayout.staircase(4).over_slots(torch.arange(4), capacity)


# ------------------------------------------------------------------ host reads per denoising step
class HostReads(TorchFunctionMode):
    """Counts what reads a tensor's value on the host (a device synchronisation on a GPU): value
    reads, and boolean-mask indexing / ``masked_select`` (their row count is data-dependent),
    except the CPU attention-layout descriptors the model decodes by design."""

    READS = {"item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__", "masked_select"}

    def __init__(self):
        super().__init__()
        self.count = 0
        self._checking = False  # the descriptor check's own reads are not the code's

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self._checking:
            pass
        elif name in self.READS and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            base = t if t._base is None else t._base
            self._checking = True
            try:
                self.count += not AttentionLayout.is_descriptor(base)
            finally:
                self._checking = False
        elif name == "__getitem__" and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            self.count += any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        return func(*args, **(kwargs or {}))


def _reads_per_step(generate, model, prompt, **kw):
    """(reads before the first step, reads between consecutive steps)."""
    marks = []
    with HostReads() as reads:
        generate(model, prompt, on_step=lambda *_: marks.append(reads.count), progress=False, **kw)
    return marks[0], [b - a for a, b in zip(marks, marks[1:])], reads.count - marks[-1]


@pytest.mark.parametrize(
    "options",
    [
        dict(cache="none"),
        dict(cache="prefix"),
        dict(cache="dual", temperature=1.0),
        dict(cache="dual", threshold=0.9, stop_at_eos=True),
        dict(
            cache="prefix",
            threshold=0.5,
            temperature=1.0,
            repeats=4,
            row_chunks=[(2, torch.Generator().manual_seed(1)), (2, torch.Generator().manual_seed(2))],
        ),
    ],
)
def test_llada_reads_the_device_at_most_once_per_step(megatron_tp1, options):
    """One read per step where the step decides on the host (a threshold's count, ``stop_at_eos``);
    none without either (issue 71: an extra read per step passed the bound of one)."""
    model = _model("llada-tiny")
    prompt = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(5))
    if options.get("temperature") and "row_chunks" not in options:
        options = dict(options, generator=torch.Generator().manual_seed(0))
    before, steps, after = _reads_per_step(
        generate_llada, model, prompt, gen_length=16, steps=16, block_length=4, **options
    )
    reads = int(options.get("threshold") is not None or options.get("stop_at_eos", False))
    assert before <= 1 and after <= 1
    assert len(steps) == 15 and max(steps) == reads, steps


@pytest.mark.parametrize(
    "options",
    [
        dict(threshold=None),
        dict(threshold=0.9, stop_at_eos=True, temperature=0.9),  # the SDAR recipe's sampler settings
    ],
)
def test_sdar_reads_the_device_at_most_once_per_step(megatron_tp1, options):
    """Chunked like the SDAR recipe's rollout (micro-batches of 2 rows in one group's batch)."""
    model = _model("sdar-tiny")
    prompt = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(6))
    valid = torch.ones(1, 6, dtype=torch.bool)
    chunks = [(2, torch.Generator().manual_seed(k)) for k in range(4)]
    before, steps, after = _reads_per_step(
        generate_sdar,
        model,
        prompt,
        gen_length=16,
        steps=4,
        repeats=8,
        row_chunks=chunks,
        prompt_valid=valid,
        **options,
    )
    assert before <= 1 and after <= 1  # the prompt's pad counts
    assert steps and max(steps) <= 1, steps


def test_the_toy_model_takes_the_same_cache_and_head_positions():
    model = ToyDiffusionLM(ToyDLLMConfig(arch="sdar", vocab_size=32, mask_token_id=31), dtype=torch.float64)
    ids = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(7))
    layout = AttentionLayout.block_causal(4)
    full = model(ids, attention_mask=layout)
    assert torch.allclose(model(ids, attention_mask=layout, logit_positions=slice(4, 8)), full[:, 4:8])
    cache = KVCache()
    with cache.storing():
        model(ids[:, :8], attention_mask=layout, kv_cache=cache, logit_positions=slice(0, 0))
    assert torch.allclose(model(ids[:, 8:], attention_mask=layout, kv_cache=cache), full[:, 8:])


def test_a_stored_write_at_an_earlier_position_replaces_it_and_keeps_the_cache_length():
    """``writing_at(s)`` inside ``storing()``: the forward's keys replace positions s..s+S-1 and
    the cache keeps every later position (its length never shrinks to the last write)."""
    cache = KVCache(capacity=8)
    first = torch.arange(6.0).reshape(1, 1, 6, 1)
    with cache.storing():
        cache.update(1, first, -first)
        cache.commit()
    assert cache.length == 6
    with cache.storing(), cache.writing_at(2):
        keys, values = cache.update(1, torch.full((1, 1, 2, 1), 9.0), torch.full((1, 1, 2, 1), -9.0))
        assert keys.shape[2] == 6  # attends to every cached position
        cache.commit()
    assert cache.length == 6
    key, value = cache.get(1)
    assert key.flatten().tolist() == [0.0, 1.0, 9.0, 9.0, 4.0, 5.0]
    assert value.flatten().tolist() == [-0.0, -1.0, -9.0, -9.0, -4.0, -5.0]


def test_a_slot_write_from_a_start_keeps_the_slots_before_it():
    """``writing_from(start)`` (a 0-d tensor, LLaDA's compiled prefix window): a slot-addressed
    forward writes the slots from ``start`` on; the earlier slots it forwards keep their keys."""
    cache = KVCache(capacity=6)
    cache.allocate({1: (1, 1)}, 1, torch.float32, "cpu")
    cache.slots = torch.arange(6)
    cache.update(1, torch.arange(6.0).reshape(1, 1, 6, 1), -torch.arange(6.0).reshape(1, 1, 6, 1))
    cache.slots = torch.arange(2, 6)  # a window over slots 2..5, written from slot 4 on
    with cache.writing_from(torch.tensor(4)):
        keys, values = cache.update(1, torch.full((1, 1, 4, 1), 9.0), torch.full((1, 1, 4, 1), -9.0))
    assert cache.write_from is None
    assert keys.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 9.0, 9.0]
    assert values.flatten().tolist() == [-0.0, -1.0, -2.0, -3.0, -9.0, -9.0]

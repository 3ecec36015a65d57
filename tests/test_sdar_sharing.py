"""SDAR prefix sharing: a prompt's prefill computed once for its G completions, same tokens as without."""

import pytest
import torch
from test_models_hf import megatron_tp1  # noqa: F401  (module-scoped Megatron TP=1 state)

from stabledrl_mcore.diffusion import generate_sdar
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig

MASK = 15


def toy():
    cfg = ToyDLLMConfig(
        arch="sdar",
        vocab_size=16,
        mask_token_id=MASK,
        eos_token_id=1,
        block_size=4,
        hidden_size=32,
        num_layers=2,
        logit_scale=3.0,
    )
    return ToyDiffusionLM(cfg, seed=0, dtype=torch.float64)


def left_padded(B=3, P=10):
    ids = torch.randint(2, 15, (B, P), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(B, P, dtype=torch.bool)
    valid[1, :3] = False  # row 1 is left padded
    ids[1, :3] = 0
    return ids, valid


class Spy(torch.nn.Module):
    """Records the batch size and length of every forward."""

    def __init__(self, model):
        super().__init__()
        self.model, self.dllm_config, self.calls = model, model.dllm_config, []

    def forward(self, ids, *args, **kwargs):
        self.calls.append(tuple(ids.shape))
        return self.model(ids, *args, **kwargs)


@pytest.mark.parametrize("threshold", [None, 0.3])
@pytest.mark.parametrize("P", [10, 8])  # the first decoded block holds the prompt's tail / starts clean
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefill_gives_the_tokens_of_repeated_prompts(threshold, P, temperature):
    ids, valid = left_padded(P=P)
    kw = dict(gen_length=8, steps=2, threshold=threshold, temperature=temperature, progress=False)
    spy = Spy(toy())
    shared = generate_sdar(spy, ids, prompt_valid=valid, repeats=3, generator=torch.Generator().manual_seed(5), **kw)
    plain = generate_sdar(
        toy(),
        ids.repeat_interleave(3, 0),
        prompt_valid=valid.repeat_interleave(3, 0),
        generator=torch.Generator().manual_seed(5),
        **kw,
    )
    assert shared.shape == plain.shape == (9, -(-(P + 8) // 4) * 4)
    assert torch.equal(shared, plain)
    assert spy.calls[0] == (3, P // 4 * 4), "the prompt blocks are prefilled once per prompt"
    assert all(b == 9 for b, _ in spy.calls[1:])


def test_uneven_repeats_and_no_cache_reference():
    ids, valid = left_padded(P=10)
    kw = dict(gen_length=8, steps=4, progress=False, prompt_valid=valid)
    counts = [1, 3, 2]
    shared = generate_sdar(toy(), ids, repeats=counts, **kw)
    rep = torch.tensor(counts)
    reference = generate_sdar(
        toy(), ids.repeat_interleave(rep, 0), use_cache=False, **{**kw, "prompt_valid": valid.repeat_interleave(rep, 0)}
    )
    assert torch.equal(shared, reference)
    assert torch.equal(generate_sdar(toy(), ids, repeats=counts, use_cache=False, **kw), reference)
    with pytest.raises(ValueError, match="repeats must be"):
        generate_sdar(toy(), ids, repeats=[1, 2], **kw)


def test_decoding_batches_cover_whole_groups():
    from stabledrl_mcore.rl.group_rollout import decode_rows, prompt_counts

    assert prompt_counts(0, 8, 4) == (slice(0, 2), [4, 4])
    assert prompt_counts(3, 6, 4) == (slice(0, 2), [1, 2])
    assert prompt_counts(6, 8, 4) == (slice(1, 2), [2])
    assert decode_rows(2, 16) == 16 and decode_rows(8, 8) == 8 and decode_rows(12, 8) == 24
    assert decode_rows(16, 4) == 16 and decode_rows(7, 16) == 7  # lcm 112 > 4 x 16: one micro-batch


@pytest.mark.parametrize("threshold, stop_at_eos", [(None, False), (0.1, False), (0.2, True)])
def test_chunks_decoded_together_draw_as_if_alone(threshold, stop_at_eos):
    """row_chunks: one batch of three micro-batches gives each the tokens it gets alone."""
    ids, valid = left_padded(P=10)
    kw = dict(gen_length=12, steps=3, threshold=threshold, temperature=1.0, stop_at_eos=stop_at_eos, progress=False)
    counts, sizes = [3, 3, 2], [3, 2, 3]
    one = generate_sdar(
        toy(), ids, prompt_valid=valid, repeats=counts, row_chunks=[(8, torch.Generator().manual_seed(10))], **kw
    )
    assert torch.equal(
        one,
        generate_sdar(
            toy(), ids, prompt_valid=valid, repeats=counts, generator=torch.Generator().manual_seed(10), **kw
        ),
    )
    rep = torch.tensor(counts)
    full_ids, full_valid = ids.repeat_interleave(rep, 0), valid.repeat_interleave(rep, 0)
    together = generate_sdar(
        toy(),
        ids,
        prompt_valid=valid,
        repeats=counts,
        row_chunks=[(n, torch.Generator().manual_seed(10 + k)) for k, n in enumerate(sizes)],
        **kw,
    )
    alone, start = [], 0
    for k, n in enumerate(sizes):
        alone.append(
            generate_sdar(
                toy(),
                full_ids[start : start + n],
                prompt_valid=full_valid[start : start + n],
                generator=torch.Generator().manual_seed(10 + k),
                **kw,
            )
        )
        start += n
    width = max(a.shape[1] for a in alone)
    assert together.shape[1] == width
    assert torch.equal(together, torch.cat(alone))
    with pytest.raises(ValueError, match="row_chunks must split"):
        generate_sdar(toy(), ids, prompt_valid=valid, repeats=counts, row_chunks=[(3, None)], **kw)


def _micro_batch_rollouts(
    model,
    prompt_ids,
    prompt_valid,
    *,
    group_size,
    micro_batch,
    chunk_generator,
    first_chunk=0,
    progress=False,
    rows=None,
    **kw,
):
    """The reference: the repeated prompts decoded micro-batch by micro-batch, each with its generator."""
    from stabledrl_mcore.diffusion import generate

    ids, valid = prompt_ids.repeat_interleave(group_size, 0), prompt_valid.repeat_interleave(group_size, 0)
    return [
        generate(
            model,
            ids[a : a + micro_batch],
            prompt_valid=valid[a : a + micro_batch],
            generator=chunk_generator(first_chunk + k),
            progress=progress,
            **kw,
        )
        for k, a in enumerate(range(0, ids.shape[0], micro_batch))
    ]


@pytest.mark.parametrize(
    "arch,temperature,cache",
    [("sdar", 0.0, "none"), ("sdar", 1.0, "none"), ("llada", 1.0, "none"), ("llada", 0.0, "dual")],
)
def test_rollout_batch_is_the_same_with_sharing(megatron_tp1, monkeypatch, arch, temperature, cache):
    """Megatron sdar-tiny / llada-tiny through generate_rollouts; micro-batches of 3 rows split groups of 2:
    whole groups decoded together (SDAR: each prompt prefilled once) equal micro-batch decoding."""
    from test_device_rule import CharTokenizer

    from stabledrl_mcore.models import KVCache, build_model, get_preset
    from stabledrl_mcore.rl import rollout
    from stabledrl_mcore.tasks import get_task

    torch.manual_seed(0)
    model = build_model(get_preset(f"{arch}-tiny"))
    task = get_task("sudoku", prompt_style="compact")
    examples = task.load("train", n=3, seed=0)
    repeats, forwards = [], []
    original = KVCache.copy_rows_from
    monkeypatch.setattr(KVCache, "copy_rows_from", lambda self, src, r: (repeats.append(r), original(self, src, r)))
    model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(
            kwargs["input_ids"].shape[0] if "input_ids" in kwargs else args[0].shape[0]
        ),
        with_kwargs=True,
    )

    def run():
        return rollout.generate_rollouts(
            model,
            CharTokenizer(),
            task,
            examples,
            group_size=2,
            gen_length=8,
            steps=2 if arch == "sdar" else 4,
            block_length=4,
            temperature=temperature,
            threshold=0.9,
            micro_batch=3,
            cache=cache,
            chunk_generator=lambda k: torch.Generator(device="cpu").manual_seed(k),
        )

    shared = run()
    if arch == "sdar":
        assert len(repeats) == 1, "one decoding batch of 6 rows (lcm of 3 and 2), each prompt prefilled once"
    # every decoding forward covers the 6 rows of the 3 groups (SDAR's prefill: the 3 prompts once)
    assert set(forwards) == ({3, 6} if arch == "sdar" else {6})
    monkeypatch.setattr(rollout, "group_rollouts", _micro_batch_rollouts)
    forwards.clear()
    plain = run()
    assert set(forwards) == {3}  # micro-batches of 3 rows
    assert torch.equal(shared.sequences, plain.sequences)
    assert shared.completions == plain.completions and shared.prompt_len == plain.prompt_len
    for name in ("prompt_valid", "completion_mask", "group_index"):
        assert torch.equal(getattr(shared, name), getattr(plain, name)), name


@pytest.mark.parametrize(
    "rows,sizes", [(None, [6, 2]), (6, [6, 2]), (3, [3, 3, 2])], ids=["default", "decode_rows6", "decode_rows3"]
)
@pytest.mark.parametrize("arch", ["sdar", "llada"])
def test_rollouts_past_one_decoding_batch_draw_from_the_global_micro_batch(arch, rows, sizes):
    """4 prompts x G=2 at micro-batch 3 decode in more than one batch: by default and with
    ``rollout.decode_rows=6`` (``rows``) lcm(3, 2) = 6 rows, then 2; with ``rollout.decode_rows=3``
    (one micro-batch) 3, 3, 2. A later batch's micro-batch is its global one, so it draws from
    chunk_generator(first + k), not again from the first batch's generators; the rows equal
    micro-batch by micro-batch decoding."""
    from stabledrl_mcore.rl.group_rollout import group_rollouts

    model = toy()
    if arch == "llada":
        cfg = ToyDLLMConfig(vocab_size=16, mask_token_id=MASK, eos_token_id=1, hidden_size=32, num_layers=2)
        model = ToyDiffusionLM(cfg, seed=0, dtype=torch.float64)
    ids, valid = left_padded(B=4, P=8)
    asked = []

    def chunk_generator(k):
        asked.append(k)
        return torch.Generator().manual_seed(100 + k)

    kw = dict(gen_length=8, steps=2, block_length=4, temperature=1.0, threshold=None, micro_batch=3)
    batches = group_rollouts(
        model, ids, valid, group_size=2, chunk_generator=chunk_generator, first_chunk=5, rows=rows, **kw
    )
    assert [b.shape[0] for b in batches] == sizes, "more than one decoding batch: the case under test"
    assert asked == [5, 6, 7], asked
    reference = _micro_batch_rollouts(
        model,
        ids,
        valid,
        group_size=2,
        chunk_generator=lambda k: torch.Generator().manual_seed(100 + k),
        first_chunk=5,
        **kw,
    )
    assert torch.equal(torch.cat(batches), torch.cat(reference))

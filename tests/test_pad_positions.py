"""Padding never counts as a position (issue: compiled decoding changed the demo model's answers).

A left-padded row must get the positions, hence the logits and the tokens, it gets alone, for every
position scheme the models have: RoPE (LLaDA, SDAR), learned absolute positions, and the demo's
learned positions restarting after a separator; eager and compiled (whose prompts are padded to a
multiple of 64 tokens); in decoding and in the RL likelihood that scores the rollouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_models_hf import megatron_tp1  # noqa: F401  (module-scoped Megatron TP=1 state)

from stabledrl_mcore.diffusion import generate
from stabledrl_mcore.models import build_model, get_preset, position_inputs, segment_positions
from stabledrl_mcore.models.decoding import PROMPT_MULTIPLE, DecodingForward, prompt_padding
from stabledrl_mcore.models.masks import AttentionLayout, padding_mask
from stabledrl_mcore.rl.estimates import LikelihoodSpec, draw_plan, token_logp
from stabledrl_mcore.rl.rollout import RolloutBatch
from stabledrl_mcore.tasks.prompts import encode_prompts

SEPARATOR = 7
SCHEMES = {
    # name: (preset, overrides); the demo's model is "separator" (learned positions restarting after '=')
    "rope": ("llada-tiny", {}),
    "learned": ("llada-tiny", dict(position_embedding="learned")),
    "separator": ("llada-tiny", dict(position_embedding="learned", segment_separator_id=SEPARATOR, num_segments=2)),
    "sdar": ("sdar-tiny", {}),
}


def _model(scheme):
    preset, overrides = SCHEMES[scheme]
    torch.manual_seed(0)
    return build_model(get_preset(preset, init_std=0.2, num_layers=2, **overrides)).eval()


def _row(length=6):
    ids = torch.randint(8, 250, (1, length), generator=torch.Generator().manual_seed(1))
    ids[0, -1] = SEPARATOR  # the demo's prompts end with their separator ('=')
    return ids


def _padded(row, pads, pad_id=0):
    ids = torch.cat([torch.full((1, pads), pad_id), row], 1)
    valid = torch.cat([torch.zeros(1, pads, dtype=torch.bool), torch.ones_like(row, dtype=torch.bool)], 1)
    return ids, valid


def test_segment_positions_skip_the_pads_and_a_pad_is_never_a_separator():
    ids = torch.tensor([[7, 7, 3, 4, 7, 5, 6]])  # two pads that happen to equal the separator
    valid = torch.tensor([[False, False, True, True, True, True, True]])
    positions, segments = segment_positions(ids, 7, valid)
    assert positions.tolist() == [[0, 0, 0, 1, 2, 0, 1]]
    assert segments.tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    alone = segment_positions(ids[:, 2:], 7)
    assert positions[:, 2:].tolist() == alone[0].tolist() and segments[:, 2:].tolist() == alone[1].tolist()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_left_padded_row_has_the_logits_it_has_alone(megatron_tp1, scheme):
    model = _model(scheme)
    row = _row(8)
    pads = 4  # a whole SDAR block
    ids, valid = _padded(row, pads)
    cfg = model.dllm_config
    if cfg.arch == "sdar":
        layout = AttentionLayout.block_causal(cfg.block_size)
        mask_alone, mask_padded = layout, layout.with_padding((pads,))
    else:
        mask_alone, mask_padded = None, padding_mask(valid)
    with torch.no_grad():
        alone = model(row, attention_mask=mask_alone, **position_inputs(cfg, row, None))
        padded = model(ids, attention_mask=mask_padded, **position_inputs(cfg, ids, valid))
    assert torch.allclose(padded[:, pads:], alone, atol=1e-5, rtol=0), (padded[:, pads:] - alone).abs().max()


CASES = {
    "separator-exact": ("separator", dict(cache="none", steps=8, block_length=4)),
    "separator-dual": ("separator", dict(cache="dual", steps=8, block_length=4)),
    "separator-prefix": ("separator", dict(cache="prefix", steps=8, block_length=4)),
    "learned-exact": ("learned", dict(cache="none", steps=8, block_length=4)),
    "rope-dual": ("rope", dict(cache="dual", steps=8, block_length=4)),
    "sdar": ("sdar", dict(steps=2, block_length=None)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_padded_row_decodes_the_tokens_it_decodes_alone(megatron_tp1, case):
    scheme, options = CASES[case]
    model = _model(scheme)
    row = _row(6)
    ids, valid = _padded(row, 8)  # 8: whole SDAR blocks, so the block grid over the row is kept
    alone = generate(model, row, gen_length=8, **options)
    padded = generate(model, ids, gen_length=8, prompt_valid=valid, **options)
    assert padded[:, 8:].tolist() == alone.tolist()


@pytest.mark.parametrize(
    "scheme,cache",
    [("separator", "none"), ("sdar", None), ("rope", "prefix"), ("learned", "prefix"), ("separator", "prefix")],
)
def test_compiled_decoding_of_padded_prompts_gives_the_eager_tokens(megatron_tp1, scheme, cache):
    """The compiled path's prompts are widened to a multiple of 64 tokens (prompt_padding): the
    demo's kind of model then decoded other tokens than eagerly (positions counted the pads). The
    prefix cache's compiled step (a fixed window over the generation, the cache written from the
    block on) gives the eager tokens for every position scheme too."""
    model = _model(scheme)
    cfg = model.dllm_config

    class Tokenizer:  # encode_prompts' protocol: the texts are ids already
        pad_token_id = cfg.pad_token_id

        @staticmethod
        def encode(text):
            return [int(t) for t in text.split()]

    # 6 and 7 tokens: the widest is not a whole number of SDAR blocks
    texts = [" ".join(map(str, _row(6)[0].tolist())), " ".join(map(str, _row(9)[0, 2:].tolist()))]
    options = (
        dict(gen_length=8, steps=4, block_length=None)
        if scheme == "sdar"
        else dict(gen_length=8, steps=8, block_length=4, cache=cache)
    )
    compiled = DecodingForward(model, "default", backend="aot_eager")  # Dynamo's capture, no inductor
    eager_ids, eager_valid = encode_prompts(Tokenizer, texts, **prompt_padding("none", model))
    wide_ids, wide_valid = encode_prompts(Tokenizer, texts, **prompt_padding(compiled, model))
    assert wide_ids.shape[1] > eager_ids.shape[1] and wide_ids.shape[1] <= PROMPT_MULTIPLE
    eager = generate(model, eager_ids, prompt_valid=eager_valid, **options)
    fast = generate(model, wide_ids, prompt_valid=wide_valid, compile=compiled, **options)
    assert compiled.stats.graphs > 0
    shift = wide_ids.shape[1] - eager_ids.shape[1]
    assert fast[:, shift:].tolist() == eager.tolist()


def test_compiled_prompts_are_widened_by_whole_sdar_blocks(megatron_tp1):
    """SDAR's blocks are columns of the batch: a width that moved the grid over the prompts' tokens
    would decode other blocks than eagerly; LLaDA's blocks start after the prompt, any width keeps them."""
    sdar, llada = _model("sdar"), _model("rope")

    class Tokenizer:
        pad_token_id = 0

        @staticmethod
        def encode(text):
            return [5] * int(text)

    for widest in (1, 6, 63, 64, 66, 130):
        eager = encode_prompts(Tokenizer, [str(widest), "1"])[0].shape[1]
        for model, block in ((sdar, sdar.dllm_config.block_size), (llada, 1)):
            wide = encode_prompts(Tokenizer, [str(widest), "1"], **prompt_padding("default", model))[0].shape[1]
            assert wide >= eager and (wide - eager) % block == 0 and wide > PROMPT_MULTIPLE * ((eager - 1) // 64)
            assert wide == eager or -(-eager // PROMPT_MULTIPLE) * PROMPT_MULTIPLE - wide < block


@pytest.mark.parametrize("scheme,kind", [("separator", "elbo"), ("learned", "elbo"), ("sdar", "staircase")])
def test_the_rl_likelihood_scores_a_padded_row_as_it_scores_it_alone(megatron_tp1, scheme, kind):
    model = _model(scheme)
    cfg = model.dllm_config
    row = torch.cat([_row(6), torch.randint(8, 250, (1, 8), generator=torch.Generator().manual_seed(2))], 1)
    spec = LikelihoodSpec(kind=kind, num_mc=1, block_size=cfg.block_size if kind == "staircase" else None)

    def batch_of(sequences, valid, prompt_len):
        return RolloutBatch(
            sequences=sequences,
            prompt_len=prompt_len,
            prompt_valid=valid,
            completion_mask=torch.arange(sequences.shape[1])[None] >= prompt_len,
            group_index=torch.zeros(1, dtype=torch.long),
            completions=[""],
            references=[None],
        )

    def scored(batch, plan):
        with torch.no_grad():
            return token_logp(model, batch, plan, spec, rows=slice(0, 1), mask_id=cfg.mask_token_id, draw=0)

    alone_batch = batch_of(row, torch.ones_like(row, dtype=torch.bool), 6)
    plan = draw_plan(alone_batch, spec, lambda k: torch.Generator().manual_seed(5), micro_batch=1)
    ids, valid = _padded(row, 8)
    padded_plan = dataclasses.replace(plan, masked=F.pad(plan.masked, (8, 0)), weight=F.pad(plan.weight, (8, 0)))
    alone, padded = scored(alone_batch, plan), scored(batch_of(ids, valid, 14), padded_plan)
    assert alone.abs().sum() > 0
    assert torch.allclose(padded[:, 8:], alone, atol=1e-5, rtol=0), (padded[:, 8:] - alone).abs().max()

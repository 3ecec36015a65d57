"""LLaDA cached decoding (issue 24): exact mode unchanged, prefix/dual cache, Fast-dLLM's threshold rule.

- ``cache="none"`` is today's sampler bit for bit (tokens recorded from the code before the change);
- the cached path with its cache rebuilt at every step decodes exactly as ``none`` (float64 toy);
- at a block's first step the cached forward of the block equals the full forward (Megatron model),
  at TP=1 and TP=2, and cached decoding under TP=2 equals TP=1; one StableDRL step with
  ``rollout.cache=dual`` trains (TP=2) -- one spawned job for all of it;
- the threshold rule is a naive re-implementation of Fast-dLLM's ``get_transfer_index``;
- ``rollout.cache`` / ``--cache`` are refused for SDAR by name; ``generate --cache dual`` runs.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from stabledrl_mcore.diffusion import DecodeStats, generate, generate_llada
from stabledrl_mcore.diffusion.sampling_llada import threshold_transfer
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.parallel.launch import spawn

MASK = 15
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")


def toy(arch="llada", seed=0):
    cfg = ToyDLLMConfig(
        arch=arch, vocab_size=16, mask_token_id=MASK, eos_token_id=1, hidden_size=32, num_layers=2, logit_scale=3.0
    )
    return ToyDiffusionLM(cfg, seed=seed, dtype=torch.float64)


def prompts():
    return torch.randint(2, 15, (2, 4), generator=torch.Generator().manual_seed(1))


VALID = torch.tensor([[False, True, True, True], [True] * 4])


def trace_hook(trace):
    return lambda step, transfer, x: trace.append(transfer.clone())


def run(model, cache="none", stats=None, trace=None, **kw):
    return generate_llada(
        model,
        prompts(),
        generator=torch.Generator().manual_seed(2),
        progress=False,
        cache=cache,
        stats=stats,
        on_step=None if trace is None else trace_hook(trace),
        **kw,
    )


# the completions of main's sampler (before issue 24) for these cases, recorded
CASES = {
    "greedy_padded": (
        dict(gen_length=8, steps=4, block_length=4, prompt_valid=VALID),
        [[3, 3, 6, 6, 3, 8, 8, 3], [3, 3, 12, 12, 3, 3, 8, 8]],
    ),
    "sampled_random": (
        dict(gen_length=8, steps=8, block_length=4, temperature=1.0, remasking="random"),
        [[3, 6, 12, 6, 8, 3, 3, 14], [14, 12, 8, 14, 12, 3, 6, 8]],
    ),
    "cfg": (
        dict(gen_length=8, steps=4, block_length=8, cfg_scale=0.5, temperature=0.7),
        [[3, 3, 3, 3, 8, 8, 12, 3], [3, 3, 3, 8, 12, 3, 3, 12]],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_mode_is_todays_sampler_bit_for_bit(case):
    kw, want = CASES[case]
    model, calls = toy(), []
    forward = model.forward
    model.forward = lambda ids, *a, **k: calls.append((ids.shape[1], k.get("kv_cache"))) or forward(ids, *a, **k)
    stats = DecodeStats()
    out = run(model, stats=stats, **kw)
    assert out[:, 4:].tolist() == want
    assert all(length == 12 and cache is None for length, cache in calls)  # a full forward per step
    assert stats.full_forwards == len(calls) == kw["steps"] and stats.block_forwards == 0


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("case", sorted(CASES) + ["threshold"])
def test_cache_rebuilt_every_step_decodes_as_exact(mode, case):
    kw = dict(gen_length=8, steps=8, block_length=4, threshold=0.4) if case == "threshold" else CASES[case][0]
    model = toy()
    want_trace, got_trace, stats = [], [], DecodeStats()
    want = run(model, trace=want_trace, **kw)
    got = run(model, mode, stats=stats, trace=got_trace, refresh_every_step=True, **kw)
    assert torch.equal(got, want)
    assert len(got_trace) == len(want_trace) and all(map(torch.equal, got_trace, want_trace))
    assert stats.block_forwards == stats.steps - kw["gen_length"] // kw["block_length"]  # later steps cached


def test_decode_stats_count_forwards_and_measure_the_gap():
    model = toy()
    for mode in ("prefix", "dual"):
        stats = DecodeStats(measure_gap=True)
        out = run(model, mode, stats=stats, gen_length=8, steps=8, block_length=4, prompt_valid=VALID)
        assert not (out == MASK).any()
        assert (stats.full_forwards, stats.block_forwards, stats.gap_tokens) == (2, 6, 16)
        assert 0.0 < stats.mean_gap < 10.0  # the cache is approximate, and measurably so
        reference = DecodeStats(measure_gap=True)
        run(model, mode, stats=reference, refresh_every_step=True, gen_length=8, steps=8, block_length=4)
        assert reference.mean_gap < 1e-9


# ------------------------------------------------------------------ Fast-dLLM's threshold rule


def naive_get_transfer_index(logits, mask_index, x, threshold):
    """Fast-dLLM ``llada/generate.py`` ``get_transfer_index`` (greedy, low_confidence, with a threshold),
    written naively: per row, rank the masked positions by confidence; keep the first, and each
    later one whose confidence is not below the threshold."""
    x0 = logits.argmax(-1)
    p = torch.softmax(logits.double(), -1)
    transfer = torch.zeros_like(x0, dtype=torch.bool)
    for j in range(x0.shape[0]):
        masked = [i for i in range(x0.shape[1]) if mask_index[j, i]]
        ranked = sorted(masked, key=lambda i: -float(p[j, i, x0[j, i]]))
        for rank, i in enumerate(ranked):
            if rank == 0 or float(p[j, i, x0[j, i]]) >= threshold:
                transfer[j, i] = True
    return torch.where(mask_index, x0, x), transfer


def test_threshold_rule_equals_fast_dllm_get_transfer_index():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(3, 7, 5, generator=g, dtype=torch.float64) * 3
        mask_index = torch.rand(3, 7, generator=g) < 0.6
        mask_index[0] = False  # a row with nothing left to commit
        x = torch.zeros(3, 7, dtype=torch.long)
        threshold = [0.3, 0.6, 0.9, 1.0][trial % 4]
        _, want = naive_get_transfer_index(logits, mask_index, x, threshold)
        p = torch.softmax(logits.float(), -1)
        conf = p.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
        conf = torch.where(mask_index, conf, torch.full_like(conf, -torch.inf))
        assert torch.equal(threshold_transfer(conf, torch.ones(3, dtype=torch.long), threshold), want)
        floor = threshold_transfer(conf, torch.full((3,), 3), threshold)  # at least the schedule's k
        assert torch.equal(floor.sum(-1), torch.maximum(want.sum(-1), mask_index.sum(-1).clamp(max=3)))


def naive_fast_dllm_generate(model, prompt, *, gen_length, block_length, threshold):
    """Fast-dLLM's ``generate`` with a threshold: per block, a full forward and commit until no mask is left."""
    P = prompt.shape[1]
    x = torch.cat([prompt, torch.full((prompt.shape[0], gen_length), MASK)], 1)
    trace = []
    for blk in range(gen_length // block_length):
        end = P + (blk + 1) * block_length
        while bool((x[:, end - block_length : end] == MASK).any()):
            mask_index = x == MASK
            mask_index[:, end:] = False
            x0, transfer = naive_get_transfer_index(model(x), mask_index, x, threshold)
            x = torch.where(transfer, x0, x)
            trace.append(transfer)
    return x, trace


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_threshold_decoding_follows_fast_dllm_step_for_step(cache):
    model = toy()
    with torch.no_grad():
        want, want_trace = naive_fast_dllm_generate(model, prompts(), gen_length=8, block_length=4, threshold=0.35)
    trace, stats = [], DecodeStats()
    got = run(
        model,
        cache,
        stats=stats,
        trace=trace,
        gen_length=8,
        steps=8,
        block_length=4,
        threshold=0.35,
        refresh_every_step=cache != "none",
    )
    assert torch.equal(got, want) and not (got == MASK).any()
    assert len(trace) == len(want_trace) < 8  # blocks end early: fewer forwards than tokens
    assert all(torch.equal(a[:, 4:], b[:, 4:]) for a, b in zip(trace, want_trace))


# ------------------------------------------------------------------ refusals for SDAR


def test_cache_gap_needs_a_cache():
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.schema import load_config

    with pytest.raises(ConfigError, match="rollout.cache_gap_every=2 .*rollout.cache=prefix"):
        load_config(CONFIG, ["rollout.cache_gap_every=2"])
    assert load_config(CONFIG, ["rollout.cache_gap_every=2", "rollout.cache=dual"]).rollout.cache_gap_every == 2


def test_cache_is_refused_for_sdar_and_unknown_modes(capsys):
    from stabledrl_mcore.cli.app import main
    from stabledrl_mcore.cli.args import sampling_options
    from stabledrl_mcore.common.errors import ConfigError, UserError
    from stabledrl_mcore.config.schema import load_config

    with pytest.raises(ConfigError, match="rollout.cache must be one of"):
        load_config(CONFIG, ["rollout.cache=full"])
    with pytest.raises(ValueError, match="SDAR decodes with its own KV cache"):
        generate(toy("sdar"), prompts(), gen_length=4, steps=4, block_length=None, cache="dual")
    with pytest.raises(ValueError, match="cache must be one of"):
        generate_llada(toy(), prompts(), gen_length=4, steps=4, block_length=4, cache="full")
    args = type(
        "Args",
        (),
        dict(
            steps=None, block_length=None, gen_length=8, temperature=0.0, threshold=None, cache="prefix", compile="none"
        ),
    )()
    with pytest.raises(UserError, match="--cache prefix is LLaDA's"):
        sampling_options(args, ToyDLLMConfig(arch="sdar"))
    assert sampling_options(args, ToyDLLMConfig(arch="llada"))["cache"] == "prefix"
    assert main(["train", "--config", CONFIG, "model.preset=sdar-tiny", "rollout.cache=dual", "--print-config"]) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and "rollout.cache=dual is LLaDA's" in line and "rollout.cache=none" in line


def test_generate_cli_with_dual_cache_and_threshold(tmp_path):
    from hf_fixtures import write_hf_checkpoint

    from stabledrl_mcore.cli.app import main
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    ckpt = write_hf_checkpoint(str(tmp_path / "llada"), "llada", seed=3)
    out = tmp_path / "out.jsonl"
    try:
        assert (
            main(
                [
                    "generate",
                    "--ckpt",
                    ckpt,
                    "--prompt",
                    "tok5 tok6",
                    "--prompt",
                    "tok7",
                    "--gen-length",
                    "8",
                    "--block-length",
                    "4",
                    "--cache",
                    "dual",
                    "--threshold",
                    "0.9",
                    "--no-progress",
                    "--no-chat-template",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        bootstrap.destroy()
        cpu_compat.disable()
    assert len([json.loads(line) for line in open(out)]) == 2


# ------------------------------------------------------------------ Megatron model, TP=2 == TP=1, trainer


def _worker(result_dir, run_dir):
    from megatron.core import parallel_state
    from test_models_hf import hf_to_megatron, load_into, make_hf_model, tiny_cfg

    from stabledrl_mcore.diffusion.sampling_llada import BlockLogits
    from stabledrl_mcore.models import build_model
    from stabledrl_mcore.models.masks import padding_mask
    from stabledrl_mcore.parallel import bootstrap

    rank = int(os.environ["RANK"])
    cfg = tiny_cfg("llada")
    # the demo's input scheme: learned positions restarting after a separator, segment embeddings
    separated = tiny_cfg("llada", position_embedding="learned", segment_separator_id=7, num_segments=2)
    hf = make_hf_model(cfg)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(8, 90, (2, 5), generator=g)
    prompt[:, 3] = 7
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[0, :2] = False
    for tp in (2, 1):
        bootstrap.initialize(tp, 1, seed=0)
        model = build_model(cfg).eval()
        load_into(
            model,
            hf_to_megatron(hf.state_dict(), cfg, tp_size=tp, tp_rank=parallel_state.get_tensor_model_parallel_rank()),
        )
        torch.manual_seed(0)
        result = {}
        with torch.no_grad():
            # a middle block, earlier ones committed: the cached forward at the block's first step
            x = torch.cat(
                [
                    prompt,
                    torch.randint(0, 90, (2, 4), generator=torch.Generator().manual_seed(1)),
                    torch.full((2, 8), cfg.mask_token_id),
                ],
                1,
            )
            keys = torch.cat([valid, torch.ones(2, 12, dtype=torch.bool)], 1)
            for name, net in (("", model), ("separated/", build_model(separated).eval())):
                for mode in ("prefix", "dual"):
                    blocks = BlockLogits(net, mode, padding_mask(keys), keys, 0.0, 5, cfg.mask_token_id, None)
                    read = torch.arange(4).expand(2, 4)  # every position of the block
                    full = blocks(x, 9, 13, first=True, read=read)
                    cached = blocks(x, 9, 13, first=False, read=read)
                    assert blocks.cached_step
                    result[f"{name}{mode}/block_start_diff"] = (cached - full).abs().max().item()
            for mode in ("none", "prefix", "dual"):
                stats = DecodeStats()
                out = generate_llada(
                    model,
                    prompt,
                    gen_length=12,
                    steps=6,
                    block_length=4,
                    prompt_valid=valid,
                    cache=mode,
                    stats=stats,
                    progress=False,
                )
                result[f"{mode}/tokens"] = out
                result[f"{mode}/forwards"] = (stats.full_forwards, stats.block_forwards)
        torch.save(result, os.path.join(result_dir, f"tp{tp}_rank{rank}.pt"))
        parallel_state.destroy_model_parallel()

    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl.trainer import train

    train(
        load_config(
            CONFIG,
            [
                f"logging.run_dir={run_dir}",
                "logging.wandb_mode=disabled",
                "steps=1",
                "parallel.tensor_parallel=2",
                "rollout.cache=dual",
                "rollout.threshold=0.9",
                "rollout.prompts_per_step=2",
                "rollout.group_size=2",
                "rollout.gen_length=8",
                "rollout.steps=4",
                "rollout.block_length=4",
                "parallel.micro_batch_size=4",
                "checkpoint.save_every=0",
                "algo.inner_iterations=1",
                "rollout.cache_gap_every=1",
            ],
        )
    )


@pytest.mark.multiprocess
def test_cached_decoding_under_tp2_equals_tp1_and_trains(tmp_path):
    results, run_dir = tmp_path / "results", tmp_path / "run"
    results.mkdir()
    spawn(_worker, 2, (str(results), str(run_dir)), timeout=300)
    for rank in (0, 1):
        tp1, tp2 = (torch.load(results / f"tp{tp}_rank{rank}.pt") for tp in (1, 2))
        for r in (tp1, tp2):
            diffs = {k: v for k, v in r.items() if k.endswith("block_start_diff")}
            assert len(diffs) == 4 and max(diffs.values()) < 1e-5, diffs
        for mode in ("none", "prefix", "dual"):
            assert torch.equal(tp1[f"{mode}/tokens"], tp2[f"{mode}/tokens"]), mode
            assert tp1[f"{mode}/forwards"] == tp2[f"{mode}/forwards"]
        assert tp1["none/forwards"] == (6, 0) and tp1["dual/forwards"] == (3, 3)
        assert not (tp1["dual/tokens"] == 95).any()  # tiny_cfg's mask id
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert rows[-1]["step"] == 1 and torch.isfinite(torch.tensor(rows[-1]["loss"]))
    # the sampling policy's distance from the scored one, logged (rollout.cache_gap_every=1)
    assert 0.0 < rows[-1]["rollout_cache_gap"] < 10.0

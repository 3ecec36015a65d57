"""``stabledrl plan``: hand-computed estimates, the layout table, errors, and measured CPU peaks."""

import json
import math
import os

import pytest
import torch
from test_models_hf import megatron_tp1  # noqa: F401  (module-scoped Megatron TP=1 state)

from stabledrl_mcore.bench.flops import forward_flops_per_token, matmul_params
from stabledrl_mcore.bench.plan import GIB, PlanSpec, all_layouts, estimate
from stabledrl_mcore.cli.app import main
from stabledrl_mcore.models import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")

# llada-tiny: V 256, H 64, L 4, 4 heads = 4 groups of 16, SwiGLU 176.
LAYER_MATMUL = 64 * 16 * 12 + 4 * 16 * 64 + 3 * 64 * 176  # 50176: QKV, out, fc1 (gate+up), fc2
PARAMS = 4 * (LAYER_MATMUL + 2 * 64) + 2 * 256 * 64 + 64  # + norms, embedding, head, final norm


def tiny_spec(**kw):
    base = dict(
        model=get_preset("llada-tiny"),
        nodes=1,
        gpus_per_node=2,
        tp=1,
        pp=1,
        micro_batch=2,
        group_size=2,  # 2 prompts x 2 completions: 2 rows per decoding forward
        seq_len=32,
        gen_length=16,
        global_batch=4,
        dtype="fp32",
        optimizer="adam",
        distributed_optimizer=False,
        impl="local",
        scored_fraction=0.25,
        overhead_gib=0.0,
    )
    base.update(kw)
    return PlanSpec(**base).validate()


def test_flops_by_hand():
    cfg = get_preset("llada-tiny")
    assert PARAMS == cfg.num_parameters() == 234048
    assert matmul_params(cfg) == 4 * LAYER_MATMUL + 256 * 64 == 217088
    # F_fwd(K) = 2 N_mm + 4 L K nh hd
    assert forward_flops_per_token(cfg, 32) == 2 * 217088 + 4 * 4 * 32 * 4 * 16 == 466944


def test_memory_estimate_by_hand():
    est = estimate(tiny_spec())
    assert est["params"] == PARAMS
    assert est["weights"] == est["gradients"] == 4 * PARAMS  # fp32 weights, fp32 main grads
    assert est["optimizer"] == 8 * PARAMS  # Adam m, v (no master copy in fp32)
    per_token_layer = 4 * (6 * 64 + (3 * 4 + 2 * 4) * 16 + 5 * 176)  # local kernels: 6336 bytes
    tokens = 2 * 32
    assert est["activations"] == 4 * per_token_layer * tokens == 1622016
    head = 4 * 2 * 16 * 256 + 12 * 256 * 0.25 * tokens + 3 * 4 * 64 * tokens  # logits of the 2 x 16 completion rows
    assert est["head"] == head == 131072
    assert est["rollout_kv_cache"] == 0  # LLaDA decodes without a cache
    # per row: the head on the 16-token block, and LLaDA's full forward over the 32 tokens (a lower
    # bound: the residual, its normed copy and a sublayer's output, 3 x 64, beside a fused MLP's 3 x 176)
    forward = 32 * 4 * (3 * 64 + max((2 * 4 + 2 * 4) * 16, 3 * 176))
    assert est["rollout_transient"] == 2 * (16 * 256 * 4 + 28 * 256 * 16 + forward)
    assert est["total"] == 2 * 4 * PARAMS + 8 * PARAMS + 1622016 + 131072 == 5497856
    assert est["dp"] == 2 and est["fits"]


def test_head_at_tp2_counts_vocab_sharded_logits_by_hand():
    """At TP > 1 the likelihood and the update keep the logits vocab-sharded (issue #39): the head is
    ``b_a T_c V_p/tp`` (sharded logits) + ``(4 + b_a) (V_p/tp) K`` (the scored rows' ``[K, V_p/tp]``
    selection and Megatron's float32 working copy) + ``3 b_a H T``; no gathered ``T_c x V`` term."""
    tokens, head_rows, scored = 2 * 32, 2 * 16, 0.25 * 2 * 32  # T, T_c, K (micro-batch 2, S 32)
    tp2 = estimate(tiny_spec(tp=2))
    head = 4 * head_rows * 128 + (4 + 4) * 128 * scored + 3 * 4 * 64 * tokens  # V_p/tp = 256/2
    assert tp2["head"] == head == 81920
    # 250 ids padded to 256 at TP = 2 (multiple 64 x 2): the shard is 128 columns wide, padding included
    padded_model = get_preset("llada-tiny", vocab_size=250, mask_token_id=249, make_vocab_size_divisible_by=64)
    assert estimate(tiny_spec(tp=2, model=padded_model))["head"] == head
    bf16 = estimate(tiny_spec(tp=2, dtype="bf16"))
    assert bf16["head"] == 2 * head_rows * 128 + (4 + 2) * 128 * scored + 3 * 2 * 64 * tokens == 45056
    # TP = 1 keeps the gathered logits and the float32 log-softmax (+ gradient) of the scored rows
    tp1 = estimate(tiny_spec(model=padded_model))
    assert tp1["head"] == 4 * head_rows * 250 + 12 * 250 * scored + 3 * 4 * 64 * tokens


def test_tp_dp_sharding_recompute_and_kv_cache_by_hand():
    tp2 = estimate(tiny_spec(tp=2))
    assert tp2["params"] == 4 * (LAYER_MATMUL / 2 + 128) + 2 * 256 * 64 / 2 + 64
    dist = estimate(tiny_spec(distributed_optimizer=True))
    assert dist["optimizer"] == 8 * PARAMS / 2  # sharded over DP = 2
    bf16 = estimate(tiny_spec(dtype="bf16", distributed_optimizer=True))
    assert bf16["weights"] == 2 * PARAMS and bf16["optimizer"] == 12 * PARAMS / 2
    full = estimate(tiny_spec(recompute="full"))
    kept, layer = 4 * 64 * 4 * 64, 6336 * 64  # layer inputs; one recomputed layer
    assert full["activations"] == kept + layer
    assert full["training_peak"] == kept + max(163840, layer)
    sdar = estimate(tiny_spec(model=get_preset("sdar-tiny"), likelihood="staircase"))
    assert sdar["rollout_kv_cache"] == 2 * 4 * 2 * 16 * 4 * 32 * 2  # 2 x L x groups x hd x bytes x S x B


def test_layout_table_and_fit():
    spec = PlanSpec(
        model=get_preset("sdar-8b"),
        nodes=1,
        gpus_per_node=8,
        gpu_memory_gib=80,
        tp=2,
        pp=1,
        likelihood="staircase",
        seq_len=1024,
    ).validate()
    rows = all_layouts(spec)
    layouts = {(r["tp"], r["pp"]) for r in rows}
    assert (2, 1) in layouts and (8, 1) in layouts and (1, 4) in layouts
    assert all(spec.gpus % (tp * pp) == 0 and 36 % pp == 0 for tp, pp in layouts)
    # more model parallelism -> less memory per GPU
    by = {(r["tp"], r["pp"]): r for r in rows}
    assert by[(8, 1)]["total"] < by[(2, 1)]["total"] < by[(1, 1)]["total"]
    assert not by[(1, 1)]["fits"] and by[(8, 1)]["fits"]
    assert by[(1, 1)]["alternative"]["recompute"] == "full"
    small = PlanSpec(model=get_preset("llada-8b"), gpu_memory_gib=16, tp=1, pp=1).validate()
    assert not estimate(small)["fits"] and estimate(small)["total"] > 16 * GIB


def test_plan_cli(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--model",
                "llada-8b",
                "--nodes",
                "2",
                "--gpus-per-node",
                "8",
                "--gpu-memory",
                "80",
                "--tp",
                "2",
                "--pp",
                "1",
                "--recompute",
                "full",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "layout TP 2 x PP 1 x DP 8" in text and "fits" in text
    data = json.loads(out.read_text())
    assert data["chosen"]["tp"] == 2 and data["chosen"]["fits"] is True and len(data["layouts"]) > 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "sdar-8b", "--tp", "3"], "not divisible"),
        (["--model", "sdar-8b", "--tp", "16", "--nodes", "2"], "spans nodes"),
        (["--model", "no-such-model"], "unknown preset"),
        (["--model", "llada-8b", "--seq-len", "64", "--gen-length", "128"], "cannot exceed"),
    ],
)
def test_plan_bad_input_is_one_line_exit_2(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("micro, group, rows", [(2, 8, 3), (2, 8, 12), (4, 6, 6), (3, 2, 0), (2, 4, None)])
def test_plan_decode_rows_follow_the_rule_and_default_of_train(capsys, micro, group, rows):
    """``plan --decode-rows`` is refused exactly where train's ``rollout.decode_rows`` is (a multiple of
    ``lcm(micro-batch, group size)``, one rule: config/checks.py::check_decode_rows), and unset it
    is that lcm, the rows train's preflight counts (it was the micro-batch, and 3 was accepted)."""
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.schema import load_config

    fields = [f"parallel.micro_batch_size={micro}", f"rollout.group_size={group}"]
    try:
        load_config(None, fields + ([f"rollout.decode_rows={rows}"] if rows is not None else []))
        train_refuses = False
    except ConfigError:
        train_refuses = True
    argv = ["plan", "--model", "llada-tiny", "--gpus-per-node", "1", "--micro-batch", str(micro)]
    argv += ["--group-size", str(group)] + (["--decode-rows", str(rows)] if rows is not None else [])
    assert main(argv) == (2 if train_refuses else 0)
    captured = capsys.readouterr()
    if train_refuses:
        unit = math.lcm(micro, group)
        assert len(captured.err.strip().splitlines()) == 1
        assert (
            f"--decode-rows {rows}: " in captured.err
            and f"lcm(--micro-batch {micro}, --group-size {group})" in captured.err
        )
        assert f"= {unit}" in captured.err
    else:
        assert f"{rows or math.lcm(micro, group)} rows per decoding forward" in captured.out
    assert train_refuses == (rows is not None and rows % math.lcm(micro, group) != 0 or rows == 0)


SHAPE = dict(num_layers=2, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1024, vocab_size=4096)


@pytest.mark.parametrize(
    "preset, shape, extra, likelihood, recompute",
    [
        ("llada-100m", dict(SHAPE, num_query_groups=6), [], "elbo", "none"),
        (
            "sdar-100m",
            dict(SHAPE, num_query_groups=2, head_dim=64),
            ["algo.likelihood=staircase", "model.recompute=true"],
            "staircase",
            "full",
        ),
        (
            "sdar-moe-tiny",
            dict(SHAPE, num_query_groups=2, head_dim=64, num_experts=4, moe_ffn_hidden_size=512, moe_router_topk=2),
            ["algo.likelihood=staircase"],
            "staircase",
            "none",
        ),
    ],
)
def test_estimate_matches_measured_cpu_peak(tmp_path, preset, shape, extra, likelihood, recompute):
    """The planner's total vs the measured peak RSS growth of build + 2 real update iterations (15%)."""
    from stabledrl_mcore.bench.memory import measure_in_subprocess

    overrides = [
        f"logging.run_dir={tmp_path}",
        f"model.preset={preset}",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "parallel.micro_batch_size=4",
        "algo.num_mc=2",
    ]
    overrides += [f"model.overrides.{k}={v}" for k, v in shape.items()] + extra
    if get_preset(preset).block_size:  # SDAR decodes in its own blocks
        overrides.append(f"rollout.block_length={get_preset(preset).block_size}")
    measured = measure_in_subprocess(CONFIG, overrides, seq_len=96, prompt_len=32)
    assert measured["peak_reset"]
    spec = PlanSpec(
        model=get_preset(preset, mask_token_id=3, **shape),
        gpus_per_node=1,
        micro_batch=4,
        seq_len=96,
        gen_length=64,
        global_batch=8,
        recompute=recompute,
        dtype="fp32",
        distributed_optimizer=False,
        likelihood=likelihood,
        impl="local",
        scored_fraction=measured["scored_fraction"],
        overhead_gib=0,
    ).validate()
    est = estimate(spec)
    assert est["params"] == measured["params"]
    # weights + gradient buffers are all that exists after the build
    assert abs(measured["after_build_bytes"] / (est["weights"] + est["gradients"]) - 1) < 0.05
    assert abs(est["total"] / measured["peak_bytes"] - 1) < 0.15, (est["total"], measured)


def test_pipeline_stages_by_hand():
    """PP = 2 of llada-tiny (2 layers a stage): embedding on the first stage, LM head + final norm on the
    last; 1F1B keeps min(pp, m) micro-batches (m = num_mc x micro-batches: 2 x 2) and their sent
    outputs on the first stage; the sampler's broadcast logits and the log-prob broadcast on both."""
    est = estimate(tiny_spec(pp=2, gpus_per_node=2, global_batch=4))
    body = 2 * (LAYER_MATMUL + 2 * 64)
    first, last = body + 256 * 64, body + 256 * 64 + 64
    assert est["dp"] == 1 and est["micro_batches"] == 2 * 2 and est["in_flight"] == 2
    tokens, per_token_layer = 2 * 32, 6336
    first_act = 2 * 2 * per_token_layer * tokens + 2 * 4 * 64 * tokens  # 2 in flight x 2 layers + 2 sent outputs
    last_act = 1 * 2 * per_token_layer * tokens
    head = 131072  # as at PP = 1 (same micro-batch)
    forward = 32 * 4 * (3 * 64 + 3 * 176)  # the full forward's working memory per row, as at PP = 1
    rollout = 2 * (16 * 256 * 4 + 28 * 256 * 16 + forward)  # broadcast block logits + sampler work
    assert est["rollout_transient"] == rollout and est["likelihood_peak"] == 8 * 2 * 4 * 32
    assert est["stage_totals"] == {
        "first": 16 * first + max(first_act, rollout),
        "last": 16 * last + max(last_act + head, rollout),
    }
    assert est["stage"] == "first" and est["params"] == first and est["activations"] == first_act
    assert est["pipeline_outputs"] == 2 * 4 * 64 * tokens and est["head"] == 0
    # one micro-batch of rows, but the update's pipeline passes num_mc = 2 chunks: both in flight
    two = estimate(tiny_spec(pp=2, gpus_per_node=2, global_batch=2))
    assert two["micro_batches"] == 2 and two["in_flight"] == 2 and two["activations"] == first_act
    one = estimate(tiny_spec(pp=2, gpus_per_node=2, global_batch=2, num_mc=1))
    assert one["in_flight"] == 1 and one["stage_totals"]["first"] == 16 * first + max(first_act / 2, rollout)


@pytest.mark.parametrize("preset, likelihood, rollout_m", [("llada-tiny", "elbo", 2), ("sdar-tiny", "staircase", 1)])
def test_pipeline_bubble_by_hand(preset, likelihood, rollout_m):
    """Each phase loses (pp - 1) / (m + pp - 1) of a stage's time: the likelihood and the update pass
    m = num_mc x micro-batches = 2 x 2; LLaDA's sampler splits its 2 rows into min(2 pp, 2) = 2
    micro-batches, SDAR decodes one with its KV cache. Same GPUs, so the bubble-free rates equal PP = 1's."""
    kw = dict(model=get_preset(preset), likelihood=likelihood, gpus_per_node=4, global_batch=8)
    flat, piped = estimate(tiny_spec(**kw)), estimate(tiny_spec(pp=2, **kw))
    assert flat["pipeline_idle"] == 0 and flat["bubble_efficiency"] == flat["rollout_bubble_efficiency"] == 1
    assert piped["micro_batches"] == 4 and piped["rollout_micro_batches"] == rollout_m
    e_train, e_roll = 4 / (4 + 1), rollout_m / (rollout_m + 1)
    assert piped["bubble_efficiency"] == pytest.approx(e_train)
    assert piped["rollout_bubble_efficiency"] == pytest.approx(e_roll)
    t_roll = 16 / flat["rollout_tokens_per_s"]  # seconds per sequence (gen 16)
    t_update = 32 / flat["step_tokens_per_s"] - t_roll
    with_bubbles = t_roll / e_roll + t_update / e_train
    assert piped["step_tokens_per_s"] == pytest.approx(32 / with_bubbles)
    assert piped["pipeline_idle"] == pytest.approx(1 - (t_roll + t_update) / with_bubbles)
    assert piped["train_tokens_per_s"] == pytest.approx(flat["train_tokens_per_s"] * e_train)


def test_plan_table_marks_pipelined_layouts(capsys):
    assert main(["plan", "--model", "llada-8b", "--nodes", "2", "--tp", "4", "--pp", "2", "--global-batch", "512"]) == 0
    text = capsys.readouterr().out
    chosen = estimate(PlanSpec(model=get_preset("llada-8b"), nodes=2, tp=4, pp=2, global_batch=512).validate())
    first, last = (f"{chosen['stage_totals'][k] / GIB:.1f}" for k in ("first", "last"))
    assert f"pipeline PP 2: GiB per stage first {first}, last {last}" in text
    assert f"stages idle {100 * chosen['pipeline_idle']:.0f}% of the step" in text
    header = next(line for line in text.splitlines() if line.lstrip().startswith("TP"))
    assert header.split()[-2:] == ["stage", "idle"]
    rows = [line.split() for line in text.splitlines() if line[:3].strip().isdigit()]
    assert rows and {r[1] for r in rows} >= {"1", "2", "4"}
    for r in rows:
        stage, idle = r[11:13]
        assert (stage, idle) == ("-", "-") if r[1] == "1" else (stage in ("first", "last") and idle.endswith("%"))


def test_pipeline_estimate_matches_measured_cpu_peaks(tmp_path):
    """PP = 2 on two local ranks: each rank's measured peak RSS growth (build + 2 updates through 1F1B)
    vs the planner's estimate of its stage, and the worst stage vs the planner's total (15%). One
    micro-batch of rows x num_mc = 2 draws: 2 pipeline micro-batches, both in flight on the first stage."""
    from stabledrl_mcore.bench.memory import measure_in_subprocess

    shape = dict(SHAPE, num_layers=4, num_query_groups=6)
    overrides = [
        f"logging.run_dir={tmp_path}",
        "model.preset=llada-100m",
        "rollout.prompts_per_step=1",
        "rollout.group_size=4",
        "parallel.micro_batch_size=4",
        "algo.num_mc=2",
        "parallel.pipeline_parallel=2",
    ] + [f"model.overrides.{k}={v}" for k, v in shape.items()]
    ranks = measure_in_subprocess(CONFIG, overrides, seq_len=96, prompt_len=32, timeout=300)["ranks"]
    assert [r["pipeline_rank"] for r in ranks] == [0, 1] and all(r["peak_reset"] for r in ranks)
    spec = PlanSpec(
        model=get_preset("llada-100m", mask_token_id=3, **shape),
        gpus_per_node=2,
        pp=2,
        micro_batch=4,
        seq_len=96,
        gen_length=64,
        global_batch=4,
        dtype="fp32",
        distributed_optimizer=False,
        impl="local",
        scored_fraction=ranks[0]["scored_fraction"],
        overhead_gib=0,
    ).validate()
    est = estimate(spec)
    assert est["in_flight"] == 2 and est["stage"] == "first"
    first_params = ranks[0]["stage_params"]
    assert first_params == est["params"] and ranks[1]["stage_params"] == first_params + 384  # + final norm
    for rank, stage in zip(ranks, ("first", "last")):
        weights_and_grads = 8 * rank["stage_params"]  # fp32 weights + fp32 main grads
        assert abs(rank["after_build_bytes"] / weights_and_grads - 1) < 0.05, (stage, rank)
        assert abs(est["stage_totals"][stage] / rank["peak_bytes"] - 1) < 0.15, (stage, est["stage_totals"], rank)
    assert abs(est["total"] / max(r["peak_bytes"] for r in ranks) - 1) < 0.15


# sdar-moe-tiny: V 256, H 64, L 2, 4 heads / 2 groups of 16 (qk-norm), 4 experts of width 48, top-2.
MOE_DENSE_LAYER = 64 * 16 * (4 + 2 * 2) + 4 * 16 * 64 + 2 * 64 + 2 * 16 + 4 * 64  # attention, norms, router: 12704
MOE_EXPERTS_LAYER = 4 * 3 * 64 * 48  # 36864, split over EP x ETP
MOE_TABLES = 2 * 256 * 64 + 64  # embedding, head, final norm


def moe_spec(**kw):
    return tiny_spec(
        **dict(
            dict(
                model=get_preset("sdar-moe-tiny"),
                gpus_per_node=4,
                dtype="bf16",
                distributed_optimizer=True,
                likelihood="staircase",
                global_batch=8,
            ),
            **kw,
        )
    )


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_moe_params_and_optimizer_shards_by_hand(ep):
    """Dense part over TP (router replicated), experts over EP x ETP; Adam states (bf16: 12 bytes) of the
    dense part over DP = 4, of the experts over the expert-data-parallel size 4 / EP; fp32 grads of both."""
    cfg = get_preset("sdar-moe-tiny")
    assert 2 * (MOE_DENSE_LAYER + MOE_EXPERTS_LAYER) + MOE_TABLES == cfg.num_parameters() == 131968
    est = estimate(moe_spec(ep=ep))
    dense, experts = 2 * MOE_DENSE_LAYER + MOE_TABLES, 2 * MOE_EXPERTS_LAYER / ep
    assert est["params"] == dense + experts and est["expert_params"] == experts
    assert (est["ep"], est["etp"], est["dp"], est["edp"]) == (ep, 1, 4, 4 // ep)
    assert est["weights"] == 2 * (dense + experts) and est["gradients"] == 4 * (dense + experts)
    assert est["optimizer"] == 12 * dense / 4 + 12 * experts / (4 // ep)
    replicated = estimate(moe_spec(ep=ep, distributed_optimizer=False))
    assert replicated["optimizer"] == 12 * (dense + experts)
    # TP = 2 (ETP = TP): attention split, norms and router replicated; EP 2 x ETP 2 = 4 GPUs, expert DP 1
    if ep == 2:
        tp2 = estimate(moe_spec(tp=2, ep=2))
        dense_tp2 = 2 * ((64 * 16 * 8 + 4 * 16 * 64) / 2 + 2 * 64 + 2 * 16 + 4 * 64) + 256 * 64 + 64
        assert tp2["params"] == dense_tp2 + 2 * MOE_EXPERTS_LAYER / 4 and tp2["edp"] == 1
        assert tp2["optimizer"] == 12 * dense_tp2 / 2 + 12 * 2 * MOE_EXPERTS_LAYER / 4


def test_moe_activations_and_all_to_all_by_hand():
    """Per token and layer: the dense formula without the SwiGLU term, plus k dispatched rows
    (local: H + 6 F_e) and the router's 4E + E + 24k bytes; all-to-all 2 T k H b_a a layer (EP > 1)."""
    spec = moe_spec(dtype="fp32", ep=2)
    est = estimate(spec)
    attention = 4 * (6 * 64 + (3 * 4 + 2 * 2) * 16 + (2 * 4 + 5 * 2) * 16)  # local kernels, qk-norm
    moe = 4 * 2 * (64 + 6 * 48) + 5 * 4 + 24 * 2
    tokens = 2 * 32 * 2  # staircase: 2 x seq_len
    assert est["activations"] == 2 * (attention + moe) * tokens
    assert est["all_to_all_layer_bytes"] == 2 * tokens * 2 * 64 * 4
    assert estimate(moe_spec(dtype="fp32"))["all_to_all_layer_bytes"] == 0  # EP = 1: no all-to-all


def test_moe_dispatched_row_activations_match_saved_tensors(megatron_tp1):  # noqa: F811
    """The MoE layer's MLP keeps, per token, its input (H) and what the formula counts (local, fp32):
    every tensor autograd saves during the MLP's forward, counted by storage, parameters left out."""
    from stabledrl_mcore.bench.plan import moe_activation_bytes_per_token
    from stabledrl_mcore.models import build_model

    cfg = get_preset("sdar-moe-tiny", num_layers=1, num_experts=8, moe_router_topk=3, moe_ffn_hidden_size=40)
    model = build_model(cfg, device="cpu")
    mlp, saved, on = model.decoder.layers[0].mlp, {}, []
    mlp.register_forward_pre_hook(lambda *a: on.append(1))
    mlp.register_forward_hook(lambda *a: on.clear())

    def pack(t):
        if on:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(3, 250, (2, 32)))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    per_token = sum(v for k, v in saved.items() if k not in params) / 64
    spec = tiny_spec(model=cfg, dtype="fp32", impl="local")
    assert per_token == 4 * 64 + moe_activation_bytes_per_token(spec, 1) == 4016


def test_moe_active_flops_by_hand():
    """Model FLOPs count the router and the top-k experts a token runs through, not all E experts."""
    cfg = get_preset("sdar-moe-tiny")
    active = 2 * (64 * 16 * 8 + 4 * 16 * 64 + 4 * 64 + 2 * 3 * 64 * 48) + 256 * 64
    assert matmul_params(cfg) == active == 78336
    assert cfg.num_active_parameters() == active + 2 * (2 * 64 + 2 * 16) + 256 * 64 + 64
    assert forward_flops_per_token(cfg, 32) == 2 * 78336 + 4 * 2 * 32 * 4 * 16
    est = estimate(moe_spec(ep=2))
    rate = 4 * 989e12 * 0.40  # gpus x peak x mfu
    assert est["train_tokens_per_s"] == pytest.approx(rate / (3 * (2 * 78336 + 4 * 2 * 64 * 4 * 16) * 2))


def test_moe_plan_table_has_the_ep_column(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert (
        main(["plan", "--model", "sdar-30b-a3b", "--tp", "2", "--ep", "4", "--recompute", "full", "--json", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "B active: 128 experts, top-8" in text and "x EP 4 (ETP 2, expert DP 1)" in text
    header = next(line for line in text.splitlines() if line.lstrip().startswith("TP"))
    assert header.split()[:4] == ["TP", "PP", "DP", "EP"] and header.rstrip().endswith("a2a MiB")
    rows = [line.split() for line in text.splitlines() if line[:3].strip().isdigit()]
    assert {r[3] for r in rows} == {"1", "2", "4", "8"}
    assert all(r[3] == "1" for r in rows if r[1] != "1")  # EP > 1 only at PP = 1
    assert [r[:4] for r in rows if r[-1] == "<"] == [["2", "1", "4", "4"]]
    data = json.loads(out.read_text())
    cfg = get_preset("sdar-30b-a3b")
    assert data["model_params"] == {"total": cfg.num_parameters(), "active": cfg.num_active_parameters()}
    assert data["chosen"]["ep"] == 4 and data["spec"]["ep"] == 4
    dense = all_layouts(PlanSpec(model=get_preset("sdar-8b")).validate())
    assert {r["ep"] for r in dense} == {1}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "sdar-8b", "--ep", "2"], "need a mixture-of-experts model"),
        (["--model", "sdar-8b", "--etp", "1"], "need a mixture-of-experts model"),
        (["--model", "sdar-30b-a3b", "--ep", "2", "--pp", "2"], "expert parallelism runs with PP = 1"),
        (["--model", "sdar-30b-a3b", "--ep", "16"], "not divisible by ETP x EP"),
        (["--model", "sdar-30b-a3b", "--ep", "3", "--gpus-per-node", "3"], "num_experts (128) not divisible by EP 3"),
    ],
)
def test_plan_refuses_bad_expert_layouts(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1

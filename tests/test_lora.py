"""LoRA on Megatron's tensor-parallel linears (``model.lora``, issue #42 item 1).

- One adapted linear of each kind (fused q/k/v with some parts adapted, the split gate/up fc1, a
  row-parallel projection) against a hand-built ``W x + (alpha/r) B A x`` per upstream projection,
  fused into Megatron's layout by the converter's own mapping table: outputs and autograd gradients.
- Training runs of llada-tiny (base: a converted Megatron checkpoint) and sdar-tiny (base: the upstream
  HF directory itself) at TP=2: they train the adapters only, resume bit for bit from step 1, equal
  the TP=1 x DP=2 run, and ``mcore-to-hf`` exports merged weights whose logits equal the adapted
  model's, and a PEFT adapter whose ``W + (alpha/r) B A`` is the merged weight.
- The KL reference of a LoRA run is the base without adapters; settings that cannot work are refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import types

import pytest
import torch
from hf_fixtures import load_all, write_hf_checkpoint

from stabledrl_mcore.parallel.launch import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]  # parts of both fused linears left out
RANK, ALPHA = 4, 8.0


# ----------------------------------------------------------------- one linear against a hand-built one
def _unit_worker(out):
    from stabledrl_mcore.convert.mappings import LLADA
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.models.lora import LoRASettings, adapter_params_per_layer, adapters, apply_lora
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(1, 1, seed=3)
    cfg = get_preset("llada-tiny")
    model = build_model(cfg)
    count = apply_lora(model, LoRASettings(RANK, ALPHA, 0.0, tuple(TARGETS), seed=5))
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora." not in n)
    g = torch.Generator().manual_seed(0)
    layer = model.decoder.layers[0]
    s, r, h = ALPHA / RANK, RANK, cfg.hidden_size
    q_rows, kv_rows = cfg.num_attention_heads * cfg.kv_channels, cfg.num_query_groups * cfg.kv_channels
    results = {}

    def fuse_qkv(q, k, v, width):  # the converter's layout (convert/mappings.py QKV), any width
        fake = types.SimpleNamespace(
            num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, hidden_size=width
        )
        mapping = LLADA.layer[1]
        return mapping.to_megatron({mapping.q: q, mapping.k: k, mapping.v: v}, fake, None)[0]

    # fused q/k/v, q and v adapted, k not
    qkv = layer.self_attention.linear_qkv
    x = torch.randn(5, 2, h, generator=g, dtype=torch.float64)
    a_q, a_v = (torch.randn(r, h, generator=g, dtype=torch.float64) for _ in range(2))
    b_q = torch.randn(q_rows, r, generator=g, dtype=torch.float64)
    b_v = torch.randn(kv_rows, r, generator=g, dtype=torch.float64)
    base_q = torch.randn(q_rows, h, generator=g, dtype=torch.float64)
    base_k, base_v = (torch.randn(kv_rows, h, generator=g, dtype=torch.float64) for _ in range(2))
    ref_params = [a_q, a_v, b_q, b_v]
    for t in ref_params:
        t.requires_grad_(True)
    qkv.double()
    with torch.no_grad():
        qkv.weight.copy_(fuse_qkv(base_q, base_k, base_v, h))
        qkv.lora.a.copy_(torch.cat([a_q, a_v]))
        qkv.lora.b_q.copy_(b_q)  # a part's rows in Megatron's order = the projection's own order
        qkv.lora.b_v.copy_(b_v)
    got = qkv(x)[0]
    q = x @ base_q.T + s * (x @ a_q.T) @ b_q.T
    k = x @ base_k.T
    v = x @ base_v.T + s * (x @ a_v.T) @ b_v.T
    want = fuse_qkv(q.reshape(-1, q_rows).T, k.reshape(-1, kv_rows).T, v.reshape(-1, kv_rows).T, 10).T.reshape(5, 2, -1)
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    results["qkv"] = [
        (got - want).abs().max().item(),
        (qkv.lora.a.grad - torch.cat([a_q.grad, a_v.grad])).abs().max().item(),
        max((qkv.lora.b_q.grad - b_q.grad).abs().max().item(), (qkv.lora.b_v.grad - b_v.grad).abs().max().item()),
        b_q.grad.abs().max().item(),
    ]

    # fc1 (gate, up) handed apart; only up adapted
    fc1 = layer.mlp.linear_fc1
    fc1.double()
    f = cfg.ffn_hidden_size
    a_u = torch.randn(r, h, generator=g, dtype=torch.float64, requires_grad=True)
    b_u = torch.randn(f, r, generator=g, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        fc1.lora.a.copy_(a_u)
        fc1.lora.b_up.copy_(b_u)
    assert not hasattr(fc1.lora, "b_gate")  # gate is not a target
    fc1_out = fc1(x)[0]
    gate, up = fc1_out if isinstance(fc1_out, tuple) else fc1_out.chunk(2, dim=-1)
    w_gate, w_up = fc1.weight.detach().chunk(2)
    want_up = x @ w_up.T + s * (x @ a_u.T) @ b_u.T
    weights = torch.randn(up.shape, generator=g, dtype=torch.float64)
    ((up * weights).sum() + gate.sum()).backward()
    ((want_up * weights).sum() + (x @ w_gate.T).sum()).backward()
    results["fc1"] = [
        max((gate - x @ w_gate.T).abs().max().item(), (up - want_up).abs().max().item()),
        (fc1.lora.a.grad - a_u.grad).abs().max().item(),
        (fc1.lora.b_up.grad - b_u.grad).abs().max().item(),
        b_u.grad.abs().max().item(),
    ]

    # a row-parallel projection (down_proj)
    fc2 = layer.mlp.linear_fc2
    fc2.double()
    xf = torch.randn(5, 2, f, generator=g, dtype=torch.float64)
    a_d = torch.randn(r, f, generator=g, dtype=torch.float64, requires_grad=True)
    b_d = torch.randn(h, r, generator=g, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        fc2.lora.a.copy_(a_d)
        fc2.lora.b.copy_(b_d)
    got = fc2(xf)[0]
    want = xf @ fc2.weight.detach().T + s * (xf @ a_d.T) @ b_d.T
    weights = torch.randn(got.shape, generator=g, dtype=torch.float64)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    results["fc2"] = [
        (got - want).abs().max().item(),
        (fc2.lora.a.grad - a_d.grad).abs().max().item(),
        (fc2.lora.b.grad - b_d.grad).abs().max().item(),
        b_d.grad.abs().max().item(),
    ]
    results["adapted"] = sorted(name for name, _ in adapters(model))[:4]
    results["count"] = [count, sum(p.numel() for p in model.parameters() if p.requires_grad)]
    results["planned"] = adapter_params_per_layer(cfg, 1, RANK, TARGETS) * cfg.num_layers
    with open(out, "w") as handle:
        json.dump(results, handle)


def test_an_adapted_linear_equals_the_hand_built_one_with_its_gradients(tmp_path):
    """Fused q/k/v (q and v adapted), fc1 (up adapted; gate untouched, its B rows get no gradient)
    and the row-parallel fc2, in float64, against ``W x + (alpha/r) B A x`` built per projection."""
    out = str(tmp_path / "unit.json")
    spawn(_unit_worker, 1, (out,), timeout=120)
    with open(out) as handle:
        results = json.load(handle)
    for name in ("qkv", "fc1", "fc2"):
        value, grad_a, grad_b, scale = results[name]
        assert value < 1e-10 and grad_a < 1e-10 and grad_b < 1e-10, (name, results[name])
        assert scale > 1e-3, (name, "the reference gradient is zero: the check would be vacuous")
    # only the adapters train, and the planner counts exactly them
    assert results["count"][0] == results["count"][1] == results["planned"] > 0, results


# ----------------------------------------------------------------- training runs at TP=2 and TP=1
def _overrides(run_dir, base, tp, kind, extra=()):
    return [
        f"logging.run_dir={run_dir}",
        "logging.wandb_mode=disabled",
        "logging.progress=false",
        f"model.checkpoint={base}",
        f"model.lora.rank={RANK}",
        f"model.lora.alpha={ALPHA}",
        f"model.lora.targets=[{','.join(TARGETS)}]",
        f"parallel.tensor_parallel={tp}",
        "steps=2",
        "checkpoint.save_every=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.gen_length=8",
        "rollout.steps=4",
        f"rollout.block_length={8 if kind == 'llada' else 4}",  # SDAR: the model's own block size
        "parallel.micro_batch_size=4",
        "optim.lr=0.05",
        "algo.kl_coef=0.05",
        *extra,
    ]


def _runs_worker(jobs):
    """Every run of the module in one world-2 spawn: per model a TP=2 run, its resume from step 1 in a
    fresh directory, a TP=1 x DP=2 run; rank 0 then exports the step-2 checkpoints."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from stabledrl_mcore.bench.workload_checks import probe_reward
    from stabledrl_mcore.cli.app import main
    from stabledrl_mcore.parallel import bootstrap
    from stabledrl_mcore.rl.trainer import train_rank
    from stabledrl_mcore.tasks.base import Task

    Task.reward = probe_reward
    rank0 = os.environ["RANK"] == "0"

    def run(overrides):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        assert train_rank(TINY, overrides) == 0

    for job in jobs:
        run(_overrides(job["tp2"], job["base"], 2, job["kind"]))
        if rank0:
            os.makedirs(os.path.join(job["resumed"], "checkpoints"))
            shutil.copytree(
                os.path.join(job["tp2"], "checkpoints", "step_00000001"),
                os.path.join(job["resumed"], "checkpoints", "step_00000001"),
            )
        dist.barrier()
        run(_overrides(job["resumed"], job["base"], 2, job["kind"], ["checkpoint.resume=auto"]))
        run(_overrides(job["tp1"], job["base"], 1, job["kind"]))
    bootstrap.destroy()
    if rank0:
        for job in jobs:
            for name in ("tp2", "resumed", "tp1"):
                ckpt = os.path.join(job[name], "checkpoints", "step_00000002")
                extra = ["--peft-out", job["peft"]] if name == "tp2" else []
                args = ["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", job[f"hf_{name}"], "--no-progress", *extra]
                assert main(args) == 0, args


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):

    root = tmp_path_factory.mktemp("lora")
    jobs = {}
    for kind in ("llada", "sdar"):
        hf = write_hf_checkpoint(str(root / f"hf_{kind}"), kind)
        base = hf
        if kind == "llada":  # a converted base; SDAR trains on the upstream directory itself
            base = str(root / "mcore_llada")
            spawn(_convert_worker, 1, (hf, base), timeout=120)
        jobs[kind] = {
            "kind": kind,
            "hf_base": hf,
            "base": base,
            **{name: str(root / kind / name) for name in ("tp2", "resumed", "tp1", "peft")},
            **{f"hf_{name}": str(root / kind / f"hf_{name}") for name in ("tp2", "resumed", "tp1")},
        }
    spawn(_runs_worker, 2, (list(jobs.values()),), timeout=900)
    return jobs


def _convert_worker(hf, out):
    from stabledrl_mcore.convert.convert import hf_to_mcore

    hf_to_mcore(hf, out, progress=False)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    return [
        {k: v for k, v in r.items() if k not in ("time", "step_s") and not k.startswith(("time/", "tokens_per_s"))}
        for r in rows
    ]


KINDS = ["llada", "sdar"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_a_tp2_lora_run_trains_the_adapters_only_and_resumes_bitwise(lora_runs, kind):
    from stabledrl_mcore.checkpoint.trust import stored_tensors

    job = lora_runs[kind]
    rows = _metrics(job["tp2"])
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 and r["skipped_updates"] == 0 for r in rows)
    again = _metrics(job["resumed"])
    assert [r["step"] for r in again] == [2] and again[0] == rows[1], (again, rows[1])
    a, b = load_all(job["hf_tp2"]), load_all(job["hf_resumed"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed run's weights differ"
    keys = set(stored_tensors(os.path.join(job["tp2"], "checkpoints", "step_00000002")))
    model_keys = {k for k in keys if not k.startswith("optimizer.")}
    assert model_keys and all(re.search(r"\.lora\.(a|b|b_[a-z]+)$", k) for k in model_keys), sorted(model_keys)[:5]
    # the export differs from the base exactly where an adapter sits
    base = load_all(job["hf_base"])
    changed = {k for k in base if not torch.equal(base[k], a[k])}
    hf_leaf = {"llada": ("q_proj", "v_proj", "attn_out", "up_proj", "ff_out"), "sdar": tuple(TARGETS)}[kind]
    expect = {k for k in base if re.search(r"\.\d+\.(.*\.)?(" + "|".join(hf_leaf) + r")\.weight$", k)}
    assert changed == expect, sorted(changed ^ expect)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_equals_tp1(lora_runs, kind):
    job = lora_runs[kind]
    two, one = _metrics(job["tp2"]), _metrics(job["tp1"])
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2]
    # step 1 runs the same weights: float rounding of the vocab- and row-parallel reductions only.
    # Step 2 follows one Adam update, whose first step is about lr * sign(g): an adapter entry with a
    # near-zero gradient moves by +-lr on rounding alone (measured: loss 1.6e-4, grad norm 1.1e-4
    # relative at step 2 against 1e-6 at step 1), so it is held to 1e-3 -- a missing all-reduce or
    # a wrongly split adapter is off by far more.
    for a, b, rel in zip(two, one, (2e-5, 1e-3)):
        for key in ("loss", "grad_norm", "reward_mean", "kl"):
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-7), (a["step"], key, a[key], b[key])
    # the merged weights: the two runs' changes to the base agree to float rounding amplified by Adam,
    # whose step is lr * g / (|g| + eps): a gradient entry near eps turns a rounding difference d
    # into lr * d / eps, so compare relative to the change itself (measured 1.1e-3 of it; a wrong
    # shard or a missing reduction moves entries by the whole change)
    x, y, base = load_all(job["hf_tp2"]), load_all(job["hf_tp1"]), load_all(job["hf_base"])
    change = max((x[k] - base[k]).abs().max().item() for k in x)
    worst = max((x[k] - y[k]).abs().max().item() for k in x)
    assert change > 1e-3 and worst < 1e-2 * change, (worst, change)


def _export_worker(job, out):
    """One process: the adapted model (base + the TP=2 run's adapters, unmerged), its base with the
    adapters off (the KL reference), the merged export, a plain model of the base, and ``load_model`` of
    the LoRA checkpoint itself (what eval and generate load) -- their logits on the same tokens."""
    from stabledrl_mcore.checkpoint.state import read_lora_run
    from stabledrl_mcore.checkpoint.trust import load_sharded
    from stabledrl_mcore.convert.loader import InspectionModel, load_model, load_weights, read_config
    from stabledrl_mcore.engine.expert import phase_model
    from stabledrl_mcore.models import build_model
    from stabledrl_mcore.models.lora import AdapterCheckpointView, BaseWithoutAdapters, adapters, apply_lora
    from stabledrl_mcore.parallel import bootstrap

    ckpt = os.path.join(job["tp2"], "checkpoints", "step_00000002")
    bootstrap.initialize(1, 1, seed=1)
    cfg = read_config(job["base"])
    model = build_model(cfg)
    load_weights(model, job["base"])
    plain_base = InspectionModel(model, cfg)
    ids = torch.randint(0, cfg.vocab_size - 2, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = plain_base(ids)
        apply_lora(model, read_lora_run(ckpt).settings)
        view = AdapterCheckpointView(model)
        sharded = view.sharded_state_dict()
        missing, _ = view.load_state_dict(load_sharded(sharded, ckpt))
        assert not missing, missing
        adapted = InspectionModel(model, cfg)(ids)
        with phase_model(BaseWithoutAdapters(model)) as reference:
            reference_logits = InspectionModel(reference, cfg)(ids)
        b_norm = max(p.abs().max().item() for _, a in adapters(model) for n, p in a.named_parameters() if n != "a")
    bootstrap.destroy()
    with torch.no_grad():
        merged = load_model(job["hf_tp2"])(ids)
        from_ckpt = load_model(ckpt)(ids)
    torch.save(
        {
            "base": base_logits,
            "adapted": adapted,
            "reference": reference_logits,
            "merged": merged,
            "from_ckpt": from_ckpt,
            "b_norm": b_norm,
        },
        out,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_merged_export_equals_the_adapted_model_and_the_reference_is_the_base(lora_runs, kind, tmp_path):
    out = str(tmp_path / "logits.pt")
    spawn(_export_worker, 1, (lora_runs[kind], out), timeout=300)
    got = torch.load(out)
    assert got["b_norm"] > 1e-3, "the adapters did not train: the comparison would be vacuous"
    assert (got["adapted"] - got["base"]).abs().max() > 1e-3
    assert (got["merged"] - got["adapted"]).abs().max() < 1e-5
    assert (got["from_ckpt"] - got["adapted"]).abs().max() < 1e-5
    assert torch.equal(got["reference"], got["base"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", KINDS)
def test_the_peft_adapter_rebuilds_the_merged_weights(lora_runs, kind):
    """PEFT computes ``W + (lora_alpha / r) lora_B lora_A`` for each module its regex selects."""
    from safetensors.torch import load_file

    job = lora_runs[kind]
    with open(os.path.join(job["peft"], "adapter_config.json")) as handle:
        config = json.load(handle)
    adapter = load_file(os.path.join(job["peft"], "adapter_model.safetensors"))
    base, merged = load_all(job["hf_base"]), load_all(job["hf_tp2"])
    assert config["peft_type"] == "LORA" and config["r"] == RANK and config["lora_alpha"] == ALPHA
    selected = {k[: -len(".weight")] for k in base if re.fullmatch(config["target_modules"], k[: -len(".weight")])}
    modules = {k[len("base_model.model.") : -len(".lora_A.weight")] for k in adapter if k.endswith(".lora_A.weight")}
    layers = {int(m) for m in re.findall(r"\.(\d+)\.", " ".join(base))}
    assert selected == modules and len(modules) == len(TARGETS) * len(layers), sorted(selected ^ modules)
    for module in modules:
        a = adapter[f"base_model.model.{module}.lora_A.weight"]
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        rebuilt = base[module + ".weight"] + (ALPHA / RANK) * b @ a
        assert (rebuilt - merged[module + ".weight"]).abs().max() < 1e-6, module


def _config(*overrides):
    from stabledrl_mcore.config.schema import load_config

    return load_config(TINY, list(overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.lora.rank=-1"], "model.lora.rank must be >= 0"),
        (["model.lora.rank=4", "model.lora.alpha=0"], "model.lora.alpha must be > 0"),
        (["model.lora.rank=4", "model.lora.dropout=1.0"], "model.lora.dropout must be in [0, 1)"),
        (["model.lora.rank=4", "model.lora.targets=[qkv]"], "model.lora.targets=['qkv']"),
        (["model.lora.rank=4", "model.lora.targets=[q_proj,q_proj]"], "use distinct names"),
        (
            ["model.lora.rank=4", "algo.kl_coef=0.1", "algo.reference_sync_every=4"],
            "the KL reference of a LoRA run is the frozen base",
        ),
    ],
)
def test_lora_settings_that_cannot_work_are_refused_by_name(overrides, message):
    from stabledrl_mcore.common.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _config(*overrides)
    assert message in str(err.value)


def test_a_mixture_of_experts_takes_adapters_on_attention_only():
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.checks import check_model_options
    from stabledrl_mcore.models import get_preset

    moe = get_preset("sdar-moe-tiny")
    block = f"rollout.block_length={moe.block_size}"
    with pytest.raises(ConfigError, match="expert MLPs take no adapters"):
        check_model_options(_config("model.lora.rank=4", block), moe)
    check_model_options(_config("model.lora.rank=4", "model.lora.targets=[q_proj,o_proj]", block), moe)


def test_the_planner_counts_adapters_instead_of_a_reference_and_full_optimizer_states():
    from stabledrl_mcore.bench.plan import PlanSpec, estimate
    from stabledrl_mcore.models import get_preset
    from stabledrl_mcore.models.lora import adapter_params_per_layer

    m = get_preset("llada-8b")
    full = estimate(PlanSpec(model=m, tp=2, reference_model=True).validate())
    lora = estimate(PlanSpec(model=m, tp=2, reference_model=True, lora_rank=128).validate())
    adapters = m.num_layers * adapter_params_per_layer(m, 2, 128)
    assert lora["reference_weights"] == 0 < full["reference_weights"]
    assert lora["gradients"] == pytest.approx(4.0 * adapters)
    assert lora["params"] == pytest.approx(full["params"] + adapters)
    assert lora["optimizer"] == pytest.approx(12.0 * adapters / lora["dp"])


def _sft_worker(tmp, out):
    """SFT with LoRA on a randomly initialised sdar-tiny: a straight run and one cut at step 2 and
    resumed (the base is rebuilt from the seed, the adapters come from the checkpoint)."""
    from test_sft import _fixed_mask_loss, _overrides, _write_data

    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.parallel import bootstrap
    from stabledrl_mcore.sft import SFTConfig, train_sft

    data = os.path.join(tmp, "data.jsonl")
    _write_data(data)
    lora = {"model.lora.rank": RANK, "model.lora.alpha": ALPHA, "optim.lr": 3e-2}
    results, first = {}, {}

    def record(s, step):
        if step == 1:
            first.update({k: v.detach().clone() for k, v in s.model.state_dict().items() if torch.is_tensor(v)})
        return _fixed_mask_loss(s)

    for name, extra, stop_after in (
        ("full", {}, None),
        ("cut", {"checkpoint.save_every": 2}, 2),
        ("cut", {"checkpoint.save_every": 2, "checkpoint.resume": "auto"}, None),
    ):
        cfg = load_config(None, _overrides(os.path.join(tmp, name), data, "sdar-tiny", **lora, **extra), cls=SFTConfig)
        s = train_sft(cfg, hooks=[record], stop_after=stop_after)
        results[name] = {k: v.detach().clone() for k, v in s.model.state_dict().items() if torch.is_tensor(v)}
        if name == "full":
            results["after_step_1"] = dict(first)
        bootstrap.destroy()
    with open(os.path.join(tmp, "full", "metrics.jsonl")) as handle:
        results["losses"] = [json.loads(line)["fixed_mask_loss"] for line in handle]
    torch.save(results, out)


@pytest.mark.multiprocess
def test_sft_with_lora_trains_the_adapters_only_and_resumes_exactly(tmp_path):
    out = str(tmp_path / "sft.pt")
    spawn(_sft_worker, 1, (str(tmp_path), out), timeout=300)
    got = torch.load(out)
    full, cut, first = got["full"], got["cut"], got["after_step_1"]
    adapter = [k for k in full if ".lora." in k]
    assert adapter and all(torch.equal(full[k], cut[k]) for k in full), "the resumed run differs"
    assert all(torch.equal(full[k], first[k]) for k in full if k not in adapter), "a base weight moved"
    assert any(not torch.equal(full[k], first[k]) for k in adapter), "the adapters did not train"
    assert got["losses"][-1] < got["losses"][0], got["losses"]


def _count_worker(out):
    from stabledrl_mcore.models import build_model, get_preset
    from stabledrl_mcore.models.lora import LoRASettings, adapter_params_per_layer, apply_lora
    from stabledrl_mcore.parallel import bootstrap

    bootstrap.initialize(2, 1, seed=3)
    counts = {}
    for preset in ("llada-tiny", "sdar-tiny"):
        cfg = get_preset(preset)
        model = build_model(cfg)
        made = apply_lora(model, LoRASettings(RANK, ALPHA, targets=("all-linear",)))
        counts[preset] = [made, adapter_params_per_layer(cfg, 2, RANK) * cfg.num_layers]
    if os.environ["RANK"] == "0":
        with open(out, "w") as handle:
            json.dump(counts, handle)


@pytest.mark.multiprocess
def test_the_planners_adapter_count_is_a_tp2_ranks_own(tmp_path):
    out = str(tmp_path / "counts.json")
    spawn(_count_worker, 2, (out,), timeout=120)
    with open(out) as handle:
        counts = json.load(handle)
    assert all(made == planned > 0 for made, planned in counts.values()), counts


def test_a_lora_checkpoint_whose_base_moved_names_the_way_out(tmp_path):
    from stabledrl_mcore.checkpoint.errors import ConversionError
    from stabledrl_mcore.checkpoint.state import read_lora_run

    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    ckpt.joinpath("config.yaml").write_text(
        f"model:\n  checkpoint: {tmp_path / 'gone'}\n  lora:\n    rank: 4\nparallel:\n  seed: 1\n"
    )
    with pytest.raises(ConversionError) as err:
        read_lora_run(str(ckpt))
    assert "--lora-base DIR" in str(err.value) and "put the base back" in str(err.value)
    ckpt.joinpath("config.yaml").write_text("model:\n  lora:\n    rank: 4\n")
    with pytest.raises(ConversionError, match="randomly initialised base"):
        read_lora_run(str(ckpt))
    run = read_lora_run(str(ckpt), base=str(tmp_path))  # --lora-base
    assert run.base == str(tmp_path) and run.settings.rank == 4
    ckpt.joinpath("config.yaml").write_text("model:\n  lora:\n    rank: 0\n")
    assert read_lora_run(str(ckpt)) is None

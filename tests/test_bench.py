"""``stabledrl bench``: timing statistics, FLOP counting, peaks, the JSON report and weak scaling."""

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from stabledrl_mcore.bench.flops import FlopCounter, forward_flops, forward_flops_per_token
from stabledrl_mcore.bench.peak import gpu_peak_flops, measure_matmul_flops
from stabledrl_mcore.bench.phases import PhaseResult, fill_flat_groups
from stabledrl_mcore.bench.run import parse_phases, speedup
from stabledrl_mcore.bench.scaling import efficiency
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.models import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
SMALL = [
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "parallel.micro_batch_size=4",
    "rollout.gen_length=8",
    "rollout.steps=4",
    "rollout.block_length=8",
    "logging.wandb_mode=disabled",
]


def run_cli(*args, timeout=300):
    proc = subprocess.run(
        [sys.executable, "-m", "stabledrl_mcore.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_phase_statistics():
    res = PhaseResult("train", seconds=[4.0, 1.0, 2.0, 3.0, 5.0], cpu_seconds=[1.0] * 5, tokens=100.0, flops=1e9)
    s = res.summary(peak_flops=1e9, model_parallel=2)
    assert s["median_s"] == 3.0 and s["q1_s"] == 2.0 and s["q3_s"] == 4.0 and s["iqr_s"] == 2.0
    assert s["min_s"] == 1.0 and s["max_s"] == 5.0 and s["repeats"] == 5
    assert s["tokens_per_s"] == pytest.approx(100 / 3) and s["model_flops_per_s"] == pytest.approx(1e9 / 3)
    assert s["mfu"] == pytest.approx(1 / 6)  # FLOP/s over peak x TP x PP
    assert s["mfu_cpu_time"] == pytest.approx(0.5) and s["tokens_per_cpu_s"] == pytest.approx(100.0)
    one = PhaseResult("optimizer", seconds=[0.5]).summary()
    assert one["iqr_s"] == 0 and one["tokens_per_s"] is None and "mfu" not in one
    assert speedup({"tokens_per_s": 30.0, "median_s": 1}, {"tokens_per_s": 10.0, "median_s": 3}) == 3.0
    assert speedup({"tokens_per_s": None, "median_s": 0.5}, {"tokens_per_s": None, "median_s": 1.0}) == 2.0
    assert efficiency({"tokens_per_s": 100.0}, {"tokens_per_s": 180.0}, 2) == pytest.approx(0.9)


def test_parse_phases():
    assert parse_phases("all")[0] == "rollout" and parse_phases("step,train") == ["train", "step"]
    with pytest.raises(ConfigError, match="unknown bench phase"):
        parse_phases("train,warp")


def test_flop_counter_counts_forward_and_backward():
    cfg = get_preset("llada-tiny")

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, input_ids, position_ids=None, attention_mask=None, kv_cache=None):
            return self.w * input_ids.float()

    model = Stub()
    with FlopCounter(model, cfg) as counter:
        with torch.no_grad():
            model(torch.zeros(2, 10, dtype=torch.long))
        assert counter.flops == forward_flops(cfg, 2, 10) == 20 * forward_flops_per_token(cfg, 10)
        counter.reset()
        model(torch.zeros(3, 8, dtype=torch.long)).sum().backward()
        assert counter.flops == 3 * 24 * forward_flops_per_token(cfg, 8) and counter.tokens == 24

        class Cache:
            length = 12

        counter.reset()
        with torch.no_grad():
            model(torch.zeros(1, 4, dtype=torch.long), kv_cache=Cache())
        assert counter.flops == 4 * forward_flops_per_token(cfg, 16)  # keys = cached + current
    model(torch.zeros(1, 4, dtype=torch.long))  # hook removed
    assert counter.tokens == 4


def test_peaks():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA H200") == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("Some Future GPU") is None
    got = measure_matmul_flops(torch.bfloat16, device="cpu", sizes=(64, 128), repeats=1, min_seconds=0.01)
    assert got["flops"] > 0 and got["size"] in (64, 128)


def _fake_rates(monkeypatch, bf16, fp32, gpu=None):
    """``measure_matmul_flops`` returning fixed rates (FLOP/s per dtype); ``gpu``: a CUDA device name."""
    from stabledrl_mcore.bench import peak

    rates = {torch.bfloat16: bf16, torch.float32: fp32}
    monkeypatch.setattr(
        peak,
        "measure_matmul_flops",
        lambda dtype, **kw: {"flops": rates[dtype], "size": 1024, "seconds": 2 * 1024**3 / rates[dtype]},
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
    if gpu:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    return peak


def test_peak_is_the_matmul_rate_of_the_model_dtype(monkeypatch):
    """A CPU without bf16 units: emulated bf16 products at 1/20 of the fp32 rate. An fp32 model's MFU
    divides by the measured fp32 rate (against the bf16 rate a 50%-of-fp32 run would read 1000%)."""
    from stabledrl_mcore.bench.report import peak_label

    peak = _fake_rates(monkeypatch, bf16=5e9, fp32=100e9)
    got = peak.device_peak("fp32")
    assert (got["kind"], got["dtype"], got["model_dtype"]) == ("measured", "fp32", "fp32")
    assert got["peak_flops"] == got["fp32_matmul_flops"] == 100e9 and got["bf16_matmul_flops"] == 5e9
    train = PhaseResult("train", seconds=[1.0], tokens=10.0, flops=50e9).summary(got["peak_flops"])
    assert train["mfu"] == pytest.approx(0.5)
    assert peak_label(got) == "measured fp32 matmul rate, fp32 model" and peak.describe(got) == "measured fp32"
    bf16 = peak.device_peak(torch.bfloat16)  # a bf16 model on the same CPU: its own (slow) rate
    assert (bf16["kind"], bf16["dtype"], bf16["peak_flops"]) == ("measured", "bf16", 5e9)
    # the second measurement merges in the best rate of each dtype, each on its own
    _fake_rates(monkeypatch, bf16=6e9, fp32=80e9)
    again = peak.device_peak("fp32", previous=got)
    assert again["peak_flops"] == 100e9 and again["bf16_matmul_flops"] == 6e9 and len(again["measurements"]) == 2
    assert peak.device_peak("fp32", override_tflops=0.2)["peak_flops"] == 0.2e12
    with pytest.raises(ValueError, match="dtype"):
        peak.device_peak("fp16")


def test_bench_of_an_fp32_model_takes_mfu_against_the_fp32_rate(monkeypatch, tmp_path):
    """The whole bench in this process, the matmul rates faked as on a CPU without bf16 units (bf16
    emulated at a ten-millionth of fp32): the fp32 model's MFU is its model FLOP/s over the fp32 rate
    (the bf16 rate used to be the peak, and the MFU read in the thousands of percent)."""
    from stabledrl_mcore.bench.report import format_table
    from stabledrl_mcore.bench.run import bench_in_process
    from stabledrl_mcore.config.schema import load_config

    _fake_rates(monkeypatch, bf16=1e6, fp32=1e13)
    cfg = load_config(CONFIG, SMALL + [f"logging.run_dir={tmp_path}"])
    data = bench_in_process(cfg, ["train"], warmup=0, repeats=1, baseline=False)
    train = data["phases"]["train"]
    assert data["matmul_peak_flops"] == 1e13 and data["peak"]["dtype"] == "fp32"
    assert data["mfu"] == pytest.approx(train["model_flops_per_s"] / 1e13) == train["mfu"]
    assert 0 < data["mfu"] < 1 and data["mfu_vs_fp32"] == pytest.approx(data["mfu"])
    table = format_table(data)
    assert "peak for MFU (measured fp32 matmul rate, fp32 model): 10.0 TFLOP/s" in table
    assert "vs measured fp32 peak" in table


def test_gpu_peak_rated_for_bf16_measured_for_fp32(monkeypatch):
    """On a known GPU a bf16 model divides by the rated dense bf16 peak; an fp32 model by the fp32
    (or, with TF32 allowed, tf32) rate measured in the process, named as such."""
    peak = _fake_rates(monkeypatch, bf16=700e12, fp32=50e12, gpu="NVIDIA H100 80GB HBM3")
    bf16 = peak.device_peak("bf16")
    assert (bf16["kind"], bf16["dtype"], bf16["peak_flops"]) == ("rated", "bf16", 989e12)
    matmul, tf32 = torch.backends.cuda.matmul, torch.backends.cuda.matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        fp32 = peak.device_peak("fp32")
        assert (fp32["kind"], fp32["dtype"], fp32["peak_flops"], fp32["rated_bf16_flops"]) == (
            "measured",
            "fp32",
            50e12,
            989e12,
        )
        matmul.allow_tf32 = True
        assert peak.device_peak("fp32")["dtype"] == "tf32"
    finally:
        matmul.allow_tf32 = tf32
    unknown = _fake_rates(monkeypatch, bf16=300e12, fp32=40e12, gpu="Some Future GPU").device_peak("bf16")
    assert (unknown["kind"], unknown["peak_flops"]) == ("measured", 300e12)


def test_fill_flat_groups():
    from types import SimpleNamespace

    batch = SimpleNamespace(
        advantages=torch.tensor([0.0, 0.0, 0.0, 0.5, -0.5, 0.0, 0.0, 0.0]),
        group_index=torch.tensor([0, 0, 0, 1, 1, 2, 2, 2]),
    )
    fill_flat_groups(batch)
    assert batch.advantages.tolist() == [1.0, -1.0, 0.0, 0.5, -0.5, 1.0, -1.0, 0.0]


def test_bench_cli_json(tmp_path):
    out = tmp_path / "bench.json"
    code, stdout, stderr = run_cli(
        "bench",
        "--config",
        CONFIG,
        f"logging.run_dir={tmp_path}",
        *SMALL,
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--json",
        str(out),
    )
    assert code == 0, stderr[-3000:]
    data = json.loads(out.read_text())
    for key in ("mfu", "matmul_peak_flops", "step_tokens_per_s", "speedup_vs_baseline"):
        assert data[key], key
    assert set(data["phases"]) == {"rollout", "likelihood_full", "likelihood_staircase", "train", "optimizer", "step"}
    assert set(data["speedup_vs_baseline"]) == set(data["phases"])
    # an fp32 model on CPU: MFU divides by the fp32 matmul rate measured in the run, not the bf16 one
    peak = data["peak"]
    assert peak["kind"] == "measured" and peak["dtype"] == peak["model_dtype"] == data["model"]["dtype"] == "fp32"
    assert data["matmul_peak_flops"] == peak["peak_flops"] == peak["fp32_matmul_flops"] > 0
    assert peak["bf16_matmul_flops"] > 0 and len(peak["measurements"]) == 2  # before and after the phases
    w = data["workload"]
    assert w["sequences"] == 8 and w["generated"] == 8
    cfg = get_preset("llada-tiny")
    assert data["model"]["vocab_size"] == cfg.vocab_size  # the preset's vocabulary is kept
    train = data["phases"]["train"]
    # forward + backward of num_mc draws of every sequence: 3 F_fwd(S) per token, counted by the hook
    assert train["tokens"] == w["num_mc"] * w["sequences"] * w["seq_len"]
    # ... less the LM head on the prompt positions: it runs on the completion's only
    skipped_head = w["num_mc"] * w["sequences"] * (w["seq_len"] - w["generated"]) * 2 * cfg.vocab_size * cfg.hidden_size
    assert train["model_flops"] == pytest.approx(
        3 * (train["tokens"] * forward_flops_per_token(cfg, w["seq_len"]) - skipped_head)
    )
    # the baseline runs the head on every position
    assert data["baseline"]["phases"]["train"]["model_flops"] == pytest.approx(train["model_flops"] + 3 * skipped_head)
    assert data["mfu"] == pytest.approx(train["model_flops_per_s"] / data["matmul_peak_flops"])
    assert 0 < data["mfu"] <= 1 and data["mfu_vs_fp32"] == pytest.approx(data["mfu"])
    step_tokens = w["sequences"] * w["seq_len"]
    assert data["step_tokens_per_s"] == pytest.approx(step_tokens / data["phases"]["step"]["median_s"])
    for ph in data["phases"].values():
        assert ph["median_s"] > 0 and ph["q1_s"] <= ph["median_s"] <= ph["q3_s"]
    assert "MFU" in stdout and "speedup" in stdout
    assert "peak for MFU (measured fp32 matmul rate, fp32 model)" in stdout
    assert "vs measured fp32 peak" in stdout and "(vs measured fp32 matmul" not in stdout  # not said twice


@pytest.mark.parametrize(
    "args, message",
    [
        (["--phases", "warp"], "unknown bench phase"),
        (["--repeats", "0"], "--repeats"),
        (["algo.epz=1"], "did you mean algo.eps"),
        (["--rollout-mode", "fast:rollout.stepz=2"], "--rollout-mode fast: unknown"),
    ],
)
def test_bench_bad_input_is_one_line_exit_2(args, message):
    code, _, err = run_cli("bench", "--config", CONFIG, *args, timeout=120)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.multiprocess
def test_bench_weak_scaling_two_ranks(tmp_path):
    out = tmp_path / "scaling.json"
    code, stdout, stderr = run_cli(
        "bench",
        "--config",
        CONFIG,
        f"logging.run_dir={tmp_path}",
        *SMALL,
        "--phases",
        "train,optimizer",
        "--no-baseline",
        "--dp-scaling",
        "--scaling-phases",
        "train,optimizer",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--json",
        str(out),
        timeout=600,
    )
    assert code == 0, stderr[-3000:]
    data = json.loads(out.read_text())
    assert "speedup_vs_baseline" not in data
    scaling = data["scaling"]
    assert scaling["ranks"] == [1, 2] and scaling["backend"] == "gloo" and scaling["one_rank_from_main_run"]
    # weak scaling: each of the 2 ranks holds as many sequences as the single rank
    assert scaling["two_ranks"]["train"]["tokens"] == 2 * scaling["one_rank"]["train"]["tokens"]
    # the reported quantities against their definitions, from the run's own measurements
    one, two = scaling["one_rank"]["train"], scaling["two_ranks"]["train"]
    for phase in (one, two):
        assert phase["tokens_per_s"] == pytest.approx(phase["tokens"] / phase["median_s"])
    assert scaling["efficiency"]["train"] == pytest.approx(two["tokens_per_s"] / 2 / one["tokens_per_s"])
    assert data["weak_scaling_efficiency"] == scaling["efficiency"]["train"]
    assert "weak scaling" in stdout
    ceiling = scaling["machine_ceiling"]
    assert ceiling["ceiling"] == pytest.approx(statistics.median(ceiling["per_round"]))
    assert len(ceiling["per_round"]) == ceiling["rounds"] and ceiling["one_process_flops"] > 0
    assert scaling["efficiency_vs_ceiling"]["train"] == pytest.approx(
        scaling["efficiency"]["train"] / ceiling["ceiling"]
    )
    assert "machine ceiling" in stdout


def test_machine_ceiling_is_the_median_of_alternating_rounds():
    from stabledrl_mcore.bench.scaling import machine_ceiling

    result = machine_ceiling(2, size=64, seconds=0.1, rounds=3, timeout=120)
    assert result["rounds"] == 3 and len(result["per_round"]) == 3
    assert all(r > 0 for r in result["per_round"])
    assert result["ceiling"] == sorted(result["per_round"])[1]
    assert result["one_process_flops"] > 0 and result["per_process_flops"] > 0


def test_bench_rollout_modes_side_by_side(tmp_path):
    """Two rollout modes in one run, next to the baseline's rollout; NFE = forwards per completion;
    a checkpoint (a tiny random HF LLaDA) adds greedy held-out accuracy per mode."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_fixtures import write_hf_checkpoint

    checkpoint = write_hf_checkpoint(str(tmp_path / "hf_llada"), "llada", seed=3)
    out = tmp_path / "modes.json"
    code, stdout, stderr = run_cli(
        "bench",
        "--config",
        CONFIG,
        f"logging.run_dir={tmp_path}",
        *SMALL,
        f"model.checkpoint={checkpoint}",
        "eval.num_examples=4",
        "--phases",
        "rollout",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--json",
        str(out),
        "--rollout-mode",
        "exact:",
        "--rollout-mode",
        "fast:rollout.steps=2",
    )
    assert code == 0, stderr[-3000:]
    data = json.loads(out.read_text())
    modes = data["rollout_modes"]
    assert list(modes) == ["exact", "fast"]
    exact, fast = modes["exact"], modes["fast"]
    for m in (exact, fast):  # the reported quantities against their definitions
        assert m["completions"] == 8 and m["tokens"] == 8 * m["settings"]["gen_length"]
        assert m["tokens_per_s"] == pytest.approx(m["tokens"] / m["median_s"])
        assert m["accuracy_examples"] == 4 and m["greedy_accuracy"] * 4 in (0, 1, 2, 3, 4)
    # LLaDA: one forward of every row per denoising step (rollout.steps total)
    assert exact["nfe_per_completion"] == 4 and fast["nfe_per_completion"] == 2
    assert fast["overrides"] == ["rollout.steps=2"] and fast["settings"]["steps"] == 2
    base = data["rollout_modes_baseline"]
    assert base["tokens_per_s"] == pytest.approx(base["tokens"] / base["median_s"])
    assert exact["speedup_vs_first"] == 1.0
    assert fast["speedup_vs_first"] == pytest.approx(fast["tokens_per_s"] / exact["tokens_per_s"])
    for m in (exact, fast):
        assert m["speedup_vs_baseline"] == pytest.approx(m["tokens_per_s"] / base["tokens_per_s"])
    assert "rollout mode" in stdout and "NFE/compl." in stdout and "rollout.steps=2" in stdout
    assert "4 held-out examples" in stdout


def test_rollout_mode_parsing_refuses_by_name():
    from stabledrl_mcore.bench.modes import parse_rollout_modes

    assert parse_rollout_modes(["exact:", "fast:rollout.threshold=0.9, rollout.steps=2"]) == [
        ("exact", []),
        ("fast", ["rollout.threshold=0.9", "rollout.steps=2"]),
    ]
    for bad, message in (
        (["fast"], "expected NAME:"),
        (["a:", "a:"], "given twice"),
        (["a:algo.eps=1"], "not a rollout.FIELD"),
        (["a:rollout.prompts_per_step=4"], "fixed when the set-up is built"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_rollout_modes(bad)


def test_rollout_mode_accuracy_is_greedy_with_the_mode_settings(monkeypatch):
    """Held-out accuracy decodes each example once, at temperature 0, with the mode's own settings."""
    import dataclasses
    from types import SimpleNamespace

    from stabledrl_mcore.bench import modes
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl import rollout, trainer
    from stabledrl_mcore.tasks import from_config

    cfg = load_config(CONFIG, ["rollout.steps=2", "eval.num_examples=3"])
    seen = {}

    def fake_rollout(s, step):
        seen.update(rollout=s.cfg.rollout, mb=s.cfg.parallel.micro_batch_size, examples=s.prompts.for_step(0))
        return SimpleNamespace(examples=seen["examples"])

    monkeypatch.setattr(trainer, "rollout_phase", fake_rollout)
    monkeypatch.setattr(
        rollout, "score_rollouts", lambda b, task: SimpleNamespace(correct=torch.tensor([True, False, True]), size=3)
    )
    monkeypatch.setattr(from_config, "heldout_examples", lambda c, task: ["a", "b", "c"])
    Setup = dataclasses.make_dataclass("Setup", ["cfg", "task", "dp_rank", "dp_size", "prompts", "model"])
    setup = Setup(cfg=cfg, task=None, dp_rank=0, dp_size=1, prompts=None, model=None)
    mode = modes.RolloutMode(setup, "fast", cfg, ["rollout.steps=2"])
    result = mode.accuracy()
    assert result == {"greedy_accuracy": pytest.approx(2 / 3), "accuracy_examples": 3}
    r = seen["rollout"]
    assert r.group_size == 1 and r.temperature == 0.0 and r.steps == 2
    assert seen["mb"] == cfg.eval.micro_batch_size and seen["examples"] == ["a", "b", "c"]


def test_baseline_llada_sampler_follows_rollout_threshold():
    """The HF-style baseline decodes with ``rollout.threshold`` like our sampler: every position at or
    above it (threshold 0: a whole block per forward), a block ending once decoded; without it, the
    fixed schedule (one forward per step)."""
    from types import SimpleNamespace

    from stabledrl_mcore.bench.baseline import BaselineStep

    calls = []

    class Logits(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None):
            calls.append(input_ids.clone())
            logits = torch.randn(*input_ids.shape, 8, generator=torch.Generator().manual_seed(0))
            return SimpleNamespace(logits=logits.index_fill(-1, torch.tensor([7]), -torch.inf))  # never the mask

    base = object.__new__(BaselineStep)
    base.device, base.dtype, base.model = torch.device("cpu"), torch.float32, Logits()
    base.dcfg = SimpleNamespace(mask_token_id=7)
    prompt, valid = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    for threshold, forwards in ((None, 8), (0.0, 2)):
        calls.clear()
        base.cfg = SimpleNamespace(
            rollout=SimpleNamespace(gen_length=8, block_length=4, steps=8, temperature=0.0, threshold=threshold)
        )
        out = base._generate_llada(prompt, valid, torch.Generator().manual_seed(1))
        assert len(calls) == forwards and not (out == 7).any(), (threshold, len(calls))


def _pp_bench_worker(out_path):
    from stabledrl_mcore.bench.run import bench_in_process
    from stabledrl_mcore.config.schema import load_config

    cfg = load_config(CONFIG, SMALL + ["parallel.pipeline_parallel=2", "logging.run_dir=" + os.path.dirname(out_path)])
    result = bench_in_process(cfg, ["rollout", "likelihood_full", "train"], warmup=0, repeats=1, baseline=False)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as handle:
            json.dump(result, handle)


@pytest.mark.multiprocess
def test_bench_at_pp2_counts_a_replica_once_and_measures_the_bubble(tmp_path):
    from stabledrl_mcore.bench.report import format_table
    from stabledrl_mcore.parallel.launch import spawn

    out = str(tmp_path / "pp2.json")
    spawn(_pp_bench_worker, 2, (out,), timeout=300)
    data = json.loads(open(out).read())
    w, phases = data["workload"], data["phases"]
    assert data["layout"]["pp"] == 2 and data["layout"]["dp"] == 1
    # the two stages of one replica report its tokens once (not once per rank)
    assert phases["rollout"]["tokens"] == w["sequences"] * w["generated"]
    assert phases["likelihood_full"]["tokens"] == w["num_mc"] * w["sequences"] * w["seq_len"]
    for name in ("rollout", "likelihood_full"):  # forward-only phases: stages wait for each other
        assert 0.0 < phases[name]["pipeline_bubble_fraction"] < 1.0, name
    assert "pipeline_bubble_fraction" not in phases["train"]  # 1F1B's backward is not timed
    assert "pipeline bubble" in format_table(data)


def test_bench_of_a_mixture_of_experts_counts_active_parameters(tmp_path):
    """sdar-moe-tiny (4 experts of width 48, top-2): the train phase's model FLOPs are 3 F_fwd(2S) per
    staircase query (2S per sequence and draw) with N_mm = the router and 2 of the 4 experts per layer (re-derived here), the
    baseline is transformers' Qwen3-MoE, and the report names total and active parameters."""
    out = tmp_path / "bench.json"
    code, stdout, stderr = run_cli(
        "bench",
        "--config",
        CONFIG,
        f"logging.run_dir={tmp_path}",
        *SMALL,
        "model.preset=sdar-moe-tiny",
        "algo.likelihood=staircase",
        "rollout.block_length=4",
        "--phases",
        "train",
        "--no-baseline",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--json",
        str(out),
    )
    assert code == 0, stderr[-3000:]
    data = json.loads(out.read_text())
    h, layers, vocab = 64, 2, 256
    attention = h * 16 * (4 + 2 * 2) + 4 * 16 * h
    active_mm = layers * (attention + 4 * h + 2 * 3 * h * 48) + vocab * h
    total = layers * (attention + 2 * 16 + 4 * h + 4 * 3 * h * 48 + 2 * h) + 2 * vocab * h + h
    active = total - layers * (4 - 2) * 3 * h * 48
    m = data["model"]
    assert (m["params"], m["active_params"], m["matmul_params"]) == (total, active, active_mm) == (131968, 95104, 78336)
    w, train = data["workload"], data["phases"]["train"]
    keys = 2 * w["seq_len"]  # staircase: 2S queries over [x_t | x_0], 2S keys
    per_token = 2 * active_mm + 4 * layers * keys * 4 * 16
    assert train["tokens"] == w["num_mc"] * w["sequences"] * w["seq_len"]
    skipped_head = w["num_mc"] * w["sequences"] * (keys - w["generated"]) * 2 * vocab * h  # head: completion only
    assert train["model_flops"] == pytest.approx(3 * (2 * train["tokens"] * per_token - skipped_head))
    from stabledrl_mcore.bench.baseline import hf_model

    baseline = hf_model(get_preset("sdar-moe-tiny"))
    assert type(baseline).__name__ == "Qwen3MoeForCausalLM" and sum(p.numel() for p in baseline.parameters()) == total
    assert "0.132M params, 0.095M active: 4 experts, top-2" in stdout

"""The demo and the stress experiment (docs/experiments.md): the pieces that are cheap to check."""

import math
import sys

import numpy as np
import pytest

from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.experiments.plots import plot_demo_curves, plot_stress
from stabledrl_mcore.experiments.runs import eval_history, mean_of_last, percentile, run_side_by_side
from stabledrl_mcore.experiments.stress import StressOptions, arm_overrides, summarise_arm
from stabledrl_mcore.experiments.tiny_sudoku import (
    TinySudoku,
    answer_separator_id,
    rl_overrides,
    sft_batches,
    tiny_model_config,
)
from stabledrl_mcore.models import segment_positions
from stabledrl_mcore.tasks import get_task
from stabledrl_mcore.tasks.tokenizer import train_sentencepiece

PNG = b"\x89PNG\r\n\x1a\n"


def test_sft_batches_mark_the_answer_and_eos(tmp_path):
    task = get_task("sudoku", prompt_style="compact")
    examples = task.load("train", n=8, seed=0)
    tok = train_sentencepiece(
        [task.prompt(e) + e.reference["solution"] for e in examples], str(tmp_path / "tok"), vocab_size=16
    )
    ids, completion, gen_length = sft_batches(tok, task, examples)
    answer = len(tok.encode(examples[0].reference["solution"])) + 1  # the digits (+ word piece) + EOS
    assert gen_length == answer >= 17
    assert completion.sum(1).tolist() == [answer] * 8
    first = ids[0][completion[0]].tolist()
    assert first[-1] == tok.eos_token_id
    assert tok.decode(first) == examples[0].reference["solution"]
    assert not completion[:, : ids.shape[1] - answer].any(), "prompt tokens must never be trained on"


def test_tiny_model_inputs_align_each_answer_cell_with_its_puzzle_cell(tmp_path):
    task = get_task("sudoku", prompt_style="compact")
    examples = task.load("train", n=8, seed=0)
    tok = train_sentencepiece(
        [task.prompt(e) + e.reference["solution"] for e in examples], str(tmp_path / "tok"), vocab_size=16
    )
    cfg = tiny_model_config(tok, TinySudoku())
    assert (cfg.position_embedding, cfg.num_segments, cfg.embedding_init_std) == ("learned", 2, 1.0)
    assert tok.decode([cfg.segment_separator_id]) == "=" == tok.decode([answer_separator_id(tok)])
    ids, completion, _ = sft_batches(tok, task, examples)
    positions, segments = segment_positions(ids, cfg.segment_separator_id)
    digits = [c for c in "1234"]
    for row in range(ids.shape[0]):
        pieces = [tok.decode([i]) for i in ids[row].tolist()]
        puzzle = [
            p
            for p, piece, a in zip(positions[row].tolist(), pieces, completion[row])
            if not a and piece in digits + ["0"]
        ]
        answer = [p for p, piece, a in zip(positions[row].tolist(), pieces, completion[row]) if a and piece in digits]
        assert len(puzzle) == len(answer) == 16 and puzzle == answer, "cell i of puzzle and answer share a position"
        first_answer = int(completion[row].nonzero()[0])
        assert set(segments[row][:first_answer].tolist()) == {0}, "the prompt (and its '=') is segment 0"
        assert set(segments[row][completion[row]].tolist()) == {1}
    from stabledrl_mcore.experiments.demo import DemoOptions

    assert tiny_model_config(tok, DemoOptions().setting).init_std == 0.05, "the main job's init"
    assert cfg.init_std == 0.02 == StressOptions().setting.init_std, "the stress experiment keeps Megatron's"
    rope = tiny_model_config(tok, TinySudoku(positions="rope"))
    assert (rope.position_embedding, rope.segment_separator_id, rope.num_segments) == ("rope", None, 0)
    with pytest.raises(ValueError, match="positions must be one of"):
        tiny_model_config(tok, TinySudoku(positions="alibi"))


def test_rl_recipe_is_a_valid_config_with_a_separate_unlabelled_pool(tmp_path):
    sft = {"checkpoint": str(tmp_path / "ckpt"), "tokenizer": str(tmp_path / "tok"), "gen_length": 18}
    cfg = load_config(
        None,
        rl_overrides(
            sft, str(tmp_path / "run"), seed=3, steps=7, nproc=2, eval_every=5, eval_examples=40, rollout_steps=6
        ),
    )
    assert (cfg.rollout.data_seed, cfg.parallel.seed, cfg.eval.seed) == (1003, 3, 3)
    assert cfg.parallel.micro_batch_size == 64 and cfg.rollout.steps == 6 and cfg.eval.every == 5
    assert cfg.algo.likelihood == "elbo" and cfg.algo.num_mc == 2 and cfg.parallel.retain_update_graph
    assert (
        load_config(
            None,
            rl_overrides(sft, "", seed=0, steps=5, nproc=1, eval_every=0, eval_examples=1, likelihood="mean_field"),
        ).algo.likelihood
        == "mean_field"
    )
    curriculum = load_config(
        None,
        rl_overrides(
            {**sft, "setting": {"rl_blanks": [8, 11]}}, "", seed=0, steps=5, nproc=1, eval_every=0, eval_examples=1
        ),
    )
    assert curriculum.rollout.task_options == {"blanks": [8, 11]} and not cfg.rollout.task_options
    labelled = {e.reference["puzzle"] for e in get_task("sudoku").load("train", n=300, seed=3)}
    pool = {e.reference["puzzle"] for e in get_task("sudoku").load("train", n=300, seed=1003)}
    assert len(labelled & pool) < 5, "the RL pool should not replay the labelled set"
    stress = load_config(
        None,
        rl_overrides(sft, "", seed=0, steps=5, nproc=1, eval_every=0, eval_examples=1)
        + arm_overrides("grpo", True, StressOptions(sigma=2.0)),
    )
    assert (stress.algo.loss, stress.algo.ratio_noise, stress.algo.ratio_noise_sigma) == ("grpo", "lognormal", 2.0)
    assert stress.algo.max_skipped_updates is None  # deliberate overflows are counted, not fatal


def test_percentile_matches_numpy():
    values = list(np.random.default_rng(0).standard_cauchy(101))
    for q in (0, 50, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(percentile([], 99))


def test_summarise_arm_flags_collapse_and_spikes():
    steps = range(1, 41)
    falling = [
        {
            "step": s,
            "reward_mean": 0.6 if s <= 10 else 0.05,
            "grad_norm": 50.0 if s == 20 else 0.5,
            "clip_frac_high": 0.25,
        }
        for s in steps
    ]
    summary = summarise_arm(falling, algo="grpo", noisy=True, opts=StressOptions())
    assert summary["max_grad_norm"] == 50.0 and summary["median_grad_norm"] == 0.5
    assert summary["reward_start"] == pytest.approx(0.6) and summary["reward_end"] == pytest.approx(0.05)
    assert summary["collapsed"] and summary["clip_frac_high"] == pytest.approx(0.25)
    steady = [dict(r, reward_mean=0.6 + 0.001 * r["step"], grad_norm=0.1) for r in falling]
    assert not summarise_arm(steady, algo="stabledrl", noisy=True, opts=StressOptions())["collapsed"]


def test_eval_history_and_final_mean():
    rows = [
        {"step": 0, "test_accuracy": 0.2},
        {"step": 1, "reward_mean": 0.5},
        {"step": 5, "reward_mean": 0.5, "test_accuracy": 0.3},
        {"step": 10, "test_accuracy": 0.5},
    ]
    assert eval_history(rows) == [(0, 0.2), (5, 0.3), (10, 0.5)]
    assert mean_of_last([0.2, 0.3, 0.5], 2) == pytest.approx(0.4)
    assert mean_of_last([0.7], 3) == pytest.approx(0.7)


def test_plots_write_png(tmp_path):
    rows = [{"step": 0, "test_accuracy": 0.2}] + [
        {"step": s, "reward_mean": 0.5 + 0.01 * s, "grad_norm": 0.1} for s in range(1, 6)
    ]
    rows[-1]["test_accuracy"] = 0.3
    plot_demo_curves(rows, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG
    arm = summarise_arm(rows[1:], algo="stabledrl", noisy=False, opts=StressOptions())
    plot_stress([arm, dict(arm, noise=True, algo="grpo")], str(tmp_path / "stress.png"))
    assert (tmp_path / "stress.png").read_bytes()[:8] == PNG


def test_side_by_side_runs_report_exit_codes_and_logs(tmp_path):
    configs = []
    for name, code in (("ok", 0), ("bad", 3), ("ok2", 0)):
        (tmp_path / name).mkdir()
        configs.append(str(tmp_path / name / "rl_config.yaml"))
        (tmp_path / name / "rl_config.yaml").write_text(str(code))
    script = "import sys; c = open(sys.argv[-1]).read(); print('ran', c); sys.exit(int(c))"
    codes = run_side_by_side(configs, parallel=2, poll=0.05, command=lambda path: [sys.executable, "-c", script, path])
    assert codes == [0, 3, 0]
    assert (tmp_path / "bad" / "train.log").read_text().strip() == "ran 3"

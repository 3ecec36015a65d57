"""``stabledrl eval --n K``: pass@k (unbiased), maj@k (ties), mean@k, per-sample records, DP sharding."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_fixtures import write_hf_checkpoint

from stabledrl_mcore.evaluation.at_k import check_ks, default_ks, majority_vote, pass_at_k, sample_metrics
from stabledrl_mcore.tasks.base import Example, Task

TEMPLATE = (
    "{% for m in messages %}tok7 {{ m['content'] }} tok8 {% endfor %}{% if add_generation_prompt %}tok9{% endif %}"
)


def test_pass_at_k_matches_the_hand_computed_estimator():
    # n = 5 samples, c = 2 correct: 1 - C(3, k) / C(5, k)
    want = {1: 1 - 3 / 5, 2: 1 - 3 / 10, 3: 1 - 1 / 10, 4: 1.0, 5: 1.0}  # C(3,k) = 0 for k > 3
    assert {k: pass_at_k(5, 2, k) for k in range(1, 6)} == pytest.approx(want, abs=1e-12)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    with pytest.raises(ValueError):
        pass_at_k(4, 2, 5)
    assert default_ks(5) == [1, 2, 4] and default_ks(8) == [1, 2, 4, 8] and default_ks(1) == [1]
    assert check_ks([4, 1, 4], 4) == [1, 4]
    with pytest.raises(ValueError, match="--k"):
        check_ks([8], 4)


def test_majority_vote_ties_go_to_the_earliest_answer_and_none_does_not_vote():
    assert majority_vote(["7", None, "8", "8", "7"]) == (0, 2)  # 2 - 2 tie: "7" came first
    assert majority_vote([None, "8", "7", "7"]) == (2, 2)
    assert majority_vote([None, None]) == (None, 0)
    samples = [
        {"extracted": e, "reward": r, "correct": e == "7"} for e, r in (("8", 0.0), ("7", 1.0), ("7", 1.0), (None, 0.0))
    ]
    m = sample_metrics(samples, [1, 2, 4], lambda a, b: a == b)
    # maj@1: "8" (wrong); maj@2: tie 8/7 -> "8" (earliest); maj@4: "7" has 2 votes
    assert (m["maj@1"], m["maj@2"], m["maj@4"]) == (0.0, 0.0, 1.0)
    assert (m["mean@1"], m["mean@2"], m["mean@4"]) == (0.0, 0.5, 0.5)
    assert m["pass@1"] == pytest.approx(0.5) and m["majority"] == {"answer": "7", "votes": 2}


def test_maj_votes_with_the_tasks_own_equivalence():
    from stabledrl_mcore.tasks import get_task

    gsm8k = get_task("gsm8k")
    assert gsm8k.same_answer("7.0", "7") and not gsm8k.same_answer("7", "8")
    assert majority_vote(["8", "7", "7.00"], gsm8k.same_answer) == (1, 2)


class _EvenFirstToken(Task):
    """Stub: the answer is the completion's first word; correct when its number is even."""

    name = "even"

    def extract_answer(self, completion):
        words = completion.split()
        return words[0] if words else None

    def _reward(self, completion, reference):
        answer = self.extract_answer(completion)
        return float(answer is not None and answer[3:].isdigit() and int(answer[3:]) % 2 == 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An LLaDA HF fixture with a chat template, loaded once; Megatron torn down after."""
    from stabledrl_mcore import load_model
    from stabledrl_mcore.parallel import bootstrap, cpu_compat
    from stabledrl_mcore.tasks.tokenizer import load_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = write_hf_checkpoint(str(tmp_path_factory.mktemp("evaln") / "llada"), "llada", seed=5)
    config_path = os.path.join(path, "tokenizer_config.json")
    config = json.load(open(config_path))
    config["chat_template"] = TEMPLATE
    json.dump(config, open(config_path, "w"))
    yield path, load_model(path), load_tokenizer(path)
    bootstrap.destroy()
    cpu_compat.disable()
    torch.set_num_threads(threads)


def test_sampled_eval_is_per_sample_and_does_not_depend_on_the_dp_size(tiny):
    from stabledrl_mcore.evaluation.distributed import _sampled_records, evaluate_model

    _, model, tokenizer = tiny
    task = _EvenFirstToken()
    examples = [Example(prompt=f"tok{10 + i} tok{20 + i}", reference="even", meta={"index": i}) for i in range(5)]
    sampling = dict(
        gen_length=4,
        steps=4,
        block_length=4,
        temperature=1.0,
        threshold=None,
        progress=False,
        cache="none",
        compile="none",
    )
    result = evaluate_model(
        model,
        tokenizer,
        task,
        examples,
        micro_batch=8,
        seed=3,
        n=4,
        ks=[1, 2, 4],
        **{k: v for k, v in sampling.items() if k != "progress"},
    )
    assert result.num_examples == 5 and result.n == 4 and [r["index"] for r in result.records] == list(range(5))
    for rec in result.records:
        assert len(rec["samples"]) == 4 and rec["completion"] == rec["samples"][0]["completion"]
        c = sum(s["correct"] for s in rec["samples"])
        assert rec["num_correct"] == c and rec["pass@1"] == pytest.approx(c / 4)
        assert rec["pass@4"] == float(c > 0) and rec["mean@4"] == pytest.approx(
            sum(s["reward"] for s in rec["samples"]) / 4
        )
    assert len({s["completion"] for r in result.records for s in r["samples"]}) > 1  # really sampled
    assert result.metrics["pass@1"] == pytest.approx(result.accuracy)
    assert result.metrics["pass@1"] <= result.metrics["pass@2"] <= result.metrics["pass@4"]
    # the shards of DP = 2 (and 3) are exactly the DP = 1 records, in order
    args = (model, tokenizer, task, examples)
    whole = _sampled_records(*args, 0, 1, 8, 3, 4, [1, 2, 4], sampling)
    assert whole == result.records
    for world in (2, 3):
        parts = [r for rank in range(world) for r in _sampled_records(*args, rank, world, 8, 3, 4, [1, 2, 4], sampling)]
        assert parts == whole
    again = evaluate_model(
        model,
        tokenizer,
        task,
        examples,
        micro_batch=8,
        seed=4,
        n=4,
        ks=[1],
        **{k: v for k, v in sampling.items() if k != "progress"},
    )
    assert [r["samples"] for r in again.records] != [r["samples"] for r in whole]  # the seed matters


def test_eval_cli_writes_every_sample_and_a_summary(tiny, tmp_path, monkeypatch, capsys):
    from stabledrl_mcore.cli import eval as eval_cmd
    from stabledrl_mcore.cli.app import main

    path = tiny[0]
    monkeypatch.chdir(tmp_path)
    args = [
        "eval",
        "--ckpt",
        path,
        "--task",
        "sudoku",
        "--limit",
        "3",
        "--gen-length",
        "4",
        "--steps",
        "4",
        "--block-length",
        "4",
        "--batch-size",
        "8",
        "--no-progress",
        "--temperature",
        "1.0",
    ]
    assert main(args + ["--n", "4", "--k", "1,4"]) == 0
    records = [json.loads(line) for line in open(tmp_path / "eval_sudoku_test.jsonl")]
    summary = json.loads((tmp_path / "eval_sudoku_test.summary.json").read_text())
    assert len(records) == 3 and all(len(r["samples"]) == 4 for r in records)
    assert set(records[0]["samples"][0]) == {"completion", "extracted", "reward", "correct"}
    assert records[0]["prompt"].startswith("tok7 ") and records[0]["prompt"].endswith("tok9")
    assert summary["samples_per_example"] == 4 and summary["settings"]["k"] == [1, 4]
    for name in ("pass@1", "pass@4", "maj@1", "maj@4", "mean@1", "mean@4"):
        assert summary[name] == pytest.approx(sum(r[name] for r in records) / 3), name
    assert "pass@4" in capsys.readouterr().out
    assert main(args + ["--n", "2", "--out", "checked.jsonl", "--check"]) == 0  # inputs only, no model, no file
    assert "eval inputs ok: 3 sudoku/test examples x 2 samples" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "checked.jsonl")
    # refused by name before any rank starts, one line each
    monkeypatch.setattr(eval_cmd, "_eval_rank", lambda options: pytest.fail("a rank started"))
    for extra, needle in (
        (["--n", "4", "--temperature", "0"], "--temperature"),
        (["--n", "2", "--k", "4", "--overwrite"], "--k"),
        (["--n", "0", "--overwrite"], "--n"),
    ):
        capsys.readouterr()
        assert main(args + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    assert main(args + ["--n", "4"]) == 2  # both files exist: --overwrite needed
    assert "--overwrite" in capsys.readouterr().err

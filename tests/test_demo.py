"""Pieces of the README's main job that are cheap to check: SFT batches and the plot."""

import json


from stabledrl_mcore.demo import _sft_batches, plot_curves
from stabledrl_mcore.tasks import get_task
from stabledrl_mcore.tokenizer import train_sentencepiece


def test_sft_batches_mark_the_answer_and_eos(tmp_path):
    task = get_task("sudoku", prompt_style="compact")
    examples = task.load("train", n=8, seed=0)
    tok = train_sentencepiece([task.prompt(e) + e.reference["solution"] for e in examples],
                              str(tmp_path / "tok"), vocab_size=16)
    ids, completion, gen_length = _sft_batches(tok, task, examples)
    answer = len(tok.encode(examples[0].reference["solution"])) + 1  # the digits (+ word piece) + EOS
    assert gen_length == answer >= 17
    assert completion.sum(1).tolist() == [answer] * 8
    first = ids[0][completion[0]].tolist()
    assert first[-1] == tok.eos_token_id
    assert tok.decode(first) == examples[0].reference["solution"]
    assert not completion[:, : ids.shape[1] - answer].any(), "prompt tokens must never be trained on"


def test_plot_curves_writes_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "reward_mean": 0.5 + 0.01 * s, "grad_norm": 0.1} for s in range(1, 6)]
    rows[-1]["test_accuracy"] = 0.3
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "curves.png"
    plot_curves(str(metrics), str(out), start_accuracy=0.2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

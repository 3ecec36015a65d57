"""The Python API composes (``load_model`` -> generate -> likelihoods -> evaluate_model, LLaDA and
SDAR), ``generate`` applies the chat template, ``eval`` writes where it is told and never over a file."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_fixtures import write_hf_checkpoint

# a template the fixture's word-level tokenizer can encode: every piece is one of its tokens
TEMPLATE = (
    "{% for m in messages %}tok7 {{ m['content'] }} tok8 {% endfor %}{% if add_generation_prompt %}tok9{% endif %}"
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{arch: HF directory}``, the tokenizers with a chat template; Megatron torn down after."""
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("api")
    out = {}
    for arch in ("llada", "sdar"):
        path = write_hf_checkpoint(str(root / arch), arch, seed=3)
        config_path = os.path.join(path, "tokenizer_config.json")
        config = json.load(open(config_path))
        config["chat_template"] = TEMPLATE
        json.dump(config, open(config_path, "w"))
        out[arch] = path
    yield out
    bootstrap.destroy()
    cpu_compat.disable()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_load_model_composes_with_the_library(checkpoints, arch):
    from stabledrl_mcore import load_model
    from stabledrl_mcore.diffusion import elbo, generate, mean_field_logp, mixture
    from stabledrl_mcore.diffusion.staircase import block_elbo_staircase
    from stabledrl_mcore.evaluation.distributed import evaluate_model
    from stabledrl_mcore.models import AttentionLayout
    from stabledrl_mcore.tasks import get_task
    from stabledrl_mcore.tasks.tokenizer import load_tokenizer

    model = load_model(checkpoints[arch])
    raw = model.model
    assert model.config.arch == arch  # the existing attributes stay
    prompt = torch.randint(0, 90, (2, 4), generator=torch.Generator().manual_seed(0))
    sampling = dict(gen_length=8, steps=4 if arch == "sdar" else 8, block_length=None if arch == "sdar" else 8)
    with torch.no_grad():
        got = generate(model, prompt, generator=torch.Generator().manual_seed(1), **sampling)
        want = generate(raw, prompt, generator=torch.Generator().manual_seed(1), **sampling)
    assert torch.equal(got, want) and got.shape[1] >= 12
    ids, completion = got[:, :12], torch.zeros(2, 12, dtype=torch.bool)
    completion[:, 4:] = True
    bidirectional = {} if arch == "llada" else {"attention_mask": AttentionLayout.bidirectional()}
    estimators = [
        lambda m, g: elbo(m, ids, completion, num_mc=2, generator=g, **bidirectional),
        lambda m, g: mean_field_logp(m, ids, completion, generator=g, **bidirectional),
        lambda m, g: mixture(m, ids, completion, num_mc=2, generator=g, **bidirectional),
    ]
    if arch == "sdar":
        estimators.append(lambda m, g: block_elbo_staircase(m, ids, completion, num_mc=2, generator=g))
    with torch.no_grad():
        for estimate in estimators:
            a = estimate(model, torch.Generator().manual_seed(2)).seq
            b = estimate(raw, torch.Generator().manual_seed(2)).seq
            assert torch.isfinite(a).all() and torch.allclose(a, b), (a, b)
    task = get_task("sudoku", prompt_style="compact")
    result = evaluate_model(
        model, load_tokenizer(checkpoints[arch]), task, task.load("test", n=3, seed=0), micro_batch=2, **sampling
    )
    assert result.num_examples == 3 and len(result.records) == 3


def _jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_generate_applies_the_chat_template_unless_told_not_to(checkpoints, tmp_path, capsys):
    from stabledrl_mcore.cli.app import main

    common = ["generate", "--ckpt", checkpoints["llada"], "--prompt", "tok5 tok6", "--gen-length", "4", "--no-progress"]
    out = tmp_path / "chat.jsonl"
    assert main(common + ["--out", str(out)]) == 0
    [record] = _jsonl(out)
    assert record["input"] == "tok5 tok6" and record["prompt"] == "tok7 tok5 tok6 tok8 tok9"
    plain = tmp_path / "plain.jsonl"
    assert main(common + ["--out", str(plain), "--no-chat-template"]) == 0
    assert _jsonl(plain)[0]["prompt"] == "tok5 tok6"
    capsys.readouterr()
    assert main(common + ["--out", str(out)]) == 2  # exists: refused, nothing replaced
    assert "--overwrite" in capsys.readouterr().err and _jsonl(out) == [record]


def test_eval_writes_to_the_working_directory_and_never_over_a_file(checkpoints, tmp_path, monkeypatch, capsys):
    from stabledrl_mcore.cli import eval as eval_cmd
    from stabledrl_mcore.cli.app import main

    ckpt = checkpoints["sdar"]
    monkeypatch.chdir(tmp_path)
    args = [
        "eval",
        "--ckpt",
        ckpt,
        "--task",
        "sudoku",
        "--limit",
        "2",
        "--gen-length",
        "4",
        "--batch-size",
        "2",
        "--no-progress",
    ]
    assert main(args) == 0
    out = tmp_path / "eval_sudoku_test.jsonl"
    assert out.is_file() and not any(name.startswith("eval_") for name in os.listdir(ckpt))
    records = _jsonl(out)
    assert len(records) == 2 and records[0]["prompt"].startswith("tok7 ") and records[0]["prompt"].endswith("tok9")
    assert records[0]["question"] in records[0]["prompt"]  # the exact text the model saw, template included
    capsys.readouterr()
    loaded = []
    monkeypatch.setattr(eval_cmd, "_eval_rank", lambda options: loaded.append(options) or 0)
    assert main(args) == 2 and not loaded  # refused before any rank (or model) starts
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "--overwrite" in err
    assert main(args + ["--overwrite"]) == 0 and loaded[0]["out"] == str(out)

"""Prompts from the config: system prompt, ``{question}`` template, a Jinja chat template file; one
rendering for train, eval and generate; a bad template refused in one line before any rank starts."""

from __future__ import annotations

import json
import os

import pytest

from stabledrl_mcore.tasks import Example, get_task
from stabledrl_mcore.tasks.prompts import (
    PromptFormat,
    build_prompt,
    encode_prompts,
    prompt_format,
    render_chat_template,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
JINJA = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_default_format_is_todays_prompt_and_the_fields_change_it(tmp_path):
    task = get_task("gsm8k")
    example = Example(prompt="What is 2+2?", reference="4")
    assert task.prompt(example) == build_prompt("What is 2+2?", system_prompt=task.system_prompt)
    task.prompt_format = prompt_format("Be brief.", "Solve: {question} {not a field}")
    assert task.prompt(example) == "Be brief.\n\nQuestion: Solve: What is 2+2? {not a field}\nAnswer:"
    task.prompt_format = prompt_format("", None, _write(tmp_path, "t.jinja", JINJA))
    assert task.prompt(example) == "<user>What is 2+2?</user>\n<assistant>"
    task.prompt_format = prompt_format(None, None, _write(tmp_path, "t.jinja", JINJA))  # the task's system prompt
    assert task.prompt(example).startswith(f"<system>{task.system_prompt}</system>\n<user>What is 2+2?")


def test_the_file_renders_as_the_tokenizers_own_template_would():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"a": 0, "<s>": 1}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no "
        "system role') }}{% endif %}[{{ m['content'] | trim }}]\n{% endfor %}{% if add_generation_prompt "
        "%}>{% endif %}"
    )
    messages = [{"role": "user", "content": " hi "}]
    want = hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)

    class Wrapped:
        backend = hf

    assert render_chat_template(template, messages, Wrapped()) == want == "<s>[hi]\n>"
    # a template that refuses a system role gets the system prompt folded into the user turn, as before
    fmt = PromptFormat(system_prompt="SYS", chat_template="x.jinja", chat_template_text=template)
    assert fmt.render("Q", Wrapped()) == "<s>[SYS\n\nQ]\n>"


def test_train_eval_and_generate_render_the_same_prompt(tmp_path, monkeypatch):
    from stabledrl_mcore.cli import args as commands
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl import setup
    from stabledrl_mcore.tasks.prompts import rollout_prompt_format

    jinja = _write(tmp_path, "chat.jinja", JINJA)
    cfg = load_config(
        TINY,
        [
            "rollout.task=gsm8k",
            "rollout.prompt_style=chat",
            "rollout.system_prompt=SYS",
            "rollout.prompt_template='Q: {question}'",
            f"rollout.chat_template={jinja}",
        ],
    )
    seen = []

    class Stop(Exception):
        pass

    def stop(cfg_, task, **_):
        seen.append(task)
        raise Stop  # stop build_training before anything distributed

    monkeypatch.setattr(setup, "load_train_examples", stop)
    with pytest.raises(Stop):
        setup.build_training(cfg)
    example = Example(prompt="2+2?", reference="4")
    trained = seen[0].prompt(example)
    assert trained == "<system>SYS</system>\n<user>Q: 2+2?</user>\n<assistant>"
    args = commands.argparse.Namespace(system_prompt="SYS", prompt_template="Q: {question}", chat_template=jinja)
    evaluated = get_task("gsm8k")
    evaluated.prompt_format = commands.cli_prompt_format(args)
    assert evaluated.prompt(example) == trained == rollout_prompt_format(cfg.rollout).render("2+2?")
    assert commands.chat_prompt("2+2?", _NoTemplate(), commands.cli_prompt_format(args)) == trained


class _NoTemplate:
    chat_template = None
    backend = None


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{% for m in messages %}{{ m['content'] }", "line 1"),  # does not parse
        ("{{ raise_exception('this template needs a tool list') }}", "needs a tool list"),  # parses, cannot render
        ("{{ messages[5]['content'] }}", "does not render"),
    ],
)
def test_a_bad_chat_template_is_refused_in_one_line_before_any_rank(tmp_path, capsys, monkeypatch, text, needle):
    from stabledrl_mcore.cli import eval as eval_cmd
    from stabledrl_mcore.cli.app import main

    bad = _write(tmp_path, "bad.jinja", text)
    assert (
        main(["train", "--config", TINY, "rollout.prompt_style=chat", f"rollout.chat_template={bad}", "--print-config"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rollout.chat_template" in err and bad in err and needle in err, err
    monkeypatch.setattr(eval_cmd, "_eval_rank", lambda options: pytest.fail("a rank started"))
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    argv = ["eval", "--ckpt", str(ckpt), "--task", "sudoku", "--chat-template", bad, "--nproc", "2"]
    assert main([*argv, "--trust-unverified"]) == 2  # an empty stand-in checkpoint: the template is what is refused
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--chat-template" in err and needle in err, err


def test_missing_file_placeholder_and_compact_style_are_refused_by_name(tmp_path, capsys):
    from stabledrl_mcore.cli.app import main

    cases = [
        (
            ["rollout.prompt_style=chat", f"rollout.chat_template={tmp_path / 'nope.jinja'}"],
            "rollout.chat_template",
            "does not exist",
        ),
        (["rollout.prompt_style=chat", "rollout.prompt_template=Solve it"], "rollout.prompt_template", "{question}"),
        (["rollout.system_prompt=Be brief."], "rollout.system_prompt", "prompt_style=chat"),
    ]
    for overrides, field, needle in cases:
        assert main(["train", "--config", TINY, *overrides, "--print-config"]) == 2, overrides
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and field in err and needle in err, err
    assert (
        main(
            [
                "train",
                "--config",
                TINY,
                "rollout.prompt_style=chat",
                "rollout.system_prompt=Be brief.",
                "--print-config",
            ]
        )
        == 0
    )
    assert "system_prompt: Be brief." in capsys.readouterr().out  # saved with the config (and checkpoints)


def test_generate_takes_the_prompt_flags(tmp_path):
    from hf_fixtures import write_hf_checkpoint

    from stabledrl_mcore.cli.app import main
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    ckpt = write_hf_checkpoint(str(tmp_path / "llada"), "llada", seed=1)
    jinja = _write(tmp_path, "chat.jinja", "{% for m in messages %}tok3 {{ m['content'] }} {% endfor %}tok4")
    out = tmp_path / "g.jsonl"
    try:
        assert (
            main(
                [
                    "generate",
                    "--ckpt",
                    ckpt,
                    "--prompt",
                    "tok5",
                    "--gen-length",
                    "4",
                    "--no-progress",
                    "--chat-template",
                    jinja,
                    "--prompt-template",
                    "tok6 {question}",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
    finally:
        bootstrap.destroy()
        cpu_compat.disable()
    assert json.loads(out.read_text())["prompt"] == "tok3 tok6 tok5 tok4"
    assert main(["generate", "--ckpt", ckpt, "--prompt", "tok5", "--chat-template", jinja, "--no-chat-template"]) == 2


def test_eval_names_the_flags_of_a_training_checkpoints_prompts(tmp_path, capsys):
    import argparse

    from stabledrl_mcore.cli import eval as eval_cmd

    (tmp_path / "config.yaml").write_text(
        "rollout:\n  task: gsm8k\n  system_prompt: SYS\n  prompt_template: 'Q: {question}'\n  chat_template: null\n"
    )
    args = argparse.Namespace(ckpt=str(tmp_path), task="gsm8k")
    eval_cmd._note_training_prompts(args, prompt_format("SYS", "Q: {question}"))
    assert capsys.readouterr().err == ""  # the same prompts: nothing to say
    eval_cmd._note_training_prompts(args, PromptFormat())
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--system-prompt 'SYS' --prompt-template 'Q: {question}'" in err, err


def test_a_bench_rollout_mode_cannot_change_the_prompts():
    from stabledrl_mcore.bench.modes import parse_rollout_modes
    from stabledrl_mcore.common.errors import ConfigError

    for field in ("system_prompt", "prompt_template", "chat_template"):
        with pytest.raises(ConfigError, match=f"rollout.{field} is fixed"):
            parse_rollout_modes([f"m:rollout.{field}=x"])


class _CharTokenizer:
    """One id per character (ord), pad id 0: lengths and positions are readable by hand."""

    pad_token_id = 0

    def encode(self, text):
        return [ord(c) for c in text]


def test_prompts_are_left_padded_with_a_mask_of_their_own_tokens_and_cut_from_the_left():
    """The batch the rollout and eval decode from: every prompt ends at the last column (the
    completion follows it), ``valid`` marks exactly its tokens, and ``max_len`` keeps the end of a
    long prompt (where "Answer:" or the generation prompt is), not its start."""
    ids, valid = encode_prompts(_CharTokenizer(), ["ab", "wxyz", "q"])
    assert ids.tolist() == [[0, 0, 97, 98], [119, 120, 121, 122], [0, 0, 0, 113]]
    assert valid.tolist() == [[False, False, True, True], [True] * 4, [False, False, False, True]]
    ids, valid = encode_prompts(_CharTokenizer(), ["abcdef", "xy"], max_len=3)
    assert ids.tolist() == [[100, 101, 102], [0, 120, 121]]
    assert valid.tolist() == [[True, True, True], [False, True, True]]

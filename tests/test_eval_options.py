"""Issue 42, item 3: ``stabledrl eval`` and ``generate`` take train's task, data and prompt options
(``--config FILE`` and ``rollout.*`` overrides, built by ``tasks/from_config.build_task``), list every
registered task in their help, show one overall progress bar, and every hint they print names a flag
or field they accept (each followed here where it names a value)."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from stabledrl_mcore.cli.app import build_parser, main
from stabledrl_mcore.tasks.prompts import PromptFormat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
PATTERN = r"(tok\d+)"
ROWS = [  # columns named unlike qa's defaults (prompt / answer); gold is a regular expression
    {"question": "tok11 tok12", "gold": r"tok\d+"},
    {"question": "tok13", "gold": "tok1[0-9]"},
    {"question": "tok14 tok15 tok16", "gold": "never"},
]


def _options(command):
    """Every option string ``stabledrl COMMAND`` accepts (from its parser)."""
    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s for action in sub._actions for s in action.option_strings}


def _accepted_field(command, name):
    from stabledrl_mcore.cli.data_args import EVAL_FIELDS, GENERATE_FIELDS

    fields = EVAL_FIELDS if command == "eval" else GENERATE_FIELDS
    return any(name == f or name.startswith(f + ".") for f in fields)


def _check_hint(command, line):
    """Every flag the line names is one of the command's; every dotted field one it accepts, the
    field it refuses, or one labelled as train's (a message a task prints for every command)."""
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line))
    assert flags <= _options(command), (flags - _options(command), line)
    fields = r"(?<![\w./-])((?:rollout|eval|model|algo|parallel)\.[a-z_]+(?:\.[a-z_]+)?)(=\w+)?( \(\w[^)]*\))?"
    for name, _, label in re.findall(fields, line):
        accepted = _accepted_field(command, name)
        refused = line.startswith(f"stabledrl {command}: error: {name}")  # the field being refused
        trains = label in (" (training)", " (stabledrl train)")
        assert accepted or refused or trains, (name, line)


def _one_line(capsys, argv, code=2):
    assert main(argv) == code, argv
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_eval_qa_on_other_columns_with_a_chosen_verifier_takes_trains_keys(llada_hf, qa_file, tmp_path, monkeypatch):
    """The same overrides train takes score a file with columns question/gold by the regex verifier;
    each record's reward is re-derived here with Python's re from its completion."""
    monkeypatch.chdir(tmp_path)
    keys = [
        "rollout.task=qa",
        "rollout.prompt_key=question",
        "rollout.answer_key=gold",
        "rollout.task_options.verifier=regex",
        f"rollout.task_options.pattern='{PATTERN}'",
    ]
    # train takes exactly these keys (its preflight builds the task from them)
    assert main(["train", "--config", CONFIG, *keys, f"rollout.data_path={qa_file}", "--print-config"]) == 0
    sampling = ["--gen-length", "4", "--steps", "4", "--block-length", "4", "--no-progress", "--batch-size", "2"]
    assert main(["eval", "--ckpt", llada_hf, "--data-path", qa_file, *keys, *sampling, "--out", "a.jsonl"]) == 0
    records = [json.loads(line) for line in open(tmp_path / "a.jsonl")]
    assert [r["question"] for r in records] == [row["question"] for row in ROWS]
    assert [r["reference"] for r in records] == [row["gold"] for row in ROWS]
    for record, row in zip(records, ROWS):
        found = re.findall(PATTERN, record["completion"])
        want = found[-1] if found else None
        assert record["extracted"] == want
        assert record["reward"] == float(want is not None and re.fullmatch(row["gold"], want) is not None), record
    summary = json.loads((tmp_path / "a.summary.json").read_text())
    assert summary["settings"]["task_options"] == {"verifier": "regex", "pattern": PATTERN}
    assert summary["settings"]["prompt_key"] == "question" and summary["settings"]["answer_key"] == "gold"
    # the same from a config file (eval.data_path is the file evaluated on), flags still apply
    run = tmp_path / "run.yaml"
    run.write_text(
        "rollout:\n  task: qa\n  prompt_key: question\n  answer_key: gold\n"
        f"  task_options: {{verifier: regex, pattern: '{PATTERN}'}}\n"
        f"eval:\n  data_path: {qa_file}\n"
    )
    assert main(["eval", "--ckpt", llada_hf, "--config", str(run), *sampling, "--out", "b.jsonl"]) == 0
    again = [json.loads(line) for line in open(tmp_path / "b.jsonl")]
    assert [(r["completion"], r["reward"]) for r in again] == [(r["completion"], r["reward"]) for r in records]


def test_eval_help_lists_every_registered_task(capsys):
    from stabledrl_mcore.tasks import available_tasks, register_task
    from stabledrl_mcore.tasks.sudoku import SudokuTask

    @register_task("zz_help_probe")
    class _Probe(SudokuTask):
        name = "zz_help_probe"

    try:
        with pytest.raises(SystemExit):
            main(["eval", "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert all(name in out for name in available_tasks()) and "zz_help_probe" in out
    finally:
        from stabledrl_mcore.tasks.base import _REGISTRY

        _REGISTRY.pop("zz_help_probe", None)


def test_eval_progress_is_one_bar_over_the_examples(llada_hf, monkeypatch):
    """One bar for the whole evaluation, counted in examples; the samplers draw none."""
    from stabledrl_mcore import load_model
    from stabledrl_mcore.diffusion import sampling_common
    from stabledrl_mcore.evaluation import distributed
    from stabledrl_mcore.tasks import get_task
    from stabledrl_mcore.tasks.base import Example
    from stabledrl_mcore.tasks.tokenizer import load_tokenizer

    bars, sampler_bars = [], []

    class Bar:
        def __init__(self, total, desc, unit, disable, **_):
            self.total, self.desc, self.unit, self.disable, self.n = total, desc, unit, disable, 0
            bars.append(self)

        def update(self, k):
            self.n += k

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    real = sampling_common.progress_bar
    monkeypatch.setattr(distributed, "tqdm", Bar)
    monkeypatch.setattr(
        "stabledrl_mcore.diffusion.sampling_llada.progress_bar",
        lambda total, progress, desc: sampler_bars.append(progress) or real(total, False, desc),
    )
    task = get_task("qa", verifier="exact")
    examples = [Example(prompt=f"tok{10 + i}", reference="x", meta={"index": i}) for i in range(5)]
    model, tokenizer = load_model(llada_hf), load_tokenizer(llada_hf)
    sampling = dict(gen_length=4, steps=4, block_length=4)
    for n, temperature in ((1, 0.0), (2, 1.0)):
        bars.clear()
        distributed.evaluate_model(
            model, tokenizer, task, examples, micro_batch=2, progress=True, n=n, temperature=temperature, **sampling
        )
        assert len(bars) == 1 and bars[0].total == bars[0].n == 5 and bars[0].unit == "example", vars(bars[0])
        assert bars[0].desc == "eval" and not bars[0].disable
    assert sampler_bars and not any(sampler_bars)  # one sampler call per batch, none showing a bar


def test_every_hint_of_eval_names_an_option_it_takes_and_works_when_followed(llada_hf, tmp_path, capsys, monkeypatch):
    from stabledrl_mcore.cli import eval as eval_cmd

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(eval_cmd, "_eval_rank", lambda options: pytest.fail("a rank started"))
    base = ["eval", "--ckpt", llada_hf, "--no-progress"]
    csv = tmp_path / "cols.csv"
    csv.write_text("question,gold\ntok5,tok6\n")
    cases = [
        ([], "give --task"),
        (["--task", "qa", "rollout.gen_length=8"], "--gen-length"),
        (["--task", "qa", "rollout.data_path=x.jsonl"], "--data-path"),
        (["--task", "qa", "algo.eps=0.1"], "not an option of stabledrl eval"),
        (["--task", "qa", "rollout.task=qa"], "both set"),
        (["--task", "gsm9k"], "did you mean gsm8k"),
        (["--task", "qa", "--data-path", str(csv)], "rollout.prompt_key"),
        (["--task", "qa", "--data-path", str(tmp_path / "none.jsonl")], "--data-path"),
        (["--task", "qa", "rollout.task_options.verifier=regexp"], "did you mean regex"),
        (["--task", "sudoku", "--prompt-style", "compact", "--system-prompt", "S"], "--prompt-style chat"),
        (["--task", "sudoku", "--gen-length", "40"], "--block-length"),
        (["--task", "sudoku", "--gen-length", "32", "--block-length", "8", "--steps", "6"], "--steps"),
        (["--task", "sudoku", "--n", "2"], "--temperature"),
    ]
    for extra, needle in cases:
        line = _one_line(capsys, base + extra + ["--check"])
        assert needle in line, (extra, line)
        _check_hint("eval", line)
    # the shape hints name values: following the first one passes
    line = _one_line(capsys, base + ["--task", "sudoku", "--gen-length", "40", "--check"])
    assert "(the default)" in line
    block = re.search(r"e\.g\. (\d+)", line).group(1)
    assert main(base + ["--task", "sudoku", "--gen-length", "40", "--block-length", block, "--check"]) == 0
    line = _one_line(capsys, base + ["--task", "sudoku", "--gen-length", "32", "--block-length", "8", "--steps", "6"])
    steps = re.search(r"e\.g\. (\d+)", line).group(1)
    extra = ["--gen-length", "32", "--block-length", "8", "--steps", steps, "--check"]
    assert main(base + ["--task", "sudoku", *extra]) == 0
    capsys.readouterr()


def test_the_training_prompts_note_can_be_followed(llada_hf, tmp_path, capsys, monkeypatch):
    """A checkpoint trained with a system prompt and no chat template, evaluated with a template and
    no system prompt: the note's fixes, typed as printed, make the note go away."""

    from stabledrl_mcore.cli import eval as eval_cmd

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text("rollout:\n  task: gsm8k\n  system_prompt: 'Be brief: yes'\n")
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def note(argv):
        args = build_parser("eval").parse_args(["eval", "--ckpt", str(ckpt), "--task", "gsm8k", *argv])
        r = eval_cmd.eval_config(args).rollout
        eval_cmd._note_training_prompts(args, PromptFormat(r.system_prompt, r.prompt_template, r.chat_template), r.task)
        return capsys.readouterr().err.strip()

    line = note(["--chat-template", str(jinja), "--prompt-template", "Q: {question}"])
    assert len(line.splitlines()) == 1 and "note:" in line, line
    _check_hint("eval", line)
    fixes = line.split("to evaluate with them ", 1)[1].split(" (or ")[0]
    add, drop = fixes.split(" and drop ")
    assert add.startswith("pass ") and set(drop.split()) == {"--chat-template", "--prompt-template"}, fixes
    assert note(shlex.split(add[len("pass ") :])) == ""  # typed as printed (the value holds ': ')
    # the alternative it names: the training config itself
    config = shlex.split(line.split(" (or pass ", 1)[1].split(" and no")[0])
    assert config[0] == "--config" and note(config) == ""


def test_generate_takes_trains_prompt_options_and_its_hints_name_real_flags(llada_hf, tmp_path, capsys):
    from stabledrl_mcore.tasks import get_task
    from stabledrl_mcore.tasks.base import Example
    from stabledrl_mcore.tasks.tokenizer import load_tokenizer

    common = ["generate", "--ckpt", llada_hf, "--prompt", "tok5", "--gen-length", "4", "--no-progress"]
    out = tmp_path / "g.jsonl"
    # with a task named, the prompt is the one train renders for that task (its system prompt)
    assert main(common + ["rollout.task=gsm8k", "rollout.prompt_template='Q: {question}'", "--out", str(out)]) == 0
    trained = get_task("gsm8k")
    from stabledrl_mcore.tasks.prompts import prompt_format

    trained.prompt_format = prompt_format(None, "Q: {question}")
    want = trained.prompt(Example(prompt="tok5", reference=None), load_tokenizer(llada_hf))
    assert json.loads(out.read_text())["prompt"] == want and "Q: tok5" in want
    for extra, needle in (
        (["rollout.prompt_key=q"], "not an option of stabledrl generate"),
        (["rollout.gen_length=4"], "--gen-length"),
        (["rollout.prompt_style=compact", "--system-prompt", "S"], "rollout.prompt_style=chat"),
        (["--no-chat-template", "--system-prompt", "S"], "--no-chat-template"),
        (["--block-length", "6", "--gen-length", "8"], "--block-length"),
    ):
        line = _one_line(capsys, common + extra)
        assert needle in line, (extra, line)
        _check_hint("generate", line)

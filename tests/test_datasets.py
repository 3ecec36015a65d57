"""Issue 25, datasets: local JSONL / JSON / parquet / CSV / save_to_disk data with your own column
names and splits, bad rows named by file and line or row, hub names refused; the generic ``qa``
task with each verifier; GSM8K as a preset of the same loader; AIME 2024 / 2025 in their formats."""

import json
import os

import datasets
import pytest

from stabledrl_mcore.cli.app import main
from stabledrl_mcore.cli.preflight import preflight
from stabledrl_mcore.common.errors import DataError
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.tasks import get_task
from stabledrl_mcore.tasks.local_datasets import load_rows
from stabledrl_mcore.tasks.qa import choice_letter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
datasets.disable_progress_bars()  # the test files are written with datasets; keep stderr to the errors
ROWS = [{"q": "What is 2 + 3?", "a": "5", "extra": 1}, {"q": "What is 6 x 7?", "a": "42", "extra": 2}]


def _write(path, rows, fmt):
    """``rows`` at ``path`` in format ``fmt`` (``save_to_disk``: a Dataset folder)."""
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "csv":
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


FORMATS = {
    "jsonl": "train.jsonl",
    "json": "train.json",
    "parquet": "train.parquet",
    "csv": "train.csv",
    "save_to_disk": "saved",
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_with_renamed_columns_gives_the_same_examples(tmp_path, fmt):
    path = _write(tmp_path / FORMATS[fmt], ROWS, fmt)
    task = get_task("qa", prompt_key="q", answer_key="a", verifier="numeric")
    examples = task.load("train", path=path)
    assert [(e.prompt, e.reference) for e in examples] == [("What is 2 + 3?", "5"), ("What is 6 x 7?", "42")]
    assert task.reward("so \\boxed{42}", examples[1].reference) == 1.0
    with pytest.raises(DataError, match="no column|missing field"):  # the default 'prompt' column is absent
        get_task("qa").load("train", path=path)


def test_splits_from_a_folder_of_split_files_and_a_saved_dataset_dict(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    _write(folder / "train.parquet", ROWS, "parquet")
    _write(folder / "test.jsonl", ROWS[:1], "jsonl")
    task = get_task("qa", prompt_key="q", answer_key="a")
    assert len(task.load("train", path=str(folder))) == 2 and len(task.load("test", path=str(folder))) == 1
    with pytest.raises(FileNotFoundError, match="no dev.jsonl/.json/.parquet/.csv for split 'dev'.*test.jsonl"):
        task.load("dev", path=str(folder))
    saved = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(saved))
    assert [e.reference for e in task.load("test", path=str(saved))] == ["5"]
    with pytest.raises(DataError, match=rf"{saved}: no split 'dev'; its splits: train, test"):
        task.load("dev", path=str(saved))
    # the config: rollout.split picks the training split of a folder
    cfg = load_config(
        CONFIG,
        [
            "rollout.task=qa",
            f"rollout.data_path={folder}",
            "rollout.prompt_key=q",
            "rollout.answer_key=a",
            "rollout.split=test",
        ],
    )
    assert preflight(cfg).train_examples == 1


@pytest.mark.parametrize(
    "fmt, row, where, message",
    [
        ("jsonl", {"q": "fine?"}, "train.jsonl:2", "missing field(s) ['a']"),
        ("jsonl", {"q": "  ", "a": "1"}, "train.jsonl:2", "field 'q' is empty"),
        ("json", {"q": ["a", "list"], "a": "1"}, "train.json row 1", "field 'q' is a list, not a string"),
        ("parquet", {"q": "ok", "a": None}, "train.parquet row 1", "field 'a' is empty (null)"),
        ("csv", {"q": "ok", "a": ""}, "train.csv:3 (row 1)", "field 'a' is empty"),
        ("save_to_disk", {"q": "ok", "a": None}, "saved row 1", "field 'a' is empty (null)"),
    ],
)
def test_a_bad_row_is_named_by_file_and_line_or_row(tmp_path, fmt, row, where, message):
    path = _write(tmp_path / FORMATS[fmt], [ROWS[0], row], fmt)
    with pytest.raises(DataError) as err:
        get_task("qa", prompt_key="q", answer_key="a").load("train", path=path)
    assert str(err.value).startswith(f"{tmp_path / where}: ") and message in str(err.value), err.value


def _latin1_parquet(path):
    """A parquet file whose second ``q`` value holds the Latin-1 byte of 'caf\xe9' (arrow does not check)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = b"okcaf\xe9"
    offsets = pa.py_buffer(b"".join(n.to_bytes(4, "little") for n in (0, 2, len(text))))
    q = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(text)])
    pq.write_table(pa.table({"q": q, "a": ["1", "2"]}), str(path))
    return str(path)


@pytest.mark.parametrize(
    "name, content, where",
    [
        (
            "train.jsonl",
            b'{"q": "ok", "a": "1"}\n{"q": "caf\xe9", "a": "2"}\n',
            "train.jsonl:2: not valid UTF-8 (byte offset 32",
        ),
        ("train.csv", b"q,a\nok,1\ncaf\xe9,2\n", "train.csv:3: not valid UTF-8 (byte offset 12"),
        ("train.json", b'[{"q": "ok", "a": "1"},\n {"q": "caf\xe9", "a": "2"}]', "train.json:2: not valid UTF-8"),
        ("train.parquet", None, "train.parquet row 1, column 'q': not valid UTF-8"),
    ],
)
def test_bytes_that_are_not_utf8_name_the_file_and_line_and_the_fix(tmp_path, name, content, where):
    path = tmp_path / name
    _latin1_parquet(path) if content is None else path.write_bytes(content)
    with pytest.raises(DataError) as err:
        get_task("qa", prompt_key="q", answer_key="a").load("train", path=str(path))
    message = str(err.value)
    assert message.startswith(f"{tmp_path / where}") and len(message.splitlines()) == 1, message
    assert "as UTF-8" in message and "b'\\xe9'" in message, message
    cfg = load_config(
        CONFIG, ["rollout.task=qa", f"rollout.data_path={path}", "rollout.prompt_key=q", "rollout.answer_key=a"]
    )
    with pytest.raises(DataError, match="not valid UTF-8"):  # before any rank starts
        preflight(cfg)


def test_a_missing_column_names_the_columns_the_file_has(tmp_path):
    path = _write(tmp_path / "train.parquet", ROWS, "parquet")
    with pytest.raises(DataError, match=r"train.parquet: no column\(s\) \['question'\]; its columns: q, a, extra"):
        load_rows(path, required=("question", "a"))


def test_hub_names_and_urls_are_refused_before_any_rank_starts(tmp_path, capsys):
    for field, value in (("rollout.data_path", "openai/gsm8k"), ("eval.data_path", "https://x.org/t.jsonl")):
        cfg = load_config(CONFIG, ["rollout.task=qa", f"{field}={value}", "eval.every=1"])
        with pytest.raises(DataError, match=f"{field}={value}: .*only local files are read"):
            preflight(cfg)
    with pytest.raises(DataError, match="no such local file or folder, and only local files are read"):
        get_task("gsm8k").load("train", path="openai/gsm8k")


def test_gsm8k_is_a_preset_reading_any_format_and_renamed_columns(tmp_path):
    rows = [{"problem": "Tom has 3 apples and buys 4. How many?", "solution": "3 + 4 = 7\n#### 7"}]
    (tmp_path / "gsm8k").mkdir()
    _write(tmp_path / "gsm8k" / "train.parquet", rows, "parquet")  # found in the data root like train.jsonl
    task = get_task("gsm8k", data_root=str(tmp_path), prompt_key="problem", answer_key="solution")
    (example,) = task.load("train")
    assert example.reference == "7" and task.reward("\\boxed{7}", example.reference) == 1.0


def test_the_config_fields_reach_the_task_and_misfits_are_refused(tmp_path, capsys):
    path = _write(tmp_path / "train.csv", ROWS, "csv")
    cfg = load_config(
        CONFIG,
        [
            "rollout.task=qa",
            f"rollout.data_path={path}",
            "rollout.prompt_key=q",
            "rollout.answer_key=a",
            "rollout.task_options.verifier=exact",
        ],
    )
    assert preflight(cfg).train_examples == 2
    for extra, message in (
        (["rollout.prompt_key=q"], "rollout.prompt_key=q: task sudoku generates"),
        (
            ["rollout.task=qa", "rollout.task_options.verifier=numerc"],
            "unknown verifier 'numerc'; did you mean numeric?",
        ),
        (["rollout.task=qa", "rollout.reward_timeout_s=3"], "set rollout.reward_fn too"),
        (
            ["rollout.task=qa", "rollout.answer_key=a", "rollout.task_options.answer_key=b"],
            "rollout.answer_key and rollout.task_options.answer_key both set",
        ),
    ):
        assert main(["train", "--config", CONFIG, *extra, "--print-config"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


VERIFIER_CASES = {
    # verifier: (reference, right answers, wrong answers)
    "exact": ("Paris", ["Paris", " Paris "], ["paris", "Paris, France"]),
    "numeric": ("1000", ["1,000", "1000.0", "$1000"], ["999", "one thousand"]),
    "math": ("\\frac{1}{2}", ["0.5", "\\dfrac{1}{2}"], ["\\frac{1}{3}"]),
    "choice": ("(B)", ["B", "(b)", "B.", "Answer: B", "B) 42", "\\text{(B)}"], ["C", "Bob", "AB"]),
    "regex": ("(12|twelve)", ["12", "twelve"], ["120", "eleven"]),
}


@pytest.mark.parametrize("verifier", list(VERIFIER_CASES))
def test_the_generic_task_with_each_verifier(tmp_path, verifier):
    reference, right, wrong = VERIFIER_CASES[verifier]
    path = _write(tmp_path / "train.jsonl", [{"prompt": "Q?", "answer": reference}], "jsonl")
    task = get_task("qa", verifier=verifier)
    (example,) = task.load("train", path=path)
    for answer in right:
        assert task.reward(f"<answer>{answer}</answer>", example.reference) == 1.0, answer
    for answer in wrong + [None]:
        completion = "no answer given" if answer is None else f"<answer>{answer}</answer>"
        assert task.reward(completion, example.reference) == 0.0, answer


def test_verifier_references_are_checked_per_row_and_pattern_extracts(tmp_path):
    for verifier, bad in (("numeric", "many"), ("choice", "Paris"), ("regex", "(unclosed")):
        path = _write(tmp_path / f"{verifier}.jsonl", [{"prompt": "Q?", "answer": bad}], "jsonl")
        with pytest.raises(DataError, match=f"{verifier}.jsonl:1: reference .* \\(verifier {verifier}\\)"):
            get_task("qa", verifier=verifier).load("train", path=path)
    task = get_task("qa", verifier="numeric", pattern=r"Final answer:\s*(\S+)")
    assert task.reward("Final answer: 3 ... Final answer: 5", "5") == 1.0
    assert task.reward("\\boxed{5}", "5") == 0.0  # the pattern replaces boxed extraction
    assert choice_letter("I think") is None and choice_letter("d") == "D"
    with pytest.raises(ValueError, match="pattern '\\(' is not a regular expression"):
        get_task("qa", pattern="(")


def test_aime_2024_and_2025_in_their_public_formats(tmp_path):
    rows_2024 = [
        {"ID": "2024-I-1", "Problem": "Find x.", "Solution": "... so 204.", "Answer": 204},
        {"ID": "2024-I-2", "Problem": "Find y.", "Solution": "...", "Answer": 25},
    ]
    (tmp_path / "aime2024").mkdir()
    _write(tmp_path / "aime2024" / "test.parquet", rows_2024, "parquet")
    task = get_task("aime2024", data_root=str(tmp_path))
    examples = task.load("test")
    assert [e.reference for e in examples] == ["204", "25"] and examples[0].meta["ID"] == "2024-I-1"
    assert task.reward("so \\boxed{204}", "204") == 1.0 and task.reward("\\boxed{025}", "25") == 1.0
    assert task.reward("\\boxed{205}", "204") == 0.0
    path = _write(
        tmp_path / "aime2025.jsonl",
        [{"question": "Find z.", "answer": "70"}, {"question": "Find w.", "answer": "1000"}],
        "jsonl",
    )
    with pytest.raises(DataError, match=r"aime2025.jsonl:2: AIME answer must be an integer 0-999, got '1000'"):
        get_task("aime2025").load("test", path=path)
    with pytest.raises(FileNotFoundError, match="opencompass/AIME2025"):
        get_task("aime2025", data_root=str(tmp_path)).load("test")


def test_qa_and_aime_verifiers_survive_hostile_completions():
    """Model output is hostile: huge, unbalanced, nested or binary text scores in range, quickly."""
    import time

    hostile = [
        "\\boxed{" * 5000,
        "<answer>" + "(" * 3000 + "</answer>",
        "\\boxed{" + "9" * 5000 + "}",
        "<answer>" + "a" * 10000 + "!</answer>",
        "\x00\xff\\boxed{\\frac{1}{0}}",
        "Answer: " * 2000,
    ]
    tasks = [get_task("qa", verifier=v) for v in VERIFIER_CASES] + [get_task("aime2024")]
    tasks.append(get_task("qa", verifier="exact", pattern=r"Answer:\s*(\S+)"))
    for task in tasks:
        reference = VERIFIER_CASES.get(getattr(task, "verifier_name", ""), ("7",))[0]
        for completion in hostile:
            start = time.process_time()  # CPU seconds, not wall-clock: load elsewhere does not count
            assert task.reward(completion, reference) in (0.0, 1.0)
            assert time.process_time() - start < 10.0, (task, completion[:40])  # generous: ms when linear

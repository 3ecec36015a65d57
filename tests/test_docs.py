"""The docs match the code: README.md, docs/*.md and slurm/README.md (``tools/check_docs.py``).

Rules (the checker's module docstring has them in full):

- every ``stabledrl ...`` / ``-m stabledrl_mcore.cli ...`` line in a fenced shell block parses
  with the real parser; placeholders (``<dir>``, ``$RUN``, ALL-CAPS words) are fine as values;
  ``KEY=VALUE`` overrides name fields of the command's config class; ``--config FILE`` exists;
- relative links and images resolve; repo paths in inline code and code blocks exist;
- every fenced ``yaml`` block loads with ``load_config`` (partial = merged onto the defaults),
  unless the line before its fence is ``<!-- not a run config -->``;
- no file in the repository refers to the notes folder above it (``..`` + ``/shared``).

The second half plants one fault per rule in a Markdown string and checks it is reported.
"""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("check_docs", os.path.join(ROOT, "tools", "check_docs.py"))
check_docs = sys.modules.setdefault("check_docs", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(check_docs)


def fenced(body: str, lang: str = "bash", before: str = "") -> str:
    return f"{before}\n\n```{lang}\n{body}\n```\n"


def messages(findings):
    return "\n".join(str(f) for f in findings)


def test_the_docs_of_this_repository_pass():
    assert len(check_docs.doc_files(ROOT)) >= 3  # README.md, docs/*.md, slurm/README.md
    findings = check_docs.check_repository(ROOT)
    assert not findings, "docs out of step with the code:\n" + messages(findings)


# -- commands -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [
        "stabledrl train --config examples/configs/tiny_cpu.yaml algo.eps=0.1 --print-config",
        "$ PYTHONPATH=. WANDB_MODE=offline stabledrl train --config examples/configs/tiny_cpu.yaml steps=2",
        "torchrun --nproc-per-node 8 -m stabledrl_mcore.cli train --config examples/configs/llada_8b_stabledrl.yaml \\\n"
        "    model.checkpoint=<dir> logging.run_dir=$RUN --resume auto",
        "srun --ntasks 8 python -m stabledrl_mcore.cli eval --ckpt $CKPT --task gsm8k --n 16 --temperature 0.6 | tee x",
        "stabledrl eval --ckpt DIR --task NAME [--n K --k K1,K2,.. --cache none|prefix|dual] [...]",
        "stabledrl sft --config examples/sft/tiny_cpu.yaml sft.batch_size=2 && stabledrl plan --model llada-8b --tp 2",
        "stabledrl train --config examples/configs/tiny_cpu.yaml $SFT --nproc 2   # a comment",
        "stabledrl train: error: rollout.chat_template: chat.jinja: line 3 (program output, not a command)",
    ],
)
def test_good_command_lines_pass(line):
    assert check_docs.check_commands(fenced(line), "x.md", ROOT) == []


@pytest.mark.parametrize(
    "line, expected",
    [
        ("stabledrl trian --config examples/configs/tiny_cpu.yaml", "invalid choice: 'trian'"),
        (
            "stabledrl train --config examples/configs/tiny_cpu.yaml --no-such-flag",
            "unrecognized arguments: --no-such-flag",
        ),
        ("stabledrl plan --tp 2", "the following arguments are required: --model"),
        ("stabledrl eval --ckpt d --task gsm8k --cache full", "invalid choice: 'full'"),
        (
            "PYTHONPATH=. stabledrl train --config examples/configs/tiny_cpu.yaml algo.epss=0.1",
            "unknown config key algo.epss",
        ),
        ("stabledrl train algo.eps=lots", "algo.eps"),
        ("stabledrl train sft.data_path=x.jsonl", "unknown config key sft"),
        ("stabledrl sft rollout.task=gsm8k", "unknown config key rollout"),
        (
            "torchrun --nproc-per-node 8 -m stabledrl_mcore.cli train \\\n  --config examples/configs/missing.yaml",
            "--config examples/configs/missing.yaml: no such file",
        ),
        ("stabledrl train --config examples/configs/tiny_cpu.yaml algo.loss=bogus", "algo.loss"),
    ],
)
def test_bad_command_lines_are_reported(line, expected):
    findings = check_docs.check_commands("intro\n" + fenced(line), "doc.md", ROOT)
    assert len(findings) == 1 and expected in findings[0].message, messages(findings)
    assert findings[0].path == "doc.md" and findings[0].line == 5


def test_commands_outside_shell_blocks_are_not_parsed():
    assert check_docs.check_commands(fenced("stabledrl trian", "text") + "`stabledrl trian`\n", "x.md") == []


# -- links and paths --------------------------------------------------------------------------
def test_links_resolve_relative_to_the_markdown_file():
    text = (
        "See [recipes](recipes.md#llada), ![plot](img/stress_fresh_masks.png), [up](../README.md),\n"
        "[web](https://example.com/x.md), [anchor](#top), `[not](a-link.md)` and\n"
        '[gone](missing.md#x) and ![lost](img/lost.png) and <img src="img/nope.png">\n'
        "```\n[in code](also-missing.md)\n```\n[ref]: other/missing.md\n"
    )
    findings = check_docs.check_links(text, "docs/page.md", ROOT)
    assert [(f.line, f.message) for f in findings] == [
        (3, "link missing.md: no such file"),
        (3, "link img/lost.png: no such file"),
        (3, "link img/nope.png: no such file"),
        (7, "link other/missing.md: no such file"),
    ]


def test_repo_paths_in_code_must_exist():
    text = (
        "Run `tools/gpu_check.py` on `examples/configs/*.yaml`, `stabledrl_mcore/models/` and\n"
        "`tests/test_plan.py::test_flops_by_hand`; not `tools/no_such_tool.py` nor `docs/gone.md`.\n"
        "Prose paths like tools/not_checked.py are not code.\n"
        + fenced(
            "sbatch slurm/train_llada_8b.sh\nbash slurm/train_nothing.sh $ROOT/slurm/x.sh\n"
            "python -c 'x' examples/configs/none_*.yaml"
        )
    )
    findings = check_docs.check_paths(text, "README.md", ROOT)
    assert [(f.line, f.message) for f in findings] == [
        (2, "tools/no_such_tool.py: no such file"),
        (2, "docs/gone.md: no such file"),
        (8, "slurm/train_nothing.sh: no such file"),
        (9, "examples/configs/none_*.yaml: no such file"),
    ]


# -- yaml ---------------------------------------------------------------------------------------
def test_yaml_snippets_load_whole_or_partial():
    good = (
        fenced("algo:\n  eps: 0.1\nrollout:\n  group_size: 8", "yaml")
        + fenced(open(os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")).read(), "yaml")
        + fenced("sft:\n  data_path: data/train.jsonl\nsteps: 10", "yaml")
        + fenced("services:\n  trainer:\n    image: x", "yaml", check_docs.NOT_A_RUN_CONFIG)
    )
    assert check_docs.check_yaml(good, "x.md", ROOT) == []


@pytest.mark.parametrize(
    "body, expected",
    [
        ("algo:\n  epss: 0.1", "unknown config key algo.epss"),
        ("algo:\n  eps: [0.1\n", "expected ',' or ']'"),
        ("services:\n  trainer:\n    image: x", "unknown config key services"),
        ("sft:\n  batch_size: 4", "sft.data_path is required"),
        ("- a list", "top level must be a mapping"),
    ],
)
def test_bad_yaml_snippets_are_reported(body, expected):
    findings = check_docs.check_yaml("# t\n" + fenced(body, "yaml", "not the marker"), "docs/x.md", ROOT)
    assert len(findings) == 1 and expected in findings[0].message, messages(findings)
    assert findings[0].line == 5 and check_docs.NOT_A_RUN_CONFIG in findings[0].message


# -- outside the repository -------------------------------------------------------------------------
def test_references_outside_the_repository_are_reported(tmp_path):
    (tmp_path / "ok.md").write_text("see docs/models.md\n")
    (tmp_path / "bad.py").write_text("x = 1\n# see " + ".." + "/shared/notes/masks.md\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "lib.py").write_text(".." + "/shared\n")
    findings = check_docs.check_outside_references(str(tmp_path))
    assert [(f.path, f.line) for f in findings] == [("bad.py", 2)]


# -- SLURM jobs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [
        "sbatch --nodes=2 slurm/train_llada_8b.sh algo.eps=0.1 rollout.group_size=8",
        "slurm/submit.sh --nodes=8 --partition=gpu train_sdar_8b.sh algo.eps=0.1",
        "STABLEDRL_CONFIG=examples/configs/tiny_cpu.yaml slurm/submit.sh slurm/train_llada_8b.sh steps=3",
        "STABLEDRL_CKPT=<ckpt> STABLEDRL_TASK=gsm8k slurm/submit.sh slurm/eval.sh --n 16 --temperature 0.6",
        "STABLEDRL_HF_DIR=/models/LLaDA-8B-Instruct slurm/submit.sh convert.sh",
    ],
)
def test_good_slurm_jobs_pass(line):
    assert check_docs.check_commands(fenced(line), "x.md", ROOT) == []


@pytest.mark.parametrize(
    "line, expected",
    [
        ("sbatch slurm/train_llama_8b.sh", "job script slurm/train_llama_8b.sh: no such file"),
        ("slurm/submit.sh --nodes=2 train_llada_8b.sh --resume auto", "are KEY=VALUE overrides, got --resume auto"),
        ("sbatch slurm/train_sdar_8b.sh algo.epss=0.1", "unknown config key algo.epss"),
        ("STABLEDRL_CONFIG=examples/configs/gone.yaml sbatch slurm/train_sdar_8b.sh", "gone.yaml: no such file"),
        ("slurm/submit.sh eval.sh --n 16 --no-such-flag", "unrecognized arguments: --no-such-flag"),
        ("slurm/submit.sh convert.sh --tp 2", "convert.sh takes no arguments"),
    ],
)
def test_bad_slurm_jobs_are_reported(line, expected):
    findings = check_docs.check_commands(fenced(line), "slurm.md", ROOT)
    assert len(findings) == 1 and expected in findings[0].message, messages(findings)


# -- plan figures ---------------------------------------------------------------------------
PLAN = "stabledrl plan --model llada-tiny --nodes 1 --gpus-per-node 2 --micro-batch 2 --group-size 4 --seq-len 64"


def test_plan_figures_quoted_after_a_plan_command_are_what_it_prints():
    """The README quotes ``stabledrl plan``'s figures (they went stale: 30.2 GiB / LM head 0.7 quoted,
    29.6 / 0.2 printed): each one after a plan command, its output block and a run on other
    ``--nodes`` are compared with what the command prints now."""
    output = check_docs.plan_output(PLAN.split()[1:])
    figures = check_docs._plan_figures(output)
    total, head, rows, rate = figures["total"], figures["LM head"], figures["rows"], int(figures["step tokens/s"])
    assert rows == "4"  # lcm(--micro-batch 2, --group-size 4): train's preflight's count
    two = check_docs._plan_figures(check_docs.plan_output([*PLAN.split()[1:], "--nodes", "2"]))
    right = f"prints {total} GiB (LM head {head}, {rows} rows per decoding forward), {rate:,} step tokens/s"
    right += f" (2 nodes: {two['total']} GiB, {int(two['step tokens/s']):,} tokens/s).\n"
    block = fenced(PLAN) + "\n```text\n" + output + "```\n\n"
    assert check_docs.check_plan_figures(fenced(PLAN) + "\n" + right, "README.md", ROOT) == []
    assert check_docs.check_plan_figures(block + right, "README.md", ROOT) == []
    stale = right.replace(f"LM head {head}", "LM head 9.9").replace(f"prints {total}", "prints 99.9")
    stale = stale.replace(f"2 nodes: {two['total']}", "2 nodes: 88.8")
    found = messages(check_docs.check_plan_figures(fenced(PLAN) + "\n" + stale, "README.md", ROOT))
    assert "says LM head 9.9" in found and "says total 99.9" in found and "says 88.8 (total) on 2 nodes" in found
    pasted = block.replace(f"total {total} GiB", "total 99.9 GiB")
    found = messages(check_docs.check_plan_figures(pasted + right, "README.md", ROOT))
    assert f"README.md:{pasted.splitlines().index('```text') + 2}: not what stabledrl plan" in found

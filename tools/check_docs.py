"""Check the user docs against the code: commands parse, referenced files exist, configs load.

    python tools/check_docs.py                 # this checkout; one line per finding, exit 1 if any
    python tools/check_docs.py --root DIR      # the docs of another checkout (parsed by this code)

Files: README.md, docs/*.md, slurm/README.md. Rules (tests/test_docs.py runs them in CI):

- **commands**: in fenced code blocks (not yaml/json/python/text), every ``stabledrl ARGS``,
  ``python -m stabledrl_mcore.cli ARGS`` or ``torchrun/srun ... -m stabledrl_mcore.cli ARGS``
  (after ``$ `` prompts, ``VAR=value`` prefixes, ``\\`` continuations joined, up to ``|``, ``&&``,
  ``;``, ``>`` or a comment) parses with ``stabledrl_mcore.cli``'s real parser, nothing run.
  Placeholders are fine as values: ``<dir>``, anything with ``$``, ALL-CAPS words (``FILE``, ``N``),
  ``K1,K2,..``; usage synopses too: ``[--flag X]`` brackets and ``...`` are dropped and ``a|b|c``
  takes ``a``. Lines whose first word ends with ``:`` are program output (``stabledrl train: error:``,
  ``usage:``) and skipped. ``KEY=VALUE`` overrides must name fields of the command's config class
  (``RunConfig`` for train/bench/stress/eval/generate, ``SFTConfig`` for sft) and, unless a placeholder, have a
  value of the field's type; ``--config FILE`` must exist (repo-relative), and then file plus
  overrides must pass ``load_config``.
- **links**: every relative Markdown link or image ``[..](path)`` (and ``<img src=..>``), anchor
  stripped, resolves to a file or folder (relative to the Markdown file; ``/x`` = repo root).
- **paths**: in inline code and code blocks, every path under ``examples/``, ``slurm/``, ``tools/``,
  ``docs/``, ``stabledrl_mcore/`` or ``tests/`` with a file extension (or ending in ``/``) exists
  (repo-relative; ``*`` globs must match something).
- **yaml**: every fenced ``yaml``/``yml`` block loads with ``load_config`` as a whole or partial run
  config (missing fields take the defaults; a block with a top-level ``sft:`` section is an
  ``SFTConfig``), unless the line before the fence (blank lines aside) is
  ``<!-- not a run config -->`` (docker-compose, SLURM fragments, outputs).
- **plan figures**: a ``stabledrl plan`` command in a code block is run (in this process); a
  ``text`` block right after it must be its output, verbatim, and the paragraph after them may
  quote only the figures it prints now (``prints 31.5 GiB``, ``weights 7.5``, ``1,571 step tokens/s``,
  ``2 nodes: 34.3 GiB, 785 tokens/s``: :func:`check_plan_figures`).
- **outside the repository**: no file (tracked or untracked, outside ``.git``/``.venv``) refers
  to the notes folder one level above the repository (``..`` + ``/shared``).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DOC_GLOBS = ("README.md", "docs/*.md", "slurm/README.md")
NOT_A_RUN_CONFIG = "<!-- not a run config -->"
OUTSIDE_NOTES = ".." + "/shared"
NON_SHELL = {"yaml", "yml", "json", "jsonl", "python", "py", "text", "txt", "jinja", "diff", "toml"}
SEPARATORS = {"|", "||", "&&", ";", "&", ")", "<", ">", ">>", "2>", "2>&1", "&>", "|&"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the first content line
    lines: List[str]
    marker: str  # the line before the opening fence (blank lines aside)


def fenced_blocks(text: str) -> List[Block]:
    blocks, lines, i, previous = [], text.splitlines(), 0, ""
    while i < len(lines):
        opening = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not opening:
            previous = lines[i].strip() or previous
            i += 1
            continue
        fence, body, j = opening.group(1), [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j])
            j += 1
        blocks.append(Block(opening.group(2).lower(), i + 2, body, previous))
        previous, i = "", j + 1
    return blocks


def prose_lines(text: str) -> Iterator[Tuple[int, str]]:
    """``(line number, line)`` outside fenced blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        opening = re.match(r"^\s*(`{3,}|~{3,})", line)
        if opening and fence is None:
            fence = opening.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            yield number, line


def joined_lines(block: Block) -> Iterator[Tuple[int, str]]:
    """Shell lines of a block with ``\\`` continuations joined and ``$ `` prompts dropped."""
    start, parts = None, []
    for offset, line in enumerate(block.lines):
        start = block.line + offset if start is None else start
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        text = " ".join(parts + [line]).strip()
        yield start, text[2:] if text.startswith("$ ") else text
        start, parts = None, []
    if parts:
        yield start, " ".join(parts).strip()


# -- commands ------------------------------------------------------------------------
def is_placeholder(value: str) -> bool:
    return bool(
        re.search(r"\$|<[^>]*>|\.\.\.|…", value) or re.fullmatch(r"[A-Z][A-Z0-9_]*([,:][A-Z0-9_.]+)*,?\.*", value)
    )


def stabledrl_commands(line: str) -> List[List[str]]:
    """The argument lists of every ``stabledrl`` invocation on one shell line."""
    tokens = shlex.split(line, comments=True)
    if not tokens or tokens[0].endswith(":"):
        return []
    found, i = [], 0
    while i < len(tokens):
        token = tokens[i]
        if os.path.basename(token) == "stabledrl" or token.endswith("stabledrl_mcore/cli/app.py"):
            start = i + 1
        elif token == "-m" and i + 1 < len(tokens) and tokens[i + 1] == "stabledrl_mcore.cli":
            start = i + 2
        else:
            i += 1
            continue
        argv, i = [], start
        while i < len(tokens) and tokens[i] not in SEPARATORS and not re.match(r"^[12]?>", tokens[i]):
            argv.append(tokens[i])
            i += 1
        if argv and argv[-1].endswith(";"):
            argv[-1] = argv[-1][:-1]
        if not (argv and argv[0].endswith(":")):  # program output: "stabledrl train: error: ..."
            found.append(_unsynopsis(argv))
    return found


def _unsynopsis(argv: Sequence[str]) -> List[str]:
    """``[--flag X]`` -> ``--flag X``, ``a|b`` -> ``a``, ``...`` and ``"$@"`` dropped."""
    out = []
    for token in argv:
        if token.startswith("["):
            token = token.lstrip("[")
        while token.endswith("]") and token.count("]") > token.count("["):
            token = token[:-1]
        if token in ("", "...", "…", "$@", "$*"):
            continue
        out.append(token.split("|")[0])
    return [t for t in out if t]


class _AnyPlaceholder(list):
    def __contains__(self, value) -> bool:
        return is_placeholder(str(value)) or list.__contains__(self, value)


def _lenient(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Placeholder values pass every ``type`` and ``choices`` of ``parser`` and its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _lenient(sub)
            continue
        if action.type is not None and callable(action.type):
            action.type = (lambda convert: lambda v: v if is_placeholder(v) else convert(v))(action.type)
        if action.choices is not None:
            action.choices = _AnyPlaceholder(action.choices)
    return parser


def config_class(command: str):
    if command == "sft":
        from stabledrl_mcore.sft.config import SFTConfig

        return SFTConfig
    if command in ("train", "bench", "stress", "eval", "generate"):
        from stabledrl_mcore.config.schema import RunConfig

        return RunConfig
    return None


def check_command(argv: Sequence[str], root: str) -> List[str]:
    """Problems of one ``stabledrl`` argument list (empty when it parses and its config loads)."""
    import stabledrl_mcore.cli.app as cli
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.io import apply_overrides, from_dict
    from stabledrl_mcore.config.schema import load_config

    argv = [t for t in argv if t != "--debug"]
    chosen = next((a for a in argv if not a.startswith("-")), None)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = cli._parse(_lenient(cli.build_parser(chosen)), argv)
    except SystemExit as exit_:
        return [] if exit_.code == 0 else [f"does not parse: {err.getvalue().strip()}"]
    problems, cls = [], config_class(args.command)
    overrides = [
        o
        for o in getattr(args, "overrides", None) or []
        if not is_placeholder(o.split("=", 1)[0]) and not (is_placeholder(o) and "=" not in o)
    ]
    for text in overrides:
        if cls is None:
            break
        try:
            from_dict(cls, apply_overrides({}, [text]))
        except (ConfigError, TypeError, ValueError) as error:
            if "unknown config key" in str(error) or not is_placeholder(text.split("=", 1)[-1]):
                problems.append(f"override {text}: {error}")
    config = getattr(args, "config", None)
    if config and not is_placeholder(config):
        path = config if os.path.isabs(config) else os.path.join(root, config)
        if not os.path.isfile(path):
            problems.append(f"--config {config}: no such file")
        elif cls is not None and not problems and not any(is_placeholder(o) for o in overrides):
            try:
                load_config(path, overrides, cls=cls)
            except (ConfigError, TypeError, ValueError) as error:
                problems.append(f"--config {config} {' '.join(overrides)}: {error}")
    return problems


def slurm_jobs(line: str) -> List[Tuple[str, List[str], dict]]:
    """``(job script, its arguments, VAR=value settings)`` of every ``sbatch`` / ``slurm/submit.sh``
    on one shell line (the script: the first word ending in ``.sh`` after the launcher)."""
    tokens, jobs, env = shlex.split(line, comments=True), [], {}
    for i, token in enumerate(tokens):
        if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", token):
            env[token.split("=", 1)[0]] = token.split("=", 1)[1]
        if os.path.basename(token) not in ("sbatch", "submit.sh"):
            continue
        rest = tokens[i + 1 :]
        cut = next((j for j, t in enumerate(rest) if t in SEPARATORS or re.match(r"^[12]?>", t)), len(rest))
        script = next((j for j, t in enumerate(rest[:cut]) if t.endswith(".sh")), None)
        if script is not None:
            jobs.append((rest[script], _unsynopsis(rest[script + 1 : cut]), dict(env)))
    return jobs


def check_slurm_job(script: str, args: Sequence[str], env: dict, root: str) -> List[str]:
    """The job script exists (as a path or a name in slurm/); training and bench jobs take
    ``KEY=VALUE`` overrides of their recipe (or ``STABLEDRL_CONFIG``), eval.sh takes eval flags."""
    if is_placeholder(script):
        return []
    found = [p for p in (os.path.join(root, script), os.path.join(root, "slurm", script)) if os.path.isfile(p)]
    if not found:
        return [f"job script {script}: no such file (a path, or a name in slurm/)"]
    name = os.path.basename(script)
    if name == "eval.sh":
        return check_command(["eval", "--ckpt", "CKPT", "--task", "TASK", *args], root)
    recipe = re.search(r'^sdrl_(?:train|bench) "\$STABLEDRL_ROOT/([^"]+)"', open(found[0]).read(), re.M)
    if recipe is None:
        return [f"{name} takes no arguments, got {' '.join(args)}"] if args else []
    bad = [a for a in args if "=" not in a and not is_placeholder(a)]
    if bad:
        return [f"{name}: arguments after the job script are KEY=VALUE overrides, got {' '.join(bad)}"]
    command = "bench" if name.startswith("bench") else "train"
    return check_command([command, "--config", env.get("STABLEDRL_CONFIG", recipe.group(1)), *args], root)


def check_commands(text: str, path: str, root: str = ROOT) -> List[Finding]:
    findings = []
    for block in fenced_blocks(text):
        if block.lang in NON_SHELL:
            continue
        for number, line in joined_lines(block):
            if "stabledrl" not in line and "sbatch" not in line and "submit.sh" not in line:
                continue
            try:
                commands = stabledrl_commands(line)
            except ValueError as error:
                findings.append(Finding(path, number, f"cannot split {line!r}: {error}"))
                continue
            for argv in commands:
                findings += [
                    Finding(path, number, f"stabledrl {' '.join(argv)}: {p}") for p in check_command(argv, root)
                ]
            for script, args, env in slurm_jobs(line):
                findings += [
                    Finding(path, number, f"{script} {' '.join(args)}: {p}")
                    for p in check_slurm_job(script, args, env, root)
                ]
    return findings


# -- plan figures ----------------------------------------------------------------------
_PLAN_PAIRS = re.compile(r"\b(weights|gradients|optimizer|activations|LM head|rollout KV cache|overhead) (\d+\.\d)\b")
_PLAN_PROSE = {  # what the prose after a plan command quotes -> (pattern in the prose, pattern in the output)
    "total": (r"prints (\d+\.\d) GiB", r"total (\d+\.\d) GiB"),
    "transient": (r"(\d+\.\d) transient", r"\+(\d+\.\d) transient"),
    "rows": (r"(\d+) rows\s+per decoding forward", r"(\d+) rows per decoding forward"),
    "step tokens/s": (r"([\d,]+) step tokens/s", r"whole step (\d+)"),
}
_PLAN_NODES = re.compile(
    r"(?:(\d+) nodes: |`--nodes (\d+)` the planner prints )(\d+\.\d) GiB(?:,| and) ([\d,]+) (?:step )?tokens/s"
)


def plan_output(argv: Sequence[str]) -> Optional[str]:
    """What ``stabledrl ARGV`` (a ``plan``) prints, run in this process; None when it fails."""
    import stabledrl_mcore.cli.app as cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(list(argv))
    return out.getvalue() if code == 0 else None


def _plan_figures(output: str) -> dict:
    head = output.split("\n\n", 1)[0]
    figures = {name: value for name, value in _PLAN_PAIRS.findall(head)}
    for name, (_, pattern) in _PLAN_PROSE.items():
        found = re.search(pattern, head)
        figures[name] = found.group(1) if found else None
    return figures


def _with_nodes(argv: Sequence[str], nodes: str) -> List[str]:
    argv = list(argv)
    if "--nodes" in argv:
        argv[argv.index("--nodes") + 1] = nodes
        return argv
    return argv + ["--nodes", nodes]


def check_plan_figures(text: str, path: str, root: str = ROOT) -> List[Finding]:
    """A ``stabledrl plan`` command in a code block is what its figures come from: a ``text`` block
    right after it is its output, verbatim; the paragraph after them quotes its figures (``prints
    31.5 GiB``, ``weights 7.5``, ``2.3 transient``, ``16 rows per decoding forward``, ``1,571 step
    tokens/s``, and ``2 nodes: 34.3 GiB, 785 tokens/s`` / ```--nodes 2`` the planner prints ...``
    of the same command on that many nodes) as the command prints them now."""
    findings, lines, blocks = [], text.splitlines(), fenced_blocks(text)
    for index, block in enumerate(blocks):
        if block.lang in NON_SHELL:
            continue
        plans = [
            (number, argv)
            for number, line in joined_lines(block)
            if "stabledrl" in line
            for argv in stabledrl_commands(line)
            if argv and argv[0] == "plan" and not any(is_placeholder(a) for a in argv)
        ]
        if len(plans) != 1:
            continue
        number, argv = plans[0]
        output = plan_output(argv)
        if output is None:
            continue  # check_commands reports a command that does not parse
        end = block.line + len(block.lines)  # the closing fence (0-based: the line after it)
        following = blocks[index + 1] if index + 1 < len(blocks) else None
        if (
            following is not None
            and following.lang in ("text", "txt")
            and not any(line.strip() for line in lines[end : following.line - 2])
        ):
            if [line.rstrip() for line in following.lines] != [line.rstrip() for line in output.splitlines()]:
                findings.append(
                    Finding(path, following.line, f"not what stabledrl {' '.join(argv)} prints now; paste its output")
                )
            end = following.line + len(following.lines)
        paragraph, started = [], False
        for line in lines[end:]:
            if line.strip().startswith(("```", "~~~")) or (started and not line.strip()):
                break
            started = started or bool(line.strip())
            paragraph.append(line)
        prose = " ".join(" ".join(paragraph).split())
        figures, own = _plan_figures(output), _PLAN_NODES.sub("", prose)  # own: this command's figures
        quoted = [(name, value) for name, value in _PLAN_PAIRS.findall(own)]
        for name, (pattern, _) in _PLAN_PROSE.items():
            quoted += [(name, value) for value in re.findall(pattern, own)]
        for nodes_a, nodes_b, total, rate in _PLAN_NODES.findall(prose):
            other = plan_output(_with_nodes(argv, nodes_a or nodes_b))
            got = _plan_figures(other or "")
            for name, value in (("total", total), ("step tokens/s", rate)):
                if got.get(name) != value.replace(",", ""):
                    findings.append(
                        Finding(
                            path,
                            end + 1,
                            f"says {value} ({name}) on {nodes_a or nodes_b} nodes; the plan prints {got.get(name)}",
                        )
                    )
        for name, value in quoted:
            if figures.get(name) != value.replace(",", ""):
                findings.append(
                    Finding(
                        path, end + 1, f"says {name} {value}; stabledrl {' '.join(argv)} prints {figures.get(name)}"
                    )
                )
    return findings


# -- links and paths -------------------------------------------------------------------
_LINK = re.compile(
    r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*)?\)|<img[^>]*\ssrc=[\"']([^\"']+)[\"']"
    r"|^\s*\[[^\]]+\]:\s*(\S+)"
)
_REPO_PATH = re.compile(
    r"(?<![\w./*$-])((?:examples|slurm|tools|docs|stabledrl_mcore|tests)/"
    r"(?:[\w.*-]+/)*(?:[\w*-][\w.*-]*\.[A-Za-z]\w*|(?<=/)))(?![\w/*-])"
)


def check_links(text: str, path: str, root: str = ROOT) -> List[Finding]:
    findings, here = [], os.path.dirname(os.path.join(root, path))
    for number, line in prose_lines(text):
        for match in _LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = next(g for g in match.groups() if g)
            if re.match(r"^[a-zA-Z][\w+.-]*:", target) or target.startswith("#"):
                continue
            target = target.split("#")[0].split("?")[0]
            resolved = os.path.join(root, target.lstrip("/")) if target.startswith("/") else os.path.join(here, target)
            if not os.path.exists(resolved):
                findings.append(Finding(path, number, f"link {target}: no such file"))
    return findings


def _code_spans(text: str) -> Iterator[Tuple[int, str]]:
    for block in fenced_blocks(text):
        for offset, line in enumerate(block.lines):
            yield block.line + offset, line
    for number, line in prose_lines(text):
        for span in re.findall(r"`([^`]+)`", line):
            yield number, span


def check_paths(text: str, path: str, root: str = ROOT) -> List[Finding]:
    findings = []
    for number, span in _code_spans(text):
        for match in _REPO_PATH.finditer(span):
            name = match.group(1)
            full = os.path.join(root, name)
            found = (
                glob.glob(full)
                if "*" in name
                else (os.path.isdir(full) if name.endswith("/") else os.path.isfile(full))
            )
            if not found:
                findings.append(Finding(path, number, f"{name}: no such {'folder' if name.endswith('/') else 'file'}"))
    return sorted(findings, key=lambda f: f.line)


# -- yaml ------------------------------------------------------------------------------------
def check_yaml(text: str, path: str, root: str = ROOT) -> List[Finding]:
    import yaml

    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.schema import load_config

    findings = []
    for block in fenced_blocks(text):
        if block.lang not in ("yaml", "yml") or block.marker == NOT_A_RUN_CONFIG:
            continue
        body = "\n".join(block.lines) + "\n"
        with tempfile.TemporaryDirectory() as folder:
            snippet = os.path.join(folder, "snippet.yaml")
            with open(snippet, "w") as handle:
                handle.write(body)
            try:
                data = yaml.safe_load(body)
                load_config(snippet, cls=config_class("sft" if isinstance(data, dict) and "sft" in data else "train"))
            except (yaml.YAMLError, ConfigError, TypeError, ValueError) as error:
                message = " ".join(str(error).replace(snippet, "snippet").split())
                findings.append(
                    Finding(
                        path,
                        block.line,
                        f"yaml block does not load as a run config (mark it "
                        f"{NOT_A_RUN_CONFIG} if it is none): {message}",
                    )
                )
    return findings


# -- the repository ------------------------------------------------------------------------
def doc_files(root: str = ROOT) -> List[str]:
    names = []
    for pattern in DOC_GLOBS:
        names += sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern)))
    return names


def check_markdown(text: str, path: str, root: str = ROOT) -> List[Finding]:
    return (
        check_commands(text, path, root)
        + check_plan_figures(text, path, root)
        + check_links(text, path, root)
        + check_paths(text, path, root)
        + check_yaml(text, path, root)
    )


def repository_files(root: str) -> List[str]:
    """Tracked and untracked (not ignored) files; a walk without ``.git``/``.venv`` outside git."""
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-co", "--exclude-standard", "-z"],
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout
        return [name for name in out.decode().split("\0") if name and os.path.isfile(os.path.join(root, name))]
    except (OSError, subprocess.SubprocessError):
        names = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in (".git", ".venv", "__pycache__")]
            names += [os.path.relpath(os.path.join(folder, f), root) for f in files]
        return names


def check_outside_references(root: str = ROOT, names: Optional[Sequence[str]] = None) -> List[Finding]:
    findings, needle = [], OUTSIDE_NOTES.encode()
    for name in names if names is not None else repository_files(root):
        if name.split("/")[0] in (".git", ".venv"):
            continue
        with open(os.path.join(root, name), "rb") as handle:
            data = handle.read()
        for number, line in enumerate(data.splitlines(), 1):
            if needle in line:
                findings.append(Finding(name, number, f"refers to {OUTSIDE_NOTES} (outside the repository)"))
    return findings


def check_repository(root: str = ROOT) -> List[Finding]:
    findings = []
    for name in doc_files(root):
        with open(os.path.join(root, name), encoding="utf-8") as handle:
            findings += check_markdown(handle.read(), name, root)
    return findings + check_outside_references(root)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=ROOT, help="checkout whose docs to check (default: this one)")
    findings = check_repository(os.path.abspath(parser.parse_args(argv).root))
    for finding in findings:
        print(finding)
    print(f"{len(findings)} finding(s)", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())

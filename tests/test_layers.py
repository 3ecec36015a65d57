"""The package's layers, checked from its own source (imports inside functions included).

``LAYERS`` is the order, bottom up: a module may import its own package and any package below
its own, never one above. Also checked: no import circle between modules; imports inside
functions only of heavy optional packages (or an ``except ImportError`` probe); no private name
(``_x``) taken from another package; docs/architecture.md's layer table is this order, with
what each layer really imports. ``python tests/test_layers.py`` prints the table and every
violation (the same report the tests assert is empty).
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "stabledrl_mcore"

LAYERS = (
    ("common", "errors, the one Registry, version, warnings silenced before megatron-core loads"),
    ("parallel", "torch.distributed and Megatron parallel state, local multi-rank launch, Megatron on CPU"),
    ("algorithms", "policy losses, token losses, advantages, ratio noise: pure tensor functions"),
    ("tasks", "tasks, verifiers, prompts, tokenizers, a run's task and data from its config"),
    ("config", "the typed run config, YAML and dotted overrides, every cross-field check"),
    ("models", "LLaDA / SDAR on Megatron-Core: presets, specs, attention, masks, MoE, KV cache"),
    ("diffusion", "forward process, mask plans, likelihood estimators, samplers, SFT loss"),
    ("checkpoint", "Megatron-side formats: model-only checkpoints, training state, optimizer state, integrity"),
    ("convert", "HF <-> Megatron conversion: mapping tables and their engine, safetensors, load_model, LoRA exports"),
    (
        "engine",
        "the runtime RL, SFT and bench share: model/optimizer set-up, seeding, gradients, "
        "pipeline and expert lockstep, run directory, resume, saves, pre-emption, health, logger",
    ),
    ("evaluation", "distributed generate + score, pass@k"),
    ("rl", "StableDRL: set-up, rollout, estimates, update, dynamic sampling, metrics, the loop"),
    ("sft", "masked-diffusion SFT: data, set-up, the loop"),
    ("bench", "throughput, MFU, baseline, weak scaling, the memory/throughput planner"),
    ("experiments", "the demo and the stability experiment on the tiny Sudoku setting"),
    ("cli", "one module per `stabledrl` command, and the preflight"),
)
"""Bottom up. The package's own ``__init__.py`` and the ``demo.py`` entry point stand above all."""

HEAVY_OPTIONAL = (
    "megatron",
    "transformer_engine",
    "transformers",
    "wandb",
    "matplotlib",
    "datasets",
    "torch.utils.tensorboard",
    "torch.nn.attention.flex_attention",
    "math_verify",
    "sentencepiece",
    "pyarrow",
    "flash_attn",
    "apex",
    "pynvml",
)
"""Packages a function may import when it needs them: slow to import (megatron-core, transformers,
matplotlib, flex attention's compiler) or used by one optional path only."""

DYNAMIC_IMPORTS = {
    f"{PACKAGE}",
    f"{PACKAGE}.cli",
    f"{PACKAGE}.cli.app",
    f"{PACKAGE}.common.errors",
    f"{PACKAGE}.tasks.custom_reward",
    f"{PACKAGE}.models",
    f"{PACKAGE}.sft",
    f"{PACKAGE}.bench.check_parts",
}
"""Modules allowed to call ``importlib.import_module``: the package facade (``load_model`` on first
use), the console script's entry (``cli.main`` imports ``cli.app`` under its Ctrl-C guard), the command
dispatcher (only the chosen command's module is loaded), the user's reward function
(``rollout.reward_fn=package.module:fn``), the error table (an
exception class named by another rank), and the ``models`` and ``sft`` package APIs, whose names built
on megatron-core load on first use (their own submodules only), so the presets, configs and checks
that ``--print-config`` runs import without it; and the device check's part runner, whose child process
imports the part named in its registry (``bench/check_parts.py``, ``module:function``)."""

MARKER_BEGIN, MARKER_END = "<!-- layers:begin (tests/test_layers.py) -->", "<!-- layers:end -->"


@dataclass
class Module:
    name: str
    path: str
    is_package: bool
    imports: List[Tuple[str, int, bool]] = field(default_factory=list)  # (target module, line, in function)
    problems: List[str] = field(default_factory=list)


def _modules(src_root: str, package: str) -> Dict[str, Module]:
    found = {}
    base = os.path.join(src_root, package)
    for folder, _, files in os.walk(base):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, src_root)[:-3].replace(os.sep, ".")
                is_package = name == "__init__.py"
                dotted = dotted[: -len(".__init__")] if is_package else dotted
                found[dotted] = Module(dotted, path, is_package)
    return found


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.name.split(".")
    if not module.is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _project_target(name: str, modules: Dict[str, Module]) -> Optional[str]:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _heavy(name: str) -> bool:
    return any(name == h or name.startswith(h + ".") for h in HEAVY_OPTIONAL)


def _import_probe(stack: Sequence[ast.AST]) -> bool:
    """Inside ``try: ... except ImportError`` (or ModuleNotFoundError)."""
    for node in stack:
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                text = ast.unparse(handler.type) if handler.type is not None else ""
                if "ImportError" in text or "ModuleNotFoundError" in text:
                    return True
    return False


def _scan(module: Module, modules: Dict[str, Module], package: str) -> None:
    tree = ast.parse(open(module.path, encoding="utf-8").read(), module.path)
    own = module.name.split(".")[1] if "." in module.name else ""
    module_aliases: Dict[str, str] = {}  # name bound to a project module -> that module

    def visit(node: ast.AST, stack: List[ast.AST]) -> None:
        in_function = any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for s in stack)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            pairs = []  # (external or project name, imported attribute or None)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    pairs.append((alias.name, None))
                    if alias.name.startswith(package + ".") and alias.asname:
                        module_aliases[alias.asname] = alias.name
            else:
                base = _resolve(module, node)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    pairs.append((full if full in modules else base, alias.name))
                    if full in modules:
                        module_aliases[alias.asname or alias.name] = full
            for name, attribute in pairs:
                project = name == package or name.startswith(package + ".")
                if in_function and not (not project and (_heavy(name) or _import_probe(stack))):
                    module.problems.append(
                        f"{module.name}:{node.lineno}: import inside a function: "
                        f"{ast.unparse(node)} (move it to the module's top)"
                    )
                if not project:
                    continue
                target = _project_target(name, modules)
                if target is None:
                    module.problems.append(f"{module.name}:{node.lineno}: imports {name}, which does not exist")
                    continue
                module.imports.append((target, node.lineno, in_function))
                their = target.split(".")[1] if "." in target else ""
                if attribute and attribute.startswith("_") and not attribute.startswith("__") and their != own:
                    module.problems.append(
                        f"{module.name}:{node.lineno}: private name {attribute} taken from "
                        f"{target} (another package): make it public or move it"
                    )
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = module_aliases.get(node.value.id)
            attr = node.attr
            if target and attr.startswith("_") and not attr.startswith("__"):
                their = target.split(".")[1] if "." in target else ""
                if their != own:
                    module.problems.append(
                        f"{module.name}:{node.lineno}: private name {attr} used from {target} (another package)"
                    )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and module.name not in DYNAMIC_IMPORTS
        ):
            module.problems.append(
                f"{module.name}:{node.lineno}: importlib.import_module hides a dependency "
                f"(import at the top, or add the module to DYNAMIC_IMPORTS with a reason)"
            )
        for child in ast.iter_child_nodes(node):
            visit(child, stack + [node])

    visit(tree, [])


def _layer_of(name: str, package: str, order: Dict[str, int]) -> Optional[int]:
    parts = name.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in order):
        return len(order)  # the package facade and top-level entry points
    return order.get(parts[1])


def _cycles(modules: Dict[str, Module]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted({t for t, _, _ in mod.imports if t != m}) for m, mod in modules.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


@dataclass
class Report:
    modules: Dict[str, Module]
    problems: List[str]
    cycles: List[List[str]]
    layer_imports: Dict[str, Set[str]]

    @property
    def ok(self) -> bool:
        return not self.problems and not self.cycles


def check(src_root: str = ROOT, package: str = PACKAGE, layers: Sequence[str] = tuple(n for n, _ in LAYERS)) -> Report:
    """Every layer rule over ``src_root/package``; the report's ``problems`` say file, line and fix."""
    order = {name: i for i, name in enumerate(layers)}
    modules = _modules(src_root, package)
    problems: List[str] = []
    layer_imports: Dict[str, Set[str]] = defaultdict(set)
    for name in sorted(modules):
        module = modules[name]
        _scan(module, modules, package)
        problems += module.problems
        mine = _layer_of(name, package, order)
        parts = name.split(".")
        if len(parts) > 1 and mine is None:
            problems.append(
                f"{name}: package {parts[1]} is in no layer: add it to LAYERS in tests/test_layers.py "
                f"and to docs/architecture.md"
            )
            continue
        for target, line, _ in module.imports:
            theirs = _layer_of(target, package, order)
            tparts = target.split(".")
            if len(tparts) == 1 and target != name:
                problems.append(f"{name}:{line}: imports the package facade {package} (import the module itself)")
                continue
            if mine is None or theirs is None or mine == len(order):
                continue
            if tparts[1] == parts[1]:
                continue
            layer_imports[parts[1]].add(tparts[1])
            if theirs >= mine:
                problems.append(
                    f"{name}:{line}: {layers[mine]} imports {target} ({layers[theirs]}, "
                    f"{'the same layer' if theirs == mine else 'a higher layer'}): "
                    f"move the code down or the import up"
                )
    return Report(modules, problems, _cycles(modules), layer_imports)


def layer_table(report: Report) -> str:
    """docs/architecture.md's table: each layer, what it holds, which layers it imports."""
    rows = ["| layer | holds | imports from the project |", "| --- | --- | --- |"]
    for name, holds in reversed(LAYERS):
        used = [n for n, _ in LAYERS if n in report.layer_imports.get(name, ())]
        rows.append(f"| `{name}/` | {holds} | {', '.join(f'`{u}`' for u in used) or 'nothing'} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def report() -> Report:
    return check()


def test_every_import_points_down_a_layer(report):
    assert report.problems == []


def test_no_import_circle_remains(report):
    assert report.cycles == []


def test_every_folder_of_the_package_is_a_layer():
    folders = {
        d
        for d in os.listdir(os.path.join(ROOT, PACKAGE))
        if os.path.isfile(os.path.join(ROOT, PACKAGE, d, "__init__.py"))
    }
    assert folders == {name for name, _ in LAYERS}
    top_files = sorted(f for f in os.listdir(os.path.join(ROOT, PACKAGE)) if f.endswith(".py"))
    assert top_files == ["__init__.py", "demo.py"]  # everything else lives in a layer


def test_architecture_doc_shows_this_order_and_the_real_imports(report):
    text = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()
    assert MARKER_BEGIN in text and MARKER_END in text, "docs/architecture.md lost its layer table markers"
    shown = text.split(MARKER_BEGIN, 1)[1].split(MARKER_END, 1)[0].strip()
    assert shown == layer_table(report), "regenerate it: python tests/test_layers.py --table"


def _write(root, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _toy(tmp_path, files: Optional[Dict[str, str]] = None) -> Report:
    """A two-layer package ``toy`` (``low`` under ``high``) plus ``files`` (path -> source)."""
    for rel in ("toy/__init__.py", "toy/low/__init__.py", "toy/high/__init__.py"):
        _write(tmp_path, rel)
    _write(tmp_path, "toy/low/base.py", "def helper():\n    return 1\n\ndef _hidden():\n    return 2\n")
    _write(tmp_path, "toy/high/top.py", "from toy.low.base import helper\n")
    for rel, text in (files or {}).items():
        _write(tmp_path, rel, text)
    return check(str(tmp_path), "toy", ("low", "high"))


def test_the_checker_passes_a_clean_tree(tmp_path):
    result = _toy(tmp_path)
    assert result.ok, result.problems


def test_the_checker_fails_on_a_planted_upward_import(tmp_path):
    result = _toy(tmp_path, {"toy/low/bad.py": "from toy.high.top import helper\n"})
    assert [p for p in result.problems if "low imports toy.high.top (high, a higher layer)" in p]


def test_the_checker_fails_on_an_upward_import_hidden_in_a_function(tmp_path):
    result = _toy(tmp_path, {"toy/low/bad.py": "def f():\n    from toy.high import top\n    return top\n"})
    assert any("import inside a function" in p for p in result.problems)
    assert any("a higher layer" in p for p in result.problems)


def test_the_checker_allows_heavy_optional_packages_and_probes_in_functions(tmp_path):
    source = (
        "def f():\n    import megatron.core\n    try:\n        import jinja2\n    except ImportError:\n"
        "        jinja2 = None\n    return megatron, jinja2\n"
    )
    assert _toy(tmp_path, {"toy/low/lazy.py": source}).ok
    assert not _toy(tmp_path, {"toy/low/lazy.py": "def f():\n    import json\n    return json\n"}).ok


def test_the_checker_fails_on_a_private_name_from_another_package(tmp_path):
    imported = _toy(tmp_path, {"toy/high/peek.py": "from toy.low.base import _hidden\n"})
    assert any("private name _hidden" in p for p in imported.problems)
    used = _toy(tmp_path, {"toy/high/peek.py": "from toy.low import base\nx = base._hidden()\n"})
    assert any("private name _hidden used" in p for p in used.problems)


def test_the_checker_finds_an_import_circle(tmp_path):
    result = _toy(tmp_path, {"toy/low/a.py": "from toy.low import b\n", "toy/low/b.py": "from toy.low import a\n"})
    assert result.cycles == [["toy.low.a", "toy.low.b"]]


def test_the_checker_refuses_a_folder_in_no_layer_and_the_facade(tmp_path):
    result = _toy(
        tmp_path,
        {"toy/extra/__init__.py": "", "toy/extra/x.py": "", "toy/high/facade.py": "from toy import something\n"},
    )
    assert any("package extra is in no layer" in p for p in result.problems)
    assert any("imports the package facade toy" in p for p in result.problems)


if __name__ == "__main__":  # pragma: no cover - the report for people
    result = check()
    if "--table" in sys.argv:
        print(layer_table(result))
        raise SystemExit(0)
    print(layer_table(result))
    print(f"\n{len(result.modules)} modules; import circles: {result.cycles or 'none'}")
    print("\n".join(result.problems) or "no layer violation")
    raise SystemExit(0 if result.ok else 1)

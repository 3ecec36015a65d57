"""The wheels ``tools/gpu_check.py`` needs on a bare GPU box that already has a CUDA torch.

A lent GPU box typically has Python, a CUDA build of torch (with numpy) and no network: no
megatron-core, nothing of this project installed. This tool downloads, here, the few wheels the
device check imports beyond torch and numpy (the list is :data:`BUNDLE`, pinned), for the box's
Python and platform, checks they fit in what one call may carry (64 MiB), and prints the two
commands to run there:

    python tools/device_bundle.py --python 3.12 --out build/device_bundle
    python tools/device_bundle.py --list            # the pinned list only, nothing downloaded

On the box, from the repository root (nothing of the project installed, only the wheels)::

    python3 -m pip install --no-index --no-deps --target /tmp/site build/device_bundle/*.whl
    PYTHONPATH=/tmp/site:. python3 tools/gpu_check.py --json gpu_check.json

Every ``*.whl`` in ``--out`` that is not one of the bundle's is deleted, so that the install
glob takes exactly these. Exit status: 0 done; 1 the bundle is over the size limit; 2 pip failed
(one line says why: no registry reachable, or no such wheel for that Python/platform).
``tests/test_device_bundle.py`` checks :data:`BUNDLE` against the imports of the check's modules
(:func:`third_party_imports`, computed from the source with ``ast``).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "stabledrl_mcore"
CHECK_MODULE = "stabledrl_mcore.bench.device_check"
LIMIT_MIB = 64.0
"""What one device call may carry (the working tree and carried paths together)."""
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


class Wheel(NamedTuple):
    dist: str
    version: str
    module: str
    """Its top-level import name."""
    pure: bool
    """A ``py3-none-any`` wheel: downloaded without platform flags."""
    why: str
    needed_by: str = ""
    """Another bundle entry that imports it (when the project itself does not)."""


BUNDLE: Tuple[Wheel, ...] = (
    Wheel("megatron-core", "0.16.1", "megatron", False, "the models' layers, parallel state, checkpoints"),
    Wheel("packaging", "26.4", "packaging", True, "megatron-core's own import", needed_by="megatron-core"),
    Wheel("pyyaml", "6.0.4", "yaml", False, "the run configs"),
    Wheel("safetensors", "0.8.0", "safetensors", False, "convert.safetensors_io"),
    Wheel("psutil", "7.2.2", "psutil", False, "parallel.launch (and Megatron's checkpoint writer)"),
    Wheel("tqdm", "4.70.1", "tqdm", True, "progress bars (engine.metrics, diffusion sampling)"),
    Wheel("sentencepiece", "0.2.3", "sentencepiece", False, "the tiny tasks' tokenizer (train and bench checks)"),
)
"""The pinned wheels, one list. megatron-core is setup.py's pin (the test checks it)."""

NUMPY = Wheel("numpy", "2.4.6", "numpy", False, "for a box whose torch came without numpy (--with-numpy)")

PROVIDED = (
    "torch",
    "numpy",
    *("jinja2", "markupsafe", "typing_extensions", "sympy", "filelock", "networkx", "fsspec", "setuptools"),
)
"""Top-level imports a CUDA-torch box has already: torch, numpy, and torch's own requirements
(setuptools: ``torch.utils.cpp_extension``, which megatron-core imports)."""

OPTIONAL = {
    "transformer_engine": "te_vs_local is skipped without it (a box's own install is used)",
    "transformers": "HF tokenizers of real checkpoints; the check's tiny tasks use sentencepiece",
    "wandb": "logging.wandb=true only",
    "datasets": "fetching a task's data set; the check's tasks make their own",
    "pyarrow": "with datasets",
    "math_verify": "the math tasks' answer check; not the check's tasks",
}
"""Imported inside functions of the check's modules, on paths the check does not take: left out."""

_NETWORK = re.compile(
    r"NewConnectionError|Failed to establish|Max retries exceeded|Temporary failure in name resolution|"
    r"Name or service not known|Connection refused|ConnectTimeout|ReadTimeout|timed out|SSLError|ProxyError|"
    r"Network is unreachable|No route to host|Could not fetch URL"
)


# -- the check's imports, from its source ---------------------------------------------------------


@dataclass(frozen=True)
class ImportSite:
    module: str
    """The external module imported (``megatron.core.enums``)."""
    where: str
    """The project module that imports it, with the line."""
    top_level: bool
    """At module level and not inside a ``try: ... except ImportError`` probe: needed to import."""


def _module_path(root: str, name: str) -> Tuple[Optional[str], bool]:
    base = os.path.join(root, *name.split("."))
    if os.path.isfile(os.path.join(base, "__init__.py")):
        return os.path.join(base, "__init__.py"), True
    if os.path.isfile(base + ".py"):
        return base + ".py", False
    return None, False


def _probe(node: ast.Try) -> bool:
    for handler in node.handlers:
        text = ast.unparse(handler.type) if handler.type is not None else ""
        if "ImportError" in text or "ModuleNotFoundError" in text:
            return True
    return False


def import_sites(start: str = CHECK_MODULE, root: str = ROOT, package: str = PACKAGE) -> List[ImportSite]:
    """Every import of a module outside ``package`` in the closure of ``start``: the project
    modules it imports at module level, transitively (with each one's parent packages), read from
    the source. Imports inside functions and ``except ImportError`` probes are listed too, marked
    ``top_level=False``; only module-level imports widen the closure."""
    sites: List[ImportSite] = []
    seen: Set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        path, is_package = _module_path(root, name)
        if path is None:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)

        def visit(node: ast.AST, in_function: bool, in_probe: bool) -> None:
            for child in ast.iter_child_nodes(node):
                function = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                probe = in_probe or (isinstance(child, ast.Try) and _probe(child))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    targets: List[Tuple[str, List[str]]] = []
                    if isinstance(child, ast.Import):
                        targets = [(alias.name, []) for alias in child.names]
                    else:
                        base = child.module or ""
                        if child.level:
                            anchor = parts if is_package else parts[:-1]
                            anchor = anchor[: len(anchor) - (child.level - 1)]
                            base = ".".join(anchor + ([child.module] if child.module else []))
                        targets = [(base, [alias.name for alias in child.names])]
                    for target, attributes in targets:
                        top = target.split(".")[0]
                        if top == package:
                            if not function:
                                todo.append(target)
                                todo.extend(f"{target}.{a}" for a in attributes)
                        elif top != "__future__":
                            where = f"{name}:{child.lineno}"
                            sites.append(ImportSite(target, where, not function and not probe))
                visit(child, function, probe)

        visit(tree, False, False)
    return sites


def third_party(sites: Sequence[ImportSite]) -> Dict[str, List[ImportSite]]:
    """The sites by top-level module, standard library left out."""
    out: Dict[str, List[ImportSite]] = {}
    for site in sites:
        top = site.module.split(".")[0]
        if top not in sys.stdlib_module_names:
            out.setdefault(top, []).append(site)
    return out


def third_party_imports(start: str = CHECK_MODULE, root: str = ROOT, package: str = PACKAGE) -> Set[str]:
    """Top-level third-party modules that importing ``start`` imports (module level, no probe)."""
    return {top for top, s in third_party(import_sites(start, root, package)).items() if any(x.top_level for x in s)}


def missing_from_bundle(start: str = CHECK_MODULE, root: str = ROOT, package: str = PACKAGE) -> Set[str]:
    """What importing ``start`` needs that neither the box (:data:`PROVIDED`) nor :data:`BUNDLE` has."""
    return third_party_imports(start, root, package) - set(PROVIDED) - {w.module for w in BUNDLE}


def unclassified(start: str = CHECK_MODULE, root: str = ROOT, package: str = PACKAGE) -> Set[str]:
    """Third-party modules imported anywhere in the check's modules (inside functions too) that are
    in none of :data:`PROVIDED`, :data:`BUNDLE` and :data:`OPTIONAL`: each needs a decision."""
    found = set(third_party(import_sites(start, root, package)))
    return found - set(PROVIDED) - {w.module for w in BUNDLE} - set(OPTIONAL)


# -- the download ---------------------------------------------------------------------------------


def _fail(message: str) -> None:
    print(f"device_bundle: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def _wheel_file(out: str, wheel: Wheel) -> Optional[str]:
    prefix = f"{_normalize(wheel.dist)}-{wheel.version}-"
    for name in sorted(os.listdir(out)):
        if name.endswith(".whl") and name.lower().startswith(prefix):
            return os.path.join(out, name)
    return None


def _pip_download(wheels: Sequence[Wheel], args: argparse.Namespace, platforms: Sequence[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", args.python, "--implementation", "cp", "--retries", "1", "--timeout", "20"]
    for platform in platforms:
        cmd += ["--platform", platform]
    cmd += ["-d", args.out] + [f"{w.dist}=={w.version}" for w in wheels]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return
    text = proc.stdout + proc.stderr
    names = ", ".join(f"{w.dist}=={w.version}" for w in wheels)
    if _NETWORK.search(text):
        first = next((line.strip() for line in text.splitlines() if _NETWORK.search(line)), "")
        _fail(f"pip could not reach a package registry for {names} (run this where PyPI is reachable): {first[:200]}")
    last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "pip failed")
    where = f"Python {args.python}" + (f", {' / '.join(platforms)}" if platforms else "")
    _fail(f"pip download of {names} failed ({where}): {last[:200]}")


def _mib(size: int) -> float:
    return size / 2**20


def _install_commands(out: str) -> List[str]:
    rel = os.path.relpath(os.path.abspath(out), ROOT)
    shown = rel if not rel.startswith("..") else os.path.abspath(out)
    return [
        f"python3 -m pip install --no-index --no-deps --target /tmp/site {shown}/*.whl",
        "PYTHONPATH=/tmp/site:. python3 tools/gpu_check.py --json gpu_check.json",
    ]


def build(args: argparse.Namespace) -> int:
    wheels = list(BUNDLE) + ([NUMPY] if args.with_numpy else [])
    platforms = args.platform or list(DEFAULT_PLATFORMS)
    os.makedirs(args.out, exist_ok=True)
    pure = [w for w in wheels if w.pure]
    binary = [w for w in wheels if not w.pure]
    if pure:
        _pip_download(pure, args, [])
    if binary:
        _pip_download(binary, args, platforms)
    files = {}
    for wheel in wheels:
        path = _wheel_file(args.out, wheel)
        if path is None:
            _fail(f"pip reported success but no wheel of {wheel.dist}=={wheel.version} is in {args.out}")
        files[wheel] = path
    keep = set(files.values())
    for name in sorted(os.listdir(args.out)):
        path = os.path.join(args.out, name)
        if name.endswith(".whl") and path not in keep:
            os.remove(path)
            print(f"removed {path} (not in the bundle)")
    total = 0
    width = max(len(os.path.basename(p)) for p in keep)
    print(f"{'wheel':<{width}} {'MiB':>7}")
    for wheel in wheels:
        size = os.path.getsize(files[wheel])
        total += size
        print(f"{os.path.basename(files[wheel]):<{width}} {_mib(size):7.2f}")
    print(f"{'total (' + str(len(wheels)) + ' wheels)':<{width}} {_mib(total):7.2f}")
    if _mib(total) >= args.limit_mib:
        print(
            f"device_bundle: error: the bundle is {_mib(total):.2f} MiB, not under the {args.limit_mib:g} MiB "
            "one device call may carry",
            file=sys.stderr,
        )
        return 1
    has = "a CUDA torch" + ("" if args.with_numpy else " and numpy")
    print(f"\nOn the box (Python {args.python}, {has} installed), from the repository root:")
    for line in _install_commands(args.out):
        print(f"    {line}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/device_bundle.py",
        description="Download the wheels tools/gpu_check.py needs beyond torch and numpy, for a bare GPU "
        "box (no network), and print the commands to install them there and run the check.",
        epilog="Pinned: " + ", ".join(f"{w.dist}=={w.version}" for w in BUNDLE),
    )
    parser.add_argument("--python", metavar="X.Y", help="the box's Python version, e.g. 3.12 (required to download)")
    parser.add_argument("--out", default="build/device_bundle", help="wheel folder (default build/device_bundle)")
    parser.add_argument(
        "--platform",
        action="append",
        metavar="TAG",
        help=f"platform tag for compiled wheels, repeatable (default: {' '.join(DEFAULT_PLATFORMS)})",
    )
    parser.add_argument("--with-numpy", action="store_true", help=f"also numpy=={NUMPY.version} (a box without it)")
    parser.add_argument("--limit-mib", type=float, default=LIMIT_MIB, help=f"size limit (default {LIMIT_MIB:g})")
    parser.add_argument("--list", action="store_true", help="print the pinned wheels and exit, nothing downloaded")
    args = parser.parse_args(argv)
    if args.list:
        for wheel in list(BUNDLE) + ([NUMPY] if args.with_numpy else []):
            kind = "pure" if wheel.pure else "binary"
            print(f"{wheel.dist}=={wheel.version}  import {wheel.module}  {kind}  # {wheel.why}")
        return 0
    if not args.python:
        parser.error("--python X.Y (the box's Python version) is required to download")
    if not re.fullmatch(r"3\.\d+", args.python):
        parser.error(f"--python {args.python}: expected X.Y, e.g. 3.12")
    return build(args)


if __name__ == "__main__":
    sys.exit(main())

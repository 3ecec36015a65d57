"""``tools/device_bundle.py``: its pinned wheels are what the device check imports beyond torch and
numpy, and setup.py's torch range is a range that holds the version the suite runs on. No network."""

import ast
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "device_bundle.py")


def _load_tool():
    spec = importlib.util.spec_from_file_location("device_bundle", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bundle = _load_tool()


def _install_requires():
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return {Requirement(r).name: Requirement(r) for r in ast.literal_eval(node.value)}
    raise AssertionError("setup.py has no install_requires")


def test_check_imports_nothing_beyond_torch_numpy_and_the_bundle():
    needed = bundle.third_party_imports()
    assert {"torch", "numpy", "megatron", "yaml"} <= needed, needed  # the closure was really walked
    sites = bundle.third_party(bundle.import_sites())
    missing = {m: [s.where for s in sites[m] if s.top_level][:3] for m in bundle.missing_from_bundle()}
    assert not missing, f"imported by the device check's modules, in neither PROVIDED nor BUNDLE: {missing}"
    loose = {m: [s.where for s in sites[m]][:3] for m in bundle.unclassified()}
    assert not loose, f"imported inside the check's modules: add each to BUNDLE or OPTIONAL (with why): {loose}"
    assert set(bundle.OPTIONAL) <= set(sites), set(bundle.OPTIONAL) - set(sites)  # no stale entry
    assert not set(bundle.OPTIONAL) & {w.module for w in bundle.BUNDLE}


def test_every_bundle_wheel_is_needed():
    sites = bundle.third_party(bundle.import_sites())
    dists = {w.dist: w for w in bundle.BUNDLE}
    for wheel in bundle.BUNDLE:
        if wheel.needed_by:
            assert wheel.needed_by in dists, wheel
            requires = importlib.metadata.requires(wheel.needed_by) or []
            names = {Requirement(r).name for r in requires if "extra ==" not in r}
            assert wheel.dist in names, f"{wheel.needed_by} does not require {wheel.dist}: {sorted(names)}"
        else:
            assert wheel.module in sites, f"{wheel.dist}: nothing in the check's modules imports {wheel.module}"
    assert len(dists) == len(bundle.BUNDLE)
    assert not {w.module for w in bundle.BUNDLE} & set(bundle.PROVIDED)


def test_bundle_pins_match_setup_py_and_the_import_names():
    requires = _install_requires()
    megatron = next(w for w in bundle.BUNDLE if w.dist == "megatron-core")
    assert str(requires["megatron-core"].specifier) == f"=={megatron.version}"
    for wheel in bundle.BUNDLE:
        if wheel.dist in requires:  # the pin is one the project accepts
            assert Version(wheel.version) in requires[wheel.dist].specifier, (wheel, requires[wheel.dist])


def test_a_new_third_party_import_in_the_closure_is_caught(tmp_path):
    pkg = tmp_path / "stabledrl_mcore"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "bench" / "__init__.py").write_text("from stabledrl_mcore.bench import helper\n")
    (pkg / "bench" / "helper.py").write_text(
        "import torch\nimport wandb\n"
        "try:\n    import flash_attn\nexcept ImportError:\n    flash_attn = None\n"
        "def f():\n    import matplotlib\n"
    )
    (pkg / "bench" / "device_check.py").write_text("import os\nfrom . import helper\nimport megatron.core\n")
    assert bundle.third_party_imports(root=str(tmp_path)) == {"torch", "wandb", "megatron"}
    assert bundle.missing_from_bundle(root=str(tmp_path)) == {"wandb"}
    assert bundle.unclassified(root=str(tmp_path)) == {"flash_attn", "matplotlib"}
    sites = bundle.third_party(bundle.import_sites(root=str(tmp_path)))
    assert {"flash_attn", "matplotlib"} <= set(sites) and not any(s.top_level for s in sites["matplotlib"])


def test_setup_py_torch_is_a_range_holding_the_tested_versions():
    torch = _install_requires()["torch"]
    spec = torch.specifier
    assert not any(s.operator in ("==", "===") for s in spec), f"torch is pinned exactly: {torch}"
    assert Version("2.13.0") in spec and Version("2.11.0") in spec, torch
    assert Version("2.10.0") not in spec, torch  # not claimed: the lowest tested is 2.11.0


def _run(*args, env=None):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def test_help_and_list_need_no_network():
    proc = _run("--help")
    assert proc.returncode == 0 and "--python" in proc.stdout and "--list" in proc.stdout, proc.stderr
    proc = _run("--list")
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines()]
    assert listed == [f"{w.dist}=={w.version}" for w in bundle.BUNDLE]
    proc = _run("--list", "--with-numpy")
    assert proc.stdout.splitlines()[-1].startswith(f"numpy=={bundle.NUMPY.version}")


def test_download_needs_the_box_python():
    proc = _run("--out", "/nonexistent")
    assert proc.returncode == 2 and "--python" in proc.stderr


def test_unreachable_registry_is_one_line(tmp_path):
    env = dict(os.environ)
    for key in list(env):
        if key.startswith("PIP_"):
            del env[key]
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_NO_INPUT="1")
    proc = _run("--python", "3.12", "--out", str(tmp_path / "wheels"), env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert "could not reach a package registry" in lines[0], lines
    assert not list((tmp_path / "wheels").glob("*.whl"))


@pytest.mark.parametrize("mib, rc", [(1, 0), (10, 1)])
def test_sizes_limit_and_install_commands(tmp_path, monkeypatch, capsys, mib, rc):
    out = tmp_path / "wheels"
    out.mkdir()
    (out / "stale-1.0-py3-none-any.whl").write_bytes(b"x")
    calls = []

    def fake_download(wheels, args, platforms):  # what pip would save, without a network
        calls.append(([w.dist for w in wheels], list(platforms)))
        for w in wheels:
            tag = "py3-none-any" if w.pure else f"cp312-cp312-{platforms[0]}"
            name = f"{bundle._normalize(w.dist)}-{w.version}-{tag}.whl"
            (out / name).write_bytes(b"\0" * (mib * 2**20))

    monkeypatch.setattr(bundle, "_pip_download", fake_download)
    assert bundle.main(["--python", "3.12", "--out", str(out)]) == rc
    text = capsys.readouterr()
    pure = [w.dist for w in bundle.BUNDLE if w.pure]
    assert calls == [(pure, []), ([w.dist for w in bundle.BUNDLE if not w.pure], list(bundle.DEFAULT_PLATFORMS))]
    assert not (out / "stale-1.0-py3-none-any.whl").exists()
    total = next(line for line in text.out.splitlines() if line.startswith("total ("))
    assert total.endswith(f"{len(bundle.BUNDLE) * mib:7.2f}"), total
    if rc:
        assert "not under the 64 MiB" in text.err
    else:
        assert f"--target /tmp/site {out}/*.whl" in text.out
        assert "PYTHONPATH=/tmp/site:. python3 tools/gpu_check.py --json gpu_check.json" in text.out

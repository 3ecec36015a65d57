"""``stabledrl train --print-config`` / ``sft --print-config`` check a config without the model stack:
after them no Megatron-Core, no transformers, and no part of ``torch.distributed`` beyond what
``import torch`` and torch's distributed-checkpoint reader (``.metadata`` of checkpoints,
``checkpoint/trust.py``) load, each in a fresh interpreter (issue #42 item 5). Speed is measured,
not asserted (docs/contributing.md)."""

import json
import os
import subprocess
import sys

import pytest
from hf_fixtures import write_hf_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "examples", "configs", "tiny_cpu.yaml")
SFT_CONFIG = os.path.join(ROOT, "examples", "sft", "tiny_cpu.yaml")
MODEL_STACK = ("megatron", "transformers", "transformer_engine")

_LOADED = """
import json, sys
from stabledrl_mcore.cli.app import main
status = main(sys.argv[1:])
import torch
print(json.dumps({"status": status, "modules": sorted(sys.modules), "initialized": torch.distributed.is_initialized()}))
"""


def _python(code, *argv, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def torch_own_distributed(tmp_path_factory):
    """The ``torch.distributed`` modules that ``import torch`` and the checkpoint reader load by themselves."""
    code = "import json, sys, torch, torch.distributed.checkpoint; print(json.dumps(sorted(sys.modules)))"
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {m for m in json.loads(proc.stdout) if m.startswith("torch.distributed")}


@pytest.fixture(scope="module")
def hf_llada(tmp_path_factory):
    return write_hf_checkpoint(str(tmp_path_factory.mktemp("hf") / "llada"), "llada")


@pytest.mark.parametrize("case", ["train", "train-hf-checkpoint", "sft"])
def test_print_config_imports_no_model_stack(case, tmp_path, hf_llada, torch_own_distributed):
    run_dir = f"logging.run_dir={tmp_path / 'run'}"
    argv = {
        "train": ["train", "--config", CONFIG, run_dir],
        "train-hf-checkpoint": ["train", "--config", CONFIG, run_dir, f"model.checkpoint={hf_llada}", "--nproc", "2"],
        "sft": ["sft", "--config", SFT_CONFIG, run_dir, f"sft.data_path={ROOT}/examples/sft/reverse.jsonl"],
    }[case]
    got = _python(_LOADED, *argv, "--print-config", cwd=str(tmp_path))
    assert got["status"] == 0
    modules = set(got["modules"])
    assert "stabledrl_mcore.cli.preflight" in modules  # the checks ran in this interpreter
    stack = sorted(m for m in modules if m.split(".")[0] in MODEL_STACK)
    assert not stack, f"--print-config imported the model stack: {stack[:10]}"
    extra = sorted(m for m in modules if m.startswith("torch.distributed") and m not in torch_own_distributed)
    assert not extra, f"--print-config imported torch.distributed beyond torch's own: {extra[:10]}"
    assert not got["initialized"]


def test_the_package_apis_still_give_their_megatron_names():
    """``models`` and ``sft`` load their Megatron-Core names on first use; every name of ``__all__`` resolves."""
    code = (
        "import json, sys\nimport stabledrl_mcore.models as m, stabledrl_mcore.sft as s\n"
        "before = 'megatron' in sys.modules\n"
        "names = {p.__name__: [n for n in p.__all__ if getattr(p, n, None) is None] for p in (m, s)}\n"
        "from stabledrl_mcore.models import build_model, DLLMModel\n"
        "from stabledrl_mcore.models.model import build_model as real\n"
        "print(json.dumps({'before': before, 'missing': names, 'same': build_model is real, "
        "'after': 'megatron' in sys.modules}))"
    )
    got = _python(code, cwd=ROOT)
    assert got == {
        "before": False,
        "missing": {"stabledrl_mcore.models": [], "stabledrl_mcore.sft": []},
        "same": True,
        "after": True,
    }

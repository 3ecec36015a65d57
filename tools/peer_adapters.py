"""Peer code for ``tools/bench_peers.py``: loading the peers' own files, CPU stand-ins, model dirs.

Nothing of the peers is vendored: each loader imports the released files from the clone it is
given (``--fast-dllm`` NVlabs/Fast-dLLM, ``--llada`` ML-GSAI/LLaDA, ``--sdar`` JetAstra/SDAR) under
a private module name, so their three ``generate.py`` files do not collide. Where a file imports a
CUDA-only package that is not installed (SDAR: ``flash_attn``; its triton training-loss module), a
stand-in is put in ``sys.modules`` only while that file is imported, and :data:`STAND_INS` names it
for the report. The random models are written in the upstream Hugging Face layout by
``tests/hf_fixtures.py`` (imported by path) and converted with our converter's CLI.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
STAND_INS: List[str] = []
"""What the peers run on instead of their CUDA-only imports (for the report)."""


class PeerError(RuntimeError):
    """A peer directory is missing or lacks a file it should hold (one-line message)."""


def _need(flag: str, path, rel: str, what: str) -> Path:
    if path is None:
        raise PeerError(f"{flag} DIR is required ({what})")
    base = Path(path)
    if not base.is_dir():
        raise PeerError(f"{flag} {path}: no such directory ({what})")
    if not (base / rel).is_file():
        raise PeerError(f"{flag} {path}: {rel} not found; is it a clone of {what}?")
    return base / rel


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with _peer_import(path):
        spec.loader.exec_module(module)
    return module


@contextmanager
def _peer_import(path):
    """A peer file that does not import here fails with one line naming it and transformers."""
    try:
        yield
    except ImportError as err:
        import transformers

        raise PeerError(
            f"importing {path} failed on transformers {transformers.__version__} ({err}); the "
            "peers need einops and the transformers they were written for (4.53): see the docstring of "
            "tools/bench_peers.py for the side environment"
        ) from None


def git_commit(path) -> str:
    try:
        git = ["git", "-C", str(path)]
        head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            git + ["status", "--porcelain", "--untracked-files=no", "--", "."], capture_output=True, text=True
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        marker = Path(path) / "PEER_COMMIT"  # a plain export can name its commit here
        return marker.read_text().strip() if marker.is_file() else "unknown"


# ------------------------------------------------------------------ stand-ins
def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


def _rms_norm_fn(x, weight, bias=None, residual=None, eps=1e-6, **_):
    """flash_attn.ops.triton.layer_norm.rms_norm_fn: fp32 statistics, output in x's dtype."""
    if residual is not None:
        raise NotImplementedError("stand-in rms_norm_fn: residual is not used by SDAR")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def _flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_):
    """flash_attn_func on ``[B, L, H, D]`` (GQA as flash-attn does it) through torch SDPA."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        dropout_p=dropout_p,
        is_causal=causal,
        scale=softmax_scale,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


def _unsupported(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"CPU stand-in: {name} is not provided (training-only path)")

    return fn


def _flash_attn_modules() -> Dict[str, types.ModuleType]:
    ln = _module("flash_attn.ops.triton.layer_norm", rms_norm_fn=_rms_norm_fn)
    pad = _module(
        "flash_attn.bert_padding",
        index_first_axis=_unsupported("index_first_axis"),
        pad_input=_unsupported("pad_input"),
        unpad_input=_unsupported("unpad_input"),
    )
    root = _module(
        "flash_attn",
        flash_attn_func=_flash_attn_func,
        bert_padding=pad,
        flash_attn_varlen_func=_unsupported("flash_attn_varlen_func"),
    )
    ops = _module("flash_attn.ops")
    triton_pkg = _module("flash_attn.ops.triton", layer_norm=ln)
    root.ops, ops.triton = ops, triton_pkg
    return {m.__name__: m for m in (root, pad, ops, triton_pkg, ln)}


STAND_IN_NOTES = {
    "flash_attn": "flash_attn (flash_attn_func -> torch SDPA with enable_gqa; "
    "ops.triton.layer_norm.rms_norm_fn -> fp32 torch RMSNorm)",
    "sdar_peer_model.fused_linear_diffusion_cross_entropy": "SDAR's fused_linear_diffusion_cross_entropy (triton training loss; import-only stub, never called)",
}


class _TrainingLossStub:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("CPU stand-in: SDAR's fused triton loss is training-only")


def _loss_modules() -> Dict[str, types.ModuleType]:
    name = "sdar_peer_model.fused_linear_diffusion_cross_entropy"
    return {name: _module(name, FusedLinearDiffusionCrossEntropyLoss=_TrainingLossStub)}


@contextmanager
def stand_ins(*names: str):
    """Put stand-ins for the named modules in ``sys.modules`` (``flash_attn`` only if it is not
    installed) while the block runs; afterwards they are removed again, so torch and transformers
    never see them. No ``triton`` stub: torch caches whether triton exists."""
    added = {}
    for name in names:
        if name == "flash_attn" and importlib.util.find_spec(name) is not None:
            continue
        added.update(_flash_attn_modules() if name == "flash_attn" else _loss_modules())
        note = STAND_IN_NOTES[name]
        if note not in STAND_INS:
            STAND_INS.append(note)
    sys.modules.update(added)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


# ------------------------------------------------------------------ peers
def load_fast_dllm(path) -> types.SimpleNamespace:
    """Fast-dLLM's ``llada/generate.py`` (its samplers) and ``llada/model`` (its LLaDA model)."""
    gen = _need("--fast-dllm", path, "llada/generate.py", "NVlabs/Fast-dLLM")
    _need("--fast-dllm", path, "llada/model/modeling_llada.py", "NVlabs/Fast-dLLM")
    llada_dir = str(gen.parent)
    if llada_dir not in sys.path:
        sys.path.insert(0, llada_dir)  # generate.py imports `model.modeling_llada`
    module = _load_file("fast_dllm_generate", gen)
    return types.SimpleNamespace(
        module=module,
        model_cls=module.LLaDAModelLM,
        commit=git_commit(path),
        generate=module.generate,
        prefix=module.generate_with_prefix_cache,
        dual=module.generate_with_dual_cache,
    )


def load_llada(path) -> types.SimpleNamespace:
    """ML-GSAI/LLaDA's ``generate.py`` (the repo ships no modeling file: its model is the HF remote
    code of GSAI-ML/LLaDA-8B-*; Fast-dLLM's ``modeling_llada.py`` is that file plus its cache)."""
    gen = _need("--llada", path, "generate.py", "ML-GSAI/LLaDA")
    module = _load_file("llada_generate", gen)
    return types.SimpleNamespace(module=module, generate=module.generate, commit=git_commit(path))


def _sdar_model_dir(path) -> Path:
    _need("--sdar", path, "generate.py", "JetAstra/SDAR")
    found = sorted(Path(path).glob("training/model/*/modeling_sdar.py"))
    if not found:
        raise PeerError(f"--sdar {path}: no training/model/*/modeling_sdar.py; is it a clone of JetAstra/SDAR?")
    return found[-1].parent  # SDAR-8B-Chat (the 4B copy is the same file)


def greedy_sample(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Stand-in for SDAR's ``sample_with_temperature_topk_topp`` at temperature 0: (argmax, its
    probability). Theirs divides by the temperature and draws with ``torch.multinomial``."""
    probs = torch.softmax(logits.float(), -1)
    tok = logits.argmax(-1)
    return tok, probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def load_sdar(path, greedy: bool = True) -> types.SimpleNamespace:
    """SDAR's ``generate.py`` (``block_diffusion_generate``) and its ``modeling_sdar.py``."""
    model_dir = _sdar_model_dir(path)
    package = _module("sdar_peer_model")
    package.__path__ = [str(model_dir)]
    sys.modules["sdar_peer_model"] = package
    with stand_ins("flash_attn", "sdar_peer_model.fused_linear_diffusion_cross_entropy"):
        with _peer_import(model_dir / "modeling_sdar.py"):
            modeling = importlib.import_module("sdar_peer_model.modeling_sdar")
    module = _load_file("sdar_generate", Path(path) / "generate.py")
    if greedy:
        module.sample_with_temperature_topk_topp = greedy_sample
        note = "SDAR generate.sample_with_temperature_topk_topp -> greedy argmax (theirs cannot run temperature 0)"
        if note not in STAND_INS:
            STAND_INS.append(note)
    return types.SimpleNamespace(
        module=module,
        generate=module.block_diffusion_generate,
        model_cls=modeling.SDARForCausalLM,
        model_dir=str(model_dir),
        commit=git_commit(path),
    )


# ------------------------------------------------------------------ checkpoints
def _fixtures():
    if "bench_hf_fixtures" in sys.modules:
        return sys.modules["bench_hf_fixtures"]
    return _load_file("bench_hf_fixtures", ROOT / "tests" / "hf_fixtures.py")


def upstream_overrides(arch: str, cfg) -> dict:
    """Config keys of the upstream ``config.json`` for one of our :class:`DLLMConfig` shapes."""
    if arch == "llada":
        return dict(
            d_model=cfg.hidden_size,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_query_groups,
            n_layers=cfg.num_layers,
            mlp_hidden_size=cfg.ffn_hidden_size,
            vocab_size=cfg.vocab_size,
            embedding_size=cfg.vocab_size,
            mask_token_id=cfg.mask_token_id,
            eos_token_id=cfg.eos_token_id,
            pad_token_id=cfg.pad_token_id,
            max_sequence_length=cfg.max_position_embeddings,
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.norm_eps,
        )
    return dict(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        num_hidden_layers=cfg.num_layers,
        max_window_layers=cfg.num_layers,
        intermediate_size=cfg.ffn_hidden_size,
        vocab_size=cfg.vocab_size,
        mask_token_id=cfg.mask_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        block_size=cfg.block_size,
    )


def peer_config_extras(model_dir: str, arch: str) -> dict:
    """Keys of the peer's own ``config.json`` that the fixture's config lacks (SDAR's training copy
    reads ``fuse_cross_entropy`` and friends), shape keys excluded."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return {}
    base = _fixtures().upstream_config(arch)
    return {k: v for k, v in json.load(open(path)).items() if k not in base and k != "attn_implementation"}


def build_checkpoints(
    arch: str, cfg, work: str, model_arg: str, seed: int = 0, fresh: bool = False, extra: Optional[dict] = None
) -> tuple:
    """``(hf_dir, mcore_dir)``: a random upstream-format model and our conversion of it
    (``stabledrl convert hf-to-mcore --verify``); an existing pair of the same config is reused."""
    work = os.path.abspath(work)
    hf_dir, out = os.path.join(work, f"{arch}-hf"), os.path.join(work, f"{arch}-mcore")
    overrides = {**(extra or {}), **upstream_overrides(arch, cfg)}
    stamp = json.dumps({"overrides": overrides, "seed": seed, "model": model_arg}, sort_keys=True)
    stamp_file = os.path.join(work, f"{arch}.stamp")
    if (
        not fresh
        and os.path.isfile(stamp_file)
        and open(stamp_file).read() == stamp
        and os.path.isfile(os.path.join(out, "stabledrl_model.json"))
    ):
        return hf_dir, out
    import shutil

    for d in (hf_dir, out):
        shutil.rmtree(d, ignore_errors=True)
    _fixtures().write_hf_checkpoint(hf_dir, arch, seed=seed, config_overrides=overrides)
    env = dict(os.environ)
    import stabledrl_mcore

    env["PYTHONPATH"] = os.pathsep.join([str(Path(stabledrl_mcore.__file__).parents[1]), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "stabledrl_mcore.cli",
        "convert",
        "hf-to-mcore",
        "--model",
        model_arg,
        "--hf-dir",
        hf_dir,
        "--out",
        out,
        "--verify",
        "--no-progress",
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work)  # not a cwd holding another copy
    if run.returncode:
        raise PeerError(f"conversion failed ({' '.join(cmd)}): {run.stderr.strip().splitlines()[-1:]}")
    verify = [line for line in run.stdout.splitlines() if line.startswith("verify:")]
    with open(stamp_file, "w") as handle:
        handle.write(stamp)
    with open(os.path.join(work, f"{arch}.verify"), "w") as handle:
        handle.write("\n".join(verify))
    return hf_dir, out


def convert_log(work: str, arch: str) -> str:
    path = os.path.join(work, f"{arch}.verify")
    return open(path).read().strip() if os.path.isfile(path) else ""


def peer_model(cls, hf_dir: str):
    """The peer's own class on the upstream directory, fp32, eval."""
    kwargs = {"torch_dtype": torch.float32}
    if "SDAR" in cls.__name__:
        kwargs["attn_implementation"] = "sdpa"
    model = cls.from_pretrained(hf_dir, **kwargs)
    return model.float().eval()

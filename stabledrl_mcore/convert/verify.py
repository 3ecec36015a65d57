"""``--verify``: logits of an independent reference vs. the converted model.

The reference never touches the mapping tables. By default it is a public
``transformers`` class fed the upstream tensors under its own names
(each shown to reproduce the upstream modeling code exactly):

- LLaDA == ``LlamaForCausalLM`` with an explicit all-zero additive 4-D mask
  (without a mask Llama would be causal; LLaDA is bidirectional);
- SDAR == ``Qwen3ForCausalLM`` with the additive block-causal inference mask
  (0 where allowed, dtype-min where blocked);
- SDAR-MoE == ``Qwen3MoeForCausalLM`` with the same mask, loaded with transformers' own
  ``from_pretrained`` (which turns the per-expert checkpoint tensors into its in-memory layout).

``reference="remote"`` runs the upstream modeling code instead
(``trust_remote_code=True``): the ``*.py`` files of the directory, or the files given as
``remote_code`` (``mcore-to-hf --verify --remote-code PATH/modeling_llada.py``: an exported
directory loaded with the upstream code under the installed transformers). It needs a matching
transformers (LLaDA's file loads with transformers 4.x, <= 4.57; under transformers 5 its
``LLaDAModelLM`` never calls ``post_init()``, so ``from_pretrained`` fails on
``all_tied_weights_keys``; SDAR's with <= 4.53.3 and ``flash_attn``), otherwise it fails with a
one-line :class:`ConversionError` naming the version. Both models run in fp32.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Optional, Sequence

import torch

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.convert import hf_config as hfc
from stabledrl_mcore.convert.loader import load_model, read_config
from stabledrl_mcore.convert.safetensors_io import SafetensorsReader
from stabledrl_mcore.models import DLLMConfig, block_causal_mask

# LLaDA (OLMo names) -> LlamaForCausalLM names; SDAR already uses Qwen3's.
LLADA_TO_LLAMA = [
    (r"model\.transformer\.wte\.", "model.embed_tokens."),
    (r"model\.transformer\.ln_f\.", "model.norm."),
    (r"model\.transformer\.ff_out\.", "lm_head."),
    (r"model\.transformer\.blocks\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"model\.transformer\.blocks\.(\d+)\.ff_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"model\.transformer\.blocks\.(\d+)\.([qkv])_proj\.", r"model.layers.\1.self_attn.\2_proj."),
    (r"model\.transformer\.blocks\.(\d+)\.attn_out\.", r"model.layers.\1.self_attn.o_proj."),
    (r"model\.transformer\.blocks\.(\d+)\.ff_proj\.", r"model.layers.\1.mlp.gate_proj."),
    (r"model\.transformer\.blocks\.(\d+)\.up_proj\.", r"model.layers.\1.mlp.up_proj."),
    (r"model\.transformer\.blocks\.(\d+)\.ff_out\.", r"model.layers.\1.mlp.down_proj."),
]


def _rename(name: str) -> str:
    for pattern, repl in LLADA_TO_LLAMA:
        new, n = re.subn("^" + pattern, repl, name)
        if n:
            return new
    raise ConversionError(f"no Llama name for LLaDA tensor {name!r}")


def public_reference(hf_dir: str) -> torch.nn.Module:
    """``LlamaForCausalLM`` (LLaDA) / ``Qwen3ForCausalLM`` (SDAR) / ``Qwen3MoeForCausalLM``
    (SDAR-MoE) holding the upstream weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    raw = hfc.read_hf_config(hf_dir)
    cfg = hfc.hf_to_dllm_config(raw, source_dir=hf_dir)
    tied = hfc.is_tied(raw, cfg.arch)
    common = hfc.transformers_shape(cfg, tied=tied)
    if cfg.is_moe:
        return _moe_reference(hf_dir, cfg, common)
    if cfg.arch == "llada":
        model = LlamaForCausalLM(LlamaConfig(mlp_bias=False, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(use_sliding_window=False, **common))
    reader = SafetensorsReader(hf_dir)
    state = {}
    for name in reader.keys():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        state[_rename(name) if cfg.arch == "llada" else name] = reader.get(name).float()
    if tied and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def _moe_reference(hf_dir: str, cfg: DLLMConfig, common: dict) -> torch.nn.Module:
    """``Qwen3MoeForCausalLM`` (every layer sparse, no router losses) on the upstream tensors."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **common,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_router_topk,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        norm_topk_prob=cfg.moe_norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
        router_aux_loss_coef=0.0,
    )
    loaded, info = Qwen3MoeForCausalLM.from_pretrained(
        hf_dir, config=config, dtype=torch.float32, output_loading_info=True
    )
    wrong = {
        k: sorted(v)[:5] for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
    }
    if wrong:
        raise ConversionError(f"{hf_dir}: Qwen3MoeForCausalLM does not fit the tensors: {wrong}")
    # from_pretrained leaves the non-persistent RoPE buffers unset once torch.distributed runs on
    # the CPU with parallel.cpu_compat (the converter's process): rebuild that module directly.
    loaded.model.rotary_emb = type(loaded.model.rotary_emb)(config=config)
    return loaded.float().eval()


REMOTE_NEEDS = {"llada": "4.x (up to 4.57)", "sdar": "<= 4.53.3 with flash_attn"}
"""The transformers versions whose API the upstream remote code was written against."""


def remote_reference(hf_dir: str, remote_code: Sequence[str] = ()) -> torch.nn.Module:
    """The upstream modeling code (opt-in; needs ``trust_remote_code`` and a matching transformers):
    the ``*.py`` files of ``hf_dir``, or ``remote_code`` (a ``modeling_*.py`` file and, when it sits
    beside it, its ``configuration_*.py``) put beside ``hf_dir``'s files in a scratch directory
    (``hf_dir`` itself is left as it is)."""
    import transformers

    raw = hfc.read_hf_config(hf_dir)
    arch = hfc.detect_arch(raw)
    with tempfile.TemporaryDirectory(prefix="stabledrl-remote-code-") as scratch:
        source = _with_remote_code(hf_dir, raw, remote_code, scratch) if remote_code else hf_dir
        transformers.utils.logging.disable_progress_bar()  # its weight-loading bar: one line per failure
        try:
            cls = transformers.AutoModel if arch == "llada" else transformers.AutoModelForCausalLM
            model = cls.from_pretrained(source, trust_remote_code=True)  # fp32 below, on any version
        except Exception as err:  # noqa: BLE001 - any failure of foreign code becomes one clear message
            where = ", ".join(remote_code) if remote_code else hf_dir
            raise ConversionError(remote_load_failure(arch, where, transformers.__version__, err)) from None
    return model.float().eval()


def remote_load_failure(arch: str, where: str, version: str, err: BaseException) -> str:
    """One line: what failed, on which transformers, and the versions the upstream code needs."""
    text = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    need = REMOTE_NEEDS.get(arch, "the release its config.json names")
    if "all_tied_weights_keys" in text:
        cause = (
            f"the upstream {arch} code predates transformers 5 (its model class never calls post_init(), "
            f"which sets all_tied_weights_keys since transformers 5.0), so it loads with transformers {need} only"
        )
    else:
        cause = f"it needs transformers {need}"
    return (
        f"--reference remote could not load the upstream {arch} code ({where}) with trust_remote_code=True on "
        f"transformers {version} ({text}); {cause}: install one (pip install 'transformers>=4.53,<5') "
        f"to verify with it, or use --reference public instead."
    )


def _with_remote_code(hf_dir: str, raw: dict, remote_code: Sequence[str], scratch: str) -> str:
    """``scratch`` holding links to ``hf_dir``'s files and copies of the ``remote_code`` files, which
    must include every module ``config.json``'s ``auto_map`` names."""
    files = {}
    for path in remote_code:
        if not (path.endswith(".py") and os.path.isfile(path)):
            raise ConversionError(f"--remote-code {path}: not a Python file (give the upstream modeling_*.py)")
        files[os.path.basename(path)] = path
        name = os.path.basename(path)
        if name.startswith("modeling_"):  # its relative import of the configuration beside it
            config_file = os.path.join(os.path.dirname(path), "configuration_" + name[len("modeling_") :])
            if os.path.isfile(config_file):
                files.setdefault(os.path.basename(config_file), config_file)
    auto_map = raw.get("auto_map") or {}
    if not auto_map:
        raise ConversionError(
            f"--remote-code: {hf_dir}/config.json has no auto_map, so transformers would not run the "
            f"given code (export with the upstream config.json: --hf-assets DIR)"
        )
    needed = sorted({str(target).split("--")[-1].rsplit(".", 1)[0] + ".py" for target in auto_map.values()})
    missing = [name for name in needed if name not in files and not os.path.isfile(os.path.join(hf_dir, name))]
    if missing or not any(name in files for name in needed):
        raise ConversionError(
            f"--remote-code {', '.join(remote_code)}: {hf_dir}/config.json's auto_map loads "
            f"{', '.join(needed)}; give those files"
        )
    for name in os.listdir(hf_dir):
        if name not in files:
            os.symlink(os.path.abspath(os.path.join(hf_dir, name)), os.path.join(scratch, name))
    for name, path in files.items():
        shutil.copyfile(path, os.path.join(scratch, name))
    return scratch


def reference_logits(model: torch.nn.Module, cfg: DLLMConfig, ids: torch.Tensor, remote: bool = False) -> torch.Tensor:
    """Logits with the model's inference attention as an additive 4-D float mask
    (upstream LLaDA code takes no mask: it is bidirectional by construction)."""
    b, s = ids.shape
    if remote and cfg.arch == "llada":
        with torch.no_grad():
            return model(input_ids=ids).logits.float()
    if cfg.arch == "sdar":
        blocked = block_causal_mask(s, cfg.block_size)
    else:
        blocked = torch.zeros(1, 1, s, s, dtype=torch.bool)
    mask = torch.zeros(b, 1, s, s).masked_fill(blocked.expand(b, 1, s, s), torch.finfo(torch.float32).min)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()


def verify(
    hf_dir: str,
    ckpt: str,
    *,
    reference: str = "public",
    seq_len: int = 16,
    batch: int = 2,
    seed: int = 0,
    ours: Optional[torch.nn.Module] = None,
    remote_code: Sequence[str] = (),
    trust_unverified: bool = False,
) -> float:
    """Max abs logit difference between the reference (on ``hf_dir``) and
    :func:`load_model` (on ``ckpt``, an HF directory or a converted checkpoint; ``trust_unverified``
    as there); ``remote_code`` (with ``reference="remote"``): the upstream modeling files to run on
    ``hf_dir``."""

    cfg = read_config(hf_dir)
    ours = ours if ours is not None else load_model(ckpt, dtype=torch.float32, trust_unverified=trust_unverified)
    ref = remote_reference(hf_dir, remote_code) if reference == "remote" else public_reference(hf_dir)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    want = reference_logits(ref, cfg, ids, remote=reference == "remote")
    with torch.no_grad():
        got = ours(ids).float()
    if got.shape != want.shape:
        raise ConversionError(f"logit shapes differ: converted {list(got.shape)}, reference {list(want.shape)}")
    return (got - want).abs().max().item()

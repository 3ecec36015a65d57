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
(``trust_remote_code=True``); it needs a matching transformers (LLaDA's file
loads with <= 4.57, SDAR's with <= 4.53.3 and ``flash_attn``), otherwise it
fails with a :class:`ConversionError` saying so. Both models run in fp32.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from stabledrl_mcore.checkpoint import hf_config as hfc
from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.checkpoint.loader import load_model, read_config
from stabledrl_mcore.checkpoint.safetensors_io import SafetensorsReader
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


def remote_reference(hf_dir: str) -> torch.nn.Module:
    """The upstream modeling code (opt-in; needs ``trust_remote_code`` and a matching transformers)."""
    import transformers

    arch = hfc.detect_arch(hfc.read_hf_config(hf_dir))
    need = "<= 4.57" if arch == "llada" else "<= 4.53.3 and flash_attn"
    try:
        cls = transformers.AutoModel if arch == "llada" else transformers.AutoModelForCausalLM
        model = cls.from_pretrained(hf_dir, trust_remote_code=True, torch_dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - any failure of foreign code becomes one clear message
        raise ConversionError(
            f"--reference remote could not load the upstream {arch} code from {hf_dir} with "
            f"trust_remote_code=True on transformers {transformers.__version__} ({type(err).__name__}: "
            f"{str(err)[:300]}); it needs transformers {need}. Use --reference public instead."
        ) from None
    return model.float().eval()


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
) -> float:
    """Max abs logit difference between the reference (on ``hf_dir``) and
    :func:`load_model` (on ``ckpt``, an HF directory or a converted checkpoint)."""

    cfg = read_config(hf_dir)
    ours = ours if ours is not None else load_model(ckpt, dtype=torch.float32)
    ref = remote_reference(hf_dir) if reference == "remote" else public_reference(hf_dir)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    want = reference_logits(ref, cfg, ids, remote=reference == "remote")
    with torch.no_grad():
        got = ours(ids).float()
    if got.shape != want.shape:
        raise ConversionError(f"logit shapes differ: converted {list(got.shape)}, reference {list(want.shape)}")
    return (got - want).abs().max().item()

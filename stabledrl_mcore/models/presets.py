"""Backbone configuration (:class:`DLLMConfig`), named presets, and the Megatron translation.

Two architectures are supported, both pre-norm decoder stacks with SwiGLU MLPs,
RMSNorm, rotate-half RoPE, no biases and an untied LM head:

- ``llada`` -- LLaDA (GSAI-ML/LLaDA-8B): multi-head attention, fully
  bidirectional; the logits at position ``i`` predict token ``i`` (no shift).
- ``sdar`` -- SDAR (JetLM/SDAR-8B, Qwen3 shape): grouped-query attention and a
  per-head q/k RMSNorm applied before RoPE; trained with the staircase layout
  and decoded block by block (``block_size``).

Shapes and special ids of the 8B presets follow the upstream ``config.json``
files (GSAI-ML/LLaDA-8B-Instruct, JetLM/SDAR-8B-Chat).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn.functional as F

from stabledrl_mcore.common.errors import UserError

ARCHS = ("llada", "sdar")
ATTENTION_BACKENDS = ("auto", "sdpa", "flex")
POSITION_EMBEDDINGS = ("rope", "learned")


class ModelConfigError(UserError, ValueError):
    """A :class:`DLLMConfig` that cannot describe a working model."""


@dataclass
class DLLMConfig:
    """Shape and vocabulary of a diffusion-LM backbone (architecture-level, no parallelism)."""

    arch: str
    """``"llada"`` (bidirectional MHA) or ``"sdar"`` (block diffusion, GQA + qk-norm)."""
    vocab_size: int
    """Number of token ids the tokenizer can produce (rows of the embedding)."""
    hidden_size: int
    """Model width ``H``."""
    num_layers: int
    """Number of transformer blocks."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (== ``num_attention_heads`` for MHA; 8 for SDAR-8B)."""
    ffn_hidden_size: int
    """SwiGLU inner width (each of gate and up)."""
    head_dim: Optional[int] = None
    """Per-head width; None = ``hidden_size // num_attention_heads``."""
    rope_theta: float = 10000.0
    """RoPE base (5e5 for LLaDA, 1e6 for SDAR)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon, shared by every norm of the model (1e-5 LLaDA, 1e-6 SDAR)."""
    qk_layernorm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (SDAR/Qwen3)."""
    max_position_embeddings: int = 4096
    """Longest position id the model is meant for (informational; RoPE has no table)."""
    block_size: Optional[int] = None
    """SDAR: tokens per diffusion block (staircase training, block decoding); None for LLaDA."""
    mask_token_id: int = 0
    """Id of the ``[MASK]`` token that marks noised positions."""
    eos_token_id: int = 0
    """End-of-sequence id."""
    pad_token_id: int = 0
    """Padding id (LLaDA pads with EOS)."""
    bos_token_id: Optional[int] = None
    """Beginning-of-sequence id, if the tokenizer has one."""
    make_vocab_size_divisible_by: int = 1
    """Pad the embedding/output rows to a multiple of this x TP (Megatron's convention)."""
    init_std: float = 0.02
    """Std of the normal init of every weight matrix (random-init runs and tests)."""
    attention_backend: str = "auto"
    """``auto`` (SDPA, flex attention on CUDA for long masked layouts), ``sdpa`` or ``flex``."""
    position_embedding: str = "rope"
    """``rope`` (LLaDA/SDAR) or ``learned``: a learned absolute table of
    ``max_position_embeddings`` rows added to the token embedding (BERT/GPT-2 style,
    Megatron's ``learned_absolute``), and no rotary in attention. Small models trained
    from scratch on grid tasks use it (see :func:`~.positions.segment_positions`)."""
    segment_separator_id: Optional[int] = None
    """If set, default position ids restart at 0 after every occurrence of this token,
    so aligned fields (a puzzle cell and its answer cell) share a position id; the
    segment id (number of separators before a token) selects a learned segment
    embedding when ``num_segments > 0``. None = positions ``0..S-1``."""
    num_segments: int = 0
    """Rows of the learned segment (token-type) embedding; 0 = none."""
    embedding_init_std: Optional[float] = None
    """Std of the normal init of the token, position and segment embeddings; None = ``init_std``."""
    num_experts: Optional[int] = None
    """Mixture of experts: routed experts per layer (every layer's MLP is an MoE layer, as in
    Qwen3-MoE / SDAR-30B-A3B with ``decoder_sparse_step`` 1); None = dense SwiGLU MLPs."""
    moe_ffn_hidden_size: Optional[int] = None
    """SwiGLU inner width of each expert (``moe_intermediate_size``); required with ``num_experts``."""
    moe_router_topk: int = 2
    """Experts per token (``num_experts_per_tok``)."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k softmax probabilities to sum to 1 (Qwen3-MoE ``norm_topk_prob``:
    Megatron's softmax over the top-k logits); False = the top-k of the full softmax."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the router's load-balancing loss (Switch-style, per micro-batch). 0 = off: an RL
    update should move the policy, not re-balance the routing the model was trained with (slime's
    Qwen3-MoE RL scripts set ``--moe-aux-loss-coeff 0`` too); the converter does not import the checkpoint's
    ``router_aux_loss_coef`` (a pre-training setting)."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss (ST-MoE, ``mean(logsumexp(logits)^2)``); 0 = off."""
    moe_capacity_factor: Optional[float] = None
    """Expert capacity as a multiple of the even share of tokens; tokens over it are dropped (their
    expert output is 0, the residual passes). None = dropless (every routed token is computed)."""

    # ------------------------------------------------------------------ derived
    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts backbone."""
        return self.num_experts is not None

    @property
    def kv_channels(self) -> int:
        """Per-head width actually used."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        """Rows of the embedding/output layer: ``vocab_size`` rounded up to
        ``make_vocab_size_divisible_by x tensor_parallel`` (as Megatron-LM pads)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self) -> int:
        """Parameter count (unpadded vocab)."""
        h, d = self.hidden_size, self.kv_channels
        attn = h * d * (self.num_attention_heads + 2 * self.num_query_groups)
        attn += self.num_attention_heads * d * h + (2 * d if self.qk_layernorm else 0)
        mlp = (
            3 * h * self.moe_ffn_hidden_size * self.num_experts + self.num_experts * h
            if self.is_moe
            else 3 * h * self.ffn_hidden_size
        )
        tables = (self.max_position_embeddings if self.position_embedding == "learned" else 0) + self.num_segments
        return self.num_layers * (attn + mlp + 2 * h) + 2 * self.vocab_size * h + h + tables * h

    def num_active_parameters(self) -> int:
        """Parameters one token runs through: every expert but its ``moe_router_topk`` left out
        (== :meth:`num_parameters` for a dense model); the MFU counts these."""
        if not self.is_moe:
            return self.num_parameters()
        idle = self.num_experts - self.moe_router_topk
        return self.num_parameters() - self.num_layers * idle * 3 * self.hidden_size * self.moe_ffn_hidden_size

    # --------------------------------------------------------------- validation
    def validate(self) -> "DLLMConfig":
        """Raise :class:`ModelConfigError` naming every problem; return ``self``."""
        problems: List[str] = []
        if self.arch not in ARCHS:
            problems.append(f"arch must be one of {ARCHS}, got {self.arch!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "max_position_embeddings",
            "make_vocab_size_divisible_by",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive int, got {value!r}")
        if not problems:
            if self.num_attention_heads % self.num_query_groups:
                problems.append(
                    f"num_attention_heads ({self.num_attention_heads}) must be a "
                    f"multiple of num_query_groups ({self.num_query_groups})"
                )
            if self.head_dim is None and self.hidden_size % self.num_attention_heads:
                problems.append(
                    f"hidden_size ({self.hidden_size}) is not divisible by "
                    f"num_attention_heads ({self.num_attention_heads}); set head_dim"
                )
            if self.kv_channels % 2:
                problems.append(f"head_dim ({self.kv_channels}) must be even for rotate-half RoPE")
            for name in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
                value = getattr(self, name)
                if value is not None and not 0 <= value < self.vocab_size:
                    problems.append(f"{name} ({value}) is outside the vocabulary [0, {self.vocab_size})")
        if self.arch == "sdar" and (self.block_size is None or self.block_size < 1):
            problems.append(f"sdar needs a positive block_size, got {self.block_size!r}")
        if self.arch == "llada" and self.block_size is not None:
            problems.append("llada is fully bidirectional: block_size must be None")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            problems.append("rope_theta, norm_eps and init_std must be > 0")
        problems += self._position_problems()
        problems += self._moe_problems()
        if self.attention_backend not in ATTENTION_BACKENDS:
            problems.append(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if problems:
            raise ModelConfigError("invalid DLLMConfig: " + "; ".join(problems))
        return self

    def _moe_problems(self) -> List[str]:
        if self.num_experts is None:
            return (
                []
                if self.moe_ffn_hidden_size is None
                else ["moe_ffn_hidden_size is set but num_experts is None (a dense model); set num_experts"]
            )
        problems: List[str] = []
        if not isinstance(self.num_experts, int) or self.num_experts < 2:
            problems.append(f"num_experts must be an int >= 2 or None, got {self.num_experts!r}")
        if not isinstance(self.moe_ffn_hidden_size, int) or self.moe_ffn_hidden_size < 1:
            problems.append(f"num_experts needs a positive moe_ffn_hidden_size, got {self.moe_ffn_hidden_size!r}")
        if not isinstance(self.moe_router_topk, int) or not 1 <= self.moe_router_topk <= (self.num_experts or 0):
            problems.append(f"moe_router_topk ({self.moe_router_topk!r}) must be in [1, num_experts]")
        if self.position_embedding != "rope" or self.num_segments:
            problems.append("mixture-of-experts presets take RoPE and no segment embedding")
        if self.moe_aux_loss_coeff < 0 or self.moe_z_loss_coeff < 0:
            problems.append("moe_aux_loss_coeff and moe_z_loss_coeff must be >= 0")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            problems.append(f"moe_capacity_factor must be > 0 or None, got {self.moe_capacity_factor!r}")
        return problems

    def _position_problems(self) -> List[str]:
        problems: List[str] = []
        if self.position_embedding not in POSITION_EMBEDDINGS:
            problems.append(f"position_embedding must be one of {POSITION_EMBEDDINGS}, got {self.position_embedding!r}")
        sep = self.segment_separator_id
        if sep is not None and (not isinstance(sep, int) or not 0 <= sep < self.vocab_size):
            problems.append(f"segment_separator_id ({sep!r}) is outside the vocabulary [0, {self.vocab_size})")
        if not isinstance(self.num_segments, int) or self.num_segments < 0:
            problems.append(f"num_segments must be an int >= 0, got {self.num_segments!r}")
        elif self.num_segments and sep is None:
            problems.append("num_segments > 0 needs segment_separator_id (segments are counted by it)")
        if self.embedding_init_std is not None and not self.embedding_init_std > 0:
            problems.append(f"embedding_init_std must be > 0 or None, got {self.embedding_init_std!r}")
        return problems

    # ---------------------------------------------------------- serialisation
    def to_dict(self) -> Dict[str, Any]:
        """Plain dict of every field (JSON/YAML friendly)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "DLLMConfig":
        """Inverse of :meth:`to_dict`; unknown keys raise :class:`ModelConfigError`."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ModelConfigError(f"unknown DLLMConfig fields {unknown}; valid: {sorted(names)}")
        return cls(**data).validate()

    def replace(self, **changes: Any) -> "DLLMConfig":
        """A validated copy with some fields changed (e.g. ``num_layers=2``)."""
        return self.from_dict({**self.to_dict(), **changes})


_PRESETS: Dict[str, Dict[str, Any]] = {
    # GSAI-ML/LLaDA-8B-{Base,Instruct} config.json.
    "llada-8b": dict(
        arch="llada",
        vocab_size=126464,
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_query_groups=32,
        ffn_hidden_size=12288,
        rope_theta=500000.0,
        norm_eps=1e-5,
        max_position_embeddings=4096,
        mask_token_id=126336,
        eos_token_id=126081,
        pad_token_id=126081,
        bos_token_id=126080,
    ),
    # JetLM/SDAR-8B-Chat: Qwen3-8B shape; <|MASK|> 151669, <|im_end|> eos, <|endoftext|> pad.
    "sdar-8b": dict(
        arch="sdar",
        vocab_size=151936,
        hidden_size=4096,
        num_layers=36,
        num_attention_heads=32,
        num_query_groups=8,
        head_dim=128,
        ffn_hidden_size=12288,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_layernorm=True,
        max_position_embeddings=32768,
        block_size=4,
        mask_token_id=151669,
        eos_token_id=151645,
        pad_token_id=151643,
    ),
    # JetLM/SDAR-30B-A3B-Chat: the Qwen3-30B-A3B shape (48 layers, 128 experts of width 768, top-8
    # with renormalised probabilities, every layer an MoE layer) and SDAR's block size and ids.
    "sdar-30b-a3b": dict(
        arch="sdar",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=6144,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_layernorm=True,
        max_position_embeddings=40960,
        block_size=4,
        mask_token_id=151669,
        eos_token_id=151645,
        pad_token_id=151643,
        num_experts=128,
        moe_ffn_hidden_size=768,
        moe_router_topk=8,
        moe_norm_topk_prob=True,
    ),
    # ~0.23M parameters: unit tests and the CPU demo. Ids: pad 0, bos 1, eos 2, mask = last.
    "llada-tiny": dict(
        arch="llada",
        vocab_size=256,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=4,
        ffn_hidden_size=176,
        rope_theta=500000.0,
        norm_eps=1e-5,
        max_position_embeddings=512,
        mask_token_id=255,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    ),
    "sdar-tiny": dict(
        arch="sdar",
        vocab_size=256,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=176,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_layernorm=True,
        max_position_embeddings=512,
        block_size=4,
        mask_token_id=255,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    ),
    # sdar-tiny with 4 experts of width 48, top-2: the MoE tests and CPU benchmarks.
    "sdar-moe-tiny": dict(
        arch="sdar",
        vocab_size=256,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=176,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_layernorm=True,
        max_position_embeddings=512,
        block_size=4,
        mask_token_id=255,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
        num_experts=4,
        moe_ffn_hidden_size=48,
        moe_router_topk=2,
        moe_norm_topk_prob=True,
    ),
    # ~100M parameters: throughput benchmarks and CPU smoke runs of the full stack.
    "llada-100m": dict(
        arch="llada",
        vocab_size=32768,
        hidden_size=768,
        num_layers=8,
        num_attention_heads=12,
        num_query_groups=12,
        ffn_hidden_size=2048,
        rope_theta=500000.0,
        norm_eps=1e-5,
        max_position_embeddings=2048,
        mask_token_id=32767,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    ),
    "sdar-100m": dict(
        arch="sdar",
        vocab_size=32768,
        hidden_size=768,
        num_layers=8,
        num_attention_heads=12,
        num_query_groups=4,
        head_dim=64,
        ffn_hidden_size=2048,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_layernorm=True,
        max_position_embeddings=2048,
        block_size=4,
        mask_token_id=32767,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    ),
}


def available_presets() -> List[str]:
    """Names accepted by :func:`get_preset`."""
    return sorted(_PRESETS)


def get_preset(name: str, **overrides: Any) -> DLLMConfig:
    """A fresh, validated :class:`DLLMConfig` for a preset name, with optional field overrides."""
    if name not in _PRESETS:
        raise ModelConfigError(f"unknown preset {name!r}; available: {available_presets()}")
    return DLLMConfig.from_dict({**_PRESETS[name], **overrides})


def _parallel_sizes(parallel: Union[None, Dict[str, Any], Any]) -> Dict[str, Any]:
    if parallel is None:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return dict(
                tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
            )
        return dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if isinstance(parallel, dict):
        return dict(parallel)
    sizes = dict(
        tensor_model_parallel_size=parallel.tensor_parallel, pipeline_model_parallel_size=parallel.pipeline_parallel
    )
    if getattr(parallel, "expert_parallel", 1) > 1 or getattr(parallel, "expert_tensor_parallel", None):
        sizes.update(
            expert_model_parallel_size=parallel.expert_parallel,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel or parallel.tensor_parallel,
        )
    return sizes


def moe_transformer_config(cfg: DLLMConfig) -> Dict[str, Any]:
    """Megatron ``TransformerConfig`` fields of an MoE backbone (empty for a dense one).

    Routing as Qwen3-MoE: softmax scores in fp32, top-k, renormalised when ``moe_norm_topk_prob``
    (Megatron's softmax over the top-k logits, ``moe_router_pre_softmax=False``); the all-to-all
    token dispatcher; ``SequentialMLP`` experts (``build_model`` turns on grouped GEMM where its
    spec is Transformer Engine's; one checkpoint layout). Router losses as configured (default off).
    """
    if not cfg.is_moe:
        return {}
    balancing = "aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none"
    return dict(
        num_moe_experts=cfg.num_experts,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_topk=cfg.moe_router_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not cfg.moe_norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe_z_loss_coeff or None,
        moe_expert_capacity_factor=cfg.moe_capacity_factor,
        moe_pad_expert_input_to_capacity=False,
        moe_token_drop_policy="probs",
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
    )


def swiglu_fusion_available() -> bool:
    """Whether Megatron's fused SwiGLU (``bias_activation_fusion``) can run here.

    Megatron's ``SwiGLUFunction`` is ``torch.compile``-d (``megatron.core.jit.jit_fuser``):
    one kernel computes ``silu(gate) * up`` and one writes both input gradients
    into the ``[.., 2F]`` fc1 gradient, instead of ``chunk`` + ``silu`` + ``mul``
    whose backward concatenates the two halves (a full extra copy of the widest
    activation; ~40% of the eager SwiGLU's fwd+bwd time on CPU). On CUDA this is
    Megatron's usual Llama setting; on CPU inductor needs a C++ compiler, so
    without one (or with ``STABLEDRL_SWIGLU_FUSION=0``) the eager GLU is used.
    The first call of a process compiles (seconds, cached on disk afterwards).
    """

    setting = os.environ.get("STABLEDRL_SWIGLU_FUSION", "auto").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    from megatron.core import jit

    if jit.jit_fuser is not torch.compile:  # Megatron's fuser is off: the eager GLU is faster
        return False
    if torch.cuda.is_available():
        return True
    compiler = os.environ.get("CXX") or "g++"
    return any(shutil.which(c) for c in (compiler, "c++", "clang++"))


CPU_SWIGLU_FUSION_MIN_FFN = 1024
"""On CPU the fused SwiGLU is used from this ``ffn_hidden_size`` on (the 100M presets
and up): there its compile (seconds; over a minute on a loaded 2-core machine, in
every process and every spawned rank) is repaid within a few steps, while the tiny
test/demo models would mostly pay the compile (it saves ~4% of a tiny step)."""


def use_swiglu_fusion(cfg: "DLLMConfig") -> bool:
    """Whether :func:`to_transformer_config` turns on Megatron's fused SwiGLU for ``cfg``.

    ``STABLEDRL_SWIGLU_FUSION=1``/``0`` forces it on/off; otherwise it is on when
    :func:`swiglu_fusion_available` and (CUDA, or ``ffn_hidden_size >=``
    :data:`CPU_SWIGLU_FUSION_MIN_FFN`). Either way the weights and checkpoint keys
    are the same (only the activation kernel differs, ~1e-6 relative in fp32).
    """

    setting = os.environ.get("STABLEDRL_SWIGLU_FUSION", "auto").strip().lower()
    if setting in ("0", "false", "no", "off", "1", "true", "yes", "on"):
        return swiglu_fusion_available()
    return swiglu_fusion_available() and (torch.cuda.is_available() or cfg.ffn_hidden_size >= CPU_SWIGLU_FUSION_MIN_FFN)


def to_transformer_config(
    cfg: DLLMConfig,
    parallel: Union[None, Dict[str, Any], Any] = None,
    dtype: torch.dtype = torch.float32,
    recompute: Union[bool, str] = False,
    **overrides: Any,
):
    """Translate a :class:`DLLMConfig` into Megatron-Core's ``TransformerConfig``.

    ``parallel``: None (read Megatron's parallel state), a dict of
    ``ModelParallelConfig`` fields (``tensor_model_parallel_size``, ...), or an
    object with ``tensor_parallel``/``pipeline_parallel`` attributes (the run
    config's ``ParallelSection``). ``recompute``: False, True/``"full"`` (every
    layer recomputed in backward, Megatron's ``full``/``uniform``/1) or
    ``"selective"`` (core attention only). ``overrides`` go to TransformerConfig.
    """
    from megatron.core.transformer import TransformerConfig

    cfg.validate()
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ModelConfigError(f"unsupported dtype {dtype}")
    kwargs: Dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        qk_layernorm=cfg.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_std,
        embedding_init_method_std=cfg.embedding_init_std,
        rotary_interleaved=False,
        apply_rope_fusion=False,
        bias_activation_fusion=use_swiglu_fusion(cfg),
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        cuda_graph_scope=[],  # Megatron's default "full" only triggers a deprecation warning
    )
    kwargs.update(_parallel_sizes(parallel))
    kwargs.update(moe_transformer_config(cfg))
    if recompute is True or recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kwargs.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif recompute not in (False, None):
        raise ModelConfigError(f"recompute must be False, True, 'full' or 'selective', got {recompute!r}")
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)

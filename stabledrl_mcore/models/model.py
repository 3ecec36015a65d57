"""The diffusion-LM backbone on Megatron-Core: embedding -> TransformerBlock -> LM head.

Read top to bottom it is a GPT: ``VocabParallelEmbedding`` (via
``LanguageModelEmbedding``; no learned positions unless ``position_embedding="learned"``,
a segment embedding only with ``num_segments``), Megatron's
``TransformerBlock`` built from :func:`~stabledrl_mcore.models.specs.dllm_layer_spec`
(pre-norm attention + SwiGLU, RMSNorm, final norm on the last stage) and a
column-parallel, untied output layer. It differs from an autoregressive LM in
three places only:

1. attention is bidirectional unless a mask/layout says otherwise (the core
   attention of the spec, :mod:`stabledrl_mcore.models.attention`);
2. RoPE is computed here from explicit ``position_ids`` (the staircase layout
   repeats positions; KV-cached decoding starts at the cached length), not by
   GPTModel's internal table, which ignores position ids;
3. logits at position ``i`` score token ``i`` (no shift); that is the caller's
   business -- the model just returns them.

Pipeline stages: ``pre_process`` owns the embedding, ``post_process`` the final
norm and head; middle stages receive hidden states through
:meth:`set_input_tensor` (Megatron's schedules call it).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Union

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from stabledrl_mcore.models.attention import HeadsMajorRotarySelfAttention, SDPACoreAttention
from stabledrl_mcore.models.gated_mlp import with_module_activation
from stabledrl_mcore.models.kv_cache import KVCache
from stabledrl_mcore.models.linear import AutogradColumnParallelLinear
from stabledrl_mcore.models.masks import AttentionLayout
from stabledrl_mcore.models.placement import default_device, place_model
from stabledrl_mcore.models.positions import segment_positions, take_positions
from stabledrl_mcore.models.presets import DLLMConfig, to_transformer_config
from stabledrl_mcore.models.rope import rotary_angles, rotary_cos_sin
from stabledrl_mcore.models.specs import dllm_layer_spec

MaskArg = Union[None, torch.Tensor, AttentionLayout]


class DLLMModel(LanguageModule):
    """LLaDA / SDAR backbone. Build it with :func:`build_model`."""

    def __init__(
        self,
        dllm_config: DLLMConfig,
        config: TransformerConfig,
        layer_spec,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection=None,
    ):
        config = with_module_activation(config, layer_spec)  # the local spec's SwiGLU module
        super().__init__(config=config, pg_collection=pg_collection)
        self.dllm_config = dllm_config.validate()
        self.model_type = ModelType.encoder_or_decoder  # Megatron's pipeline schedules read it
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = False
        self.vocab_size = dllm_config.vocab_size
        self.padded_vocab_size = dllm_config.padded_vocab_size(config.tensor_model_parallel_size)
        self.learned_positions = dllm_config.position_embedding == "learned"
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=self.padded_vocab_size,
                max_sequence_length=dllm_config.max_position_embeddings,
                position_embedding_type="learned_absolute" if self.learned_positions else "rope",
                num_tokentypes=dllm_config.num_segments,
                tp_group=self.pg_collection.tp,
            )
        self.decoder = TransformerBlock(
            config=config,
            spec=layer_spec,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=self.pg_collection,
        )
        # The local spec's attention takes cos/sin, Megatron's (TE spec) takes angles.
        self._rotary = (
            rotary_cos_sin
            if layer_spec.submodules.self_attention.module is HeadsMajorRotarySelfAttention
            else rotary_angles
        )
        if post_process:
            self.output_layer = AutogradColumnParallelLinear(
                config.hidden_size,
                self.padded_vocab_size,
                config=config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                gather_output=False,
                tp_group=self.pg_collection.tp,
            )
        self.setup_embeddings_and_output_layer()
        for attention in self.core_attentions():
            attention.backend = dllm_config.attention_backend

    layer_regions = True
    """Whether a captured step runs each layer as one nested compile region (see
    :meth:`_inference_layers`; set by :class:`~.decoding.DecodingForward`)."""

    def core_attentions(self):
        """The :class:`SDPACoreAttention` module of every layer on this stage (found once: a
        KV-cached forward binds its cache to each, and walking every module per forward cost
        ~0.3 ms of a 4-token decoding step)."""
        found = self.__dict__.get("_core_attentions")
        if found is None:
            found = [m for m in self.modules() if isinstance(m, SDPACoreAttention)]
            self.__dict__["_core_attentions"] = found
        return found

    def kv_cache_layers(self):
        """``{layer_number: (query groups, head_dim)}`` of this stage's layers: a KV cache's shape
        (:meth:`KVCache.allocate`)."""
        return {a.layer_number: (a.groups_per_partition, self.config.kv_channels) for a in self.core_attentions()}

    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype of the keys and values a forward caches (the activations')."""
        return self.config.params_dtype

    def set_input_tensor(self, input_tensor) -> None:
        """Hidden states from the previous pipeline stage (called by Megatron's schedules)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError("DLLMModel expects exactly one input tensor per stage")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: MaskArg = None,
        *,
        kv_cache: Optional[KVCache] = None,
        gather_output: bool = True,
        segment_ids: Optional[torch.Tensor] = None,
        logit_positions: Union[None, slice, torch.Tensor] = None,
        cache_slots: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, V]`` on the last stage (``[B, S, V/tp]`` if not ``gather_output``),
        hidden states ``[S, B, H]`` on the other stages.

        ``logit_positions``: a ``slice`` of the ``S`` positions whose logits are wanted, a
        LongTensor of them (a decoding step's read positions, which change per block while the
        graph does not) or a ``[B, n]`` LongTensor of each sequence's own (a step's masked
        positions); the LM head, and at inference the last layer's queries, output projection
        and MLP, run on those only and the logits are ``[B, n, V]`` (the full forward's logits at
        those positions, up to rounding). ``slice(0, 0)`` runs no head at all (a forward that only
        fills a KV cache). With sequence parallelism the head runs
        on the whole sequence and the logits are read after.

        ``cache_slots``: with a ``kv_cache``, a LongTensor ``[S]`` of the cache slots this
        forward's keys are written to (a slot-addressed decoding step, see :class:`KVCache`): its
        queries attend over every slot of the cache, ``attention_mask`` is then None (every
        slot visible), a bool mask over ``capacity`` keys or an :class:`AttentionLayout`
        (resolved over the slots), and ``position_ids`` default to the slots.

        ``position_ids``: ``[B, S]`` or ``[1, S]``; None = ``0..S-1`` (shifted by
        ``kv_cache.offset`` with a cache), or the separator scheme's ids
        (:func:`~stabledrl_mcore.models.positions.segment_positions`) when
        ``segment_separator_id`` is set. ``attention_mask``: None (bidirectional),
        a bool tensor (True = blocked, broadcastable to ``[B, 1, S, S_k]``) or an
        :class:`AttentionLayout`. ``kv_cache``: see :class:`KVCache`. ``segment_ids``: with
        ``segment_separator_id``, a forward of part of a sequence after a filled cache passes the
        whole sequence's ``segment_positions`` sliced, as ``position_ids`` and ``segment_ids``.
        """
        seq_len, device = self._seq_len_and_device(input_ids)
        if kv_cache is not None and self.training and self.config.recompute_granularity:
            raise ValueError("a KV cache cannot be combined with activation recompute (inference only)")
        if cache_slots is not None and kv_cache is None:
            raise ValueError("cache_slots name slots of a kv_cache; pass the cache too")
        separator = self.dllm_config.segment_separator_id
        # Learned positions are only needed where the embedding is (the first stage); RoPE
        # needs them on every stage, which the separator scheme cannot give without input ids.
        if segment_ids is not None and (separator is None or position_ids is None):
            raise ValueError("segment_ids are taken with segment_separator_id and their position_ids only")
        if separator is not None and (self.pre_process or not self.learned_positions):
            if segment_ids is None:
                if input_ids is None or (kv_cache is not None and (kv_cache.length or cache_slots is not None)):
                    raise ValueError(
                        "segment_separator_id derives positions from the whole input_ids: it "
                        "needs them on every stage with RoPE; after a filled KV cache pass "
                        "position_ids and segment_ids (segment_positions of the whole rows)"
                    )
                derived, segment_ids = segment_positions(input_ids, separator)
                position_ids = derived if position_ids is None else position_ids
            segment_ids = segment_ids.clamp(max=max(self.dllm_config.num_segments - 1, 0))
        if position_ids is None and cache_slots is not None:
            position_ids = cache_slots[None]
        elif position_ids is None:
            start = kv_cache.offset if kv_cache is not None else 0
            position_ids = torch.arange(start, start + seq_len, device=device)[None]
        if position_ids.shape[-1] != seq_len:
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} positions, input has {seq_len}")

        hidden = None
        if self.pre_process:
            hidden = self.embedding(
                input_ids=input_ids,
                position_ids=position_ids.expand_as(input_ids) if self.learned_positions else None,
                tokentype_ids=segment_ids if self.dllm_config.num_segments else None,
            )
            hidden = _canonical_strides(hidden)
        rotary = (
            None
            if self.learned_positions
            else self._rotary(_shared_rows(position_ids), self.config.kv_channels, self.dllm_config.rope_theta)
        )
        if cache_slots is not None and isinstance(attention_mask, AttentionLayout):
            attention_mask = attention_mask.over_slots(cache_slots, kv_cache.capacity)
        mask = _decoder_mask(attention_mask)

        attentions = self.core_attentions() if kv_cache is not None else []
        for attention in attentions:
            attention.kv_cache = kv_cache
        if kv_cache is not None:
            kv_cache.slots = cache_slots
        try:
            hidden = self._decode(hidden, mask, rotary, logit_positions)
            if kv_cache is not None:
                kv_cache.commit()
        except BaseException:
            if kv_cache is not None:
                kv_cache.discard_pending()
            raise
        finally:
            for attention in attentions:
                attention.kv_cache = None
            if kv_cache is not None:
                kv_cache.slots = None

        if not self.post_process:
            return hidden
        if self.config.sequence_parallel:  # the head gathers the sequence dim: keep [S, B, H]
            logits = self.output_layer(hidden)[0].transpose(0, 1).contiguous()
            if logit_positions is not None:
                logits = take_positions(logits, logit_positions, 1)
        elif hidden.shape[0] == 0:  # slice(0, 0): no head
            width = self.padded_vocab_size // self.config.tensor_model_parallel_size
            logits = hidden.new_zeros(hidden.shape[1], 0, width)
        else:  # transpose the H-wide input, not the V-wide logits (a 40x smaller copy at 8B); a 2-D
            # input keeps the head one GEMM (see _canonical_strides)
            rows, batch = hidden.shape[:2]
            flat = hidden.transpose(0, 1).reshape(rows * batch, hidden.shape[-1])
            logits = self.output_layer(flat)[0].view(batch, rows, -1)  # [B, S, Vp/tp]
        logits = self._mask_vocab_padding(logits)
        if not gather_output:
            return logits
        if self.config.tensor_model_parallel_size > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits, group=self.pg_collection.tp)
        return logits[..., : self.vocab_size] if self.padded_vocab_size != self.vocab_size else logits

    def _decode(self, hidden, mask, rotary, logit_positions):
        """The transformer block, then (last stage) the rows of ``logit_positions``."""
        rows = logit_positions if self.post_process and not self.config.sequence_parallel else None
        if self._records_nothing():
            return self._inference_layers(hidden, mask, rotary, rows)
        hidden = self.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)
        return hidden if rows is None else take_positions(hidden, rows, 0)

    def _records_nothing(self) -> bool:
        """True for a forward that records no autograd graph and runs none of the block's
        training-time machinery: no gradients, eval mode, and neither fp8/fp4 nor activation
        offloading configured (their contexts wrap the layers in ``TransformerBlock.forward``)."""
        config = self.config
        return (
            not torch.is_grad_enabled()
            and not self.training
            and not config.fp8
            and not getattr(config, "fp4", None)
            and not config.cpu_offloading
        )

    def _inference_layers(self, hidden, mask, rotary, rows=None):
        """``TransformerBlock.forward`` at inference, without its ``make_viewless_tensor`` calls;
        with ``rows`` (the read positions, see :func:`~.positions.take_positions`) only those rows leave the last
        layer (:func:`_layer_at_rows`).

        Megatron makes the block's input and output "viewless" (``MakeViewlessTensor``, an
        autograd function that allocates ``torch.empty(..., requires_grad=True)`` and swaps
        ``.data``) so that pipeline schedules can free an output's storage and activation
        checkpointing can save it; both act on tensors that carry an autograd graph. Here no
        graph is recorded (:meth:`_records_nothing`) and the hidden states reach neither a schedule
        nor a checkpoint, so the detour only costs: it is a graph break for ``torch.compile``
        (Dynamo refuses ``requires_grad=True`` tensor creation). The layers, their arguments and
        the final norm are the block's own; nothing of Megatron is patched.

        Inside a captured step (``torch.compile``) every layer runs as one nested compile region
        (:func:`_compiled_layer`): the layers share one traced subgraph, their parameters and KV
        buffers its inputs, so inductor generates the layer's code once however deep the model
        is (the cold compile does not grow with the layer count). Not where the parameters are views
        of one buffer (Megatron DDP's contiguous parameter buffer, the trainer's model): a region's
        inputs may not alias, so :class:`~.decoding.DecodingForward` sets :attr:`layer_regions`
        False while its step runs there (and for inductor's C++ wrapper, which has no code for a region) and the layers
        are traced one by one, as before.
        """
        block = self.decoder
        if not self.pre_process:
            hidden = block.input_tensor
        run = _layer
        if torch.compiler.is_compiling() and self.layer_regions:
            run, hidden = _compiled_layer, _row_major(hidden)
        last = len(block.layers) - 1 if rows is not None else -1
        for index, layer in enumerate(block.layers):
            hidden = (
                _layer_at_rows(layer, hidden, mask, rotary, rows) if index == last else run(layer, hidden, mask, rotary)
            )
        if rows is not None and last < 0:  # a stage without layers
            hidden = take_positions(hidden, rows, 0)
        if block.final_layernorm is not None:
            hidden = block.final_layernorm(hidden)
        return hidden

    def _seq_len_and_device(self, input_ids: Optional[torch.Tensor]):
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
            return input_ids.shape[1], input_ids.device
        if self.pre_process or self.decoder.input_tensor is None:
            raise ValueError("input_ids is required on the first pipeline stage")
        return self.decoder.input_tensor.shape[0], self.decoder.input_tensor.device

    def _mask_vocab_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padded vocabulary rows score ``finfo.min`` so no softmax ever picks them."""
        if self.padded_vocab_size == self.vocab_size:
            return logits
        width = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * width
        padded = torch.arange(start, start + width, device=logits.device) >= self.vocab_size
        return logits.masked_fill(padded, torch.finfo(logits.dtype).min)


def _layer(layer, hidden, mask, rotary):
    """One transformer layer of an inference forward: its output hidden states."""
    return layer(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)[0]


def _layer_at_rows(layer, hidden, mask, rotary, rows):
    """``_layer(layer, hidden, mask, rotary)`` at ``rows`` only (:func:`~.positions.take_positions`),
    for the last layer of a forward that reads the logits of a few positions: every position's keys
    and values are computed (and cached), only the rows read query them, and the output projection,
    the residual and the MLP run on those rows, the part of the layer nothing else needs. The steps
    of Megatron's ``TransformerLayer._forward_attention`` at inference (input norm, self-attention,
    bias-dropout-add; the layers have no cross-attention), then the layer's own ``_forward_mlp``. A
    MoE layer runs whole (its router sees every token, as in the training forward: capacity drops
    and the routing statistics depend on the tokens routed together); a layer whose attention is
    not :class:`SDPACoreAttention` (or a forward that reads no row) runs its attention whole and
    the MLP on the rows. Equal to the full layer's rows up to the GEMMs' rounding over fewer rows."""
    if getattr(layer, "is_moe_layer", False):
        return take_positions(_layer(layer, hidden, mask, rotary), rows, 0)
    attention = layer.self_attention
    core = getattr(attention, "core_attention", None)
    count = rows.shape[-1] if isinstance(rows, torch.Tensor) else len(range(*rows.indices(hidden.shape[0])))
    if not isinstance(core, SDPACoreAttention) or count == 0 or not _plain_attention(layer):
        hidden, _ = layer._forward_attention(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)
        hidden = take_positions(hidden, rows, 0)
        return hidden if count == 0 else layer._forward_mlp(hidden)
    residual = take_positions(hidden, rows, 0)
    core.query_rows = rows
    try:
        out = attention(layer.input_layernorm(hidden), attention_mask=mask, rotary_pos_emb=rotary)
    finally:
        core.query_rows = None
    hidden = layer.self_attn_bda(layer.training, layer.config.bias_dropout_fusion)(out, residual, layer.hidden_dropout)
    return layer._forward_mlp(hidden)


def _plain_attention(layer) -> bool:
    """Whether ``layer``'s attention half is the steps :func:`_layer_at_rows` runs: no
    cross-attention, no output gate, no fused tensor-parallel inference kernel."""
    config = layer.config
    return (
        isinstance(layer.cross_attention, IdentityOp)
        and not getattr(config, "attention_output_gate", False)
        and not getattr(config, "inference_fuse_tp_communication", False)
    )


_compiled_layer = torch.compiler.nested_compile_region(_layer)
"""``_layer`` as a nested compile region (``torch.compiler.nested_compile_region``, an
``invoke_subgraph`` of Dynamo): traced where a step is captured, the layers of a model become calls
of one subgraph that inductor lowers once and calls per layer, each call with that layer's
parameters and KV buffers as inputs (not constants). Eagerly it is ``_layer``."""


def _row_major(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` with row-major strides on every dimension, size-1 ones included (a view when it
    is contiguous). The first layer's input then has the strides of every later layer's input: a
    traced ``[S, 1, H]`` embedding output keeps the stride ``S * H`` on its batch dimension, and a
    nested compile region traced with other input strides is another subgraph (compiled apart)."""
    if not hidden.is_contiguous():
        return hidden.contiguous()
    strides, step = [], 1
    for size in reversed(hidden.shape):
        strides.append(step)
        step *= size
    return hidden.as_strided(hidden.shape, tuple(reversed(strides)))


def _canonical_strides(hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` with the strides of a freshly allocated tensor (a view, no copy).

    At batch 1 the embedding's ``[S, 1, H]`` output (a transposed ``[1, S, H]``) is
    "contiguous" with the stride ``S * H`` on its size-1 dimension; ``matmul`` then does not
    fold it into one GEMM but expands the weight and runs a batched GEMM per row -- 2.8x the
    time of the first layer's QKV projection on CPU (measured at hidden 512, 320 tokens).
    """
    return hidden.view(hidden.shape) if hidden.is_contiguous() else hidden.contiguous()


def _shared_rows(position_ids: torch.Tensor) -> torch.Tensor:
    """``[1, S]`` when every row of ``[B, S]`` position ids is the same, else unchanged.

    RoPE tables are then ``[S, 1, 1, d]`` instead of ``[S, B, 1, d]`` (with the TE
    spec Megatron's ``apply_rotary_pos_emb`` takes cos/sin of them in every layer).
    Rows expanded from one (stride 0) are shared anywhere; on CPU equal rows are
    also detected by value (on GPU that check would synchronise, and inside a compiled step it
    would read the host, so it is skipped there).
    """
    if position_ids.dim() != 2 or position_ids.shape[0] <= 1:
        return position_ids
    if (
        position_ids.stride(0) == 0
        or (
            position_ids.device.type == "cpu"
            and not torch.compiler.is_compiling()  # a host read: a captured step keeps the rows
            and bool((position_ids == position_ids[:1]).all())
        )
    ):
        return position_ids[:1]
    return position_ids


@functools.lru_cache(maxsize=16)
def _descriptor(layout: AttentionLayout) -> torch.Tensor:
    """``layout.to_tensor()``, one tensor per layout: the core attention decodes a descriptor once
    and recognises the same tensor in later forwards (a decoding loop passes one layout)."""
    return layout.to_tensor()


def _decoder_mask(attention_mask: MaskArg) -> Optional[torch.Tensor]:
    """What the TransformerBlock gets: None, a bool mask, or a layout descriptor tensor."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, AttentionLayout):
        return None if attention_mask.unmasked else _descriptor(attention_mask)
    if isinstance(attention_mask, torch.Tensor):
        if attention_mask.dtype != torch.bool:
            raise TypeError(f"attention_mask must be a bool tensor (True = blocked), got {attention_mask.dtype}")
        if attention_mask.dim() != 4:
            raise ValueError(
                f"attention_mask must be 4-D (broadcastable to [B, 1, S, S_k]), got shape {tuple(attention_mask.shape)}"
            )
        return attention_mask
    raise TypeError(
        f"attention_mask must be None, a bool tensor or an AttentionLayout, got {type(attention_mask).__name__}"
    )


def build_model(
    cfg: DLLMConfig,
    *,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    params_dtype: torch.dtype = torch.float32,
    recompute: Union[bool, str] = False,
    use_te: Optional[bool] = None,
    stock_local: bool = False,
    device: Union[None, str, torch.device] = None,
) -> DLLMModel:
    """Build this rank's stage of the backbone (after ``parallel.bootstrap.initialize``).

    ``pre_process``/``post_process`` default to whether this rank is the first /
    last pipeline stage. ``use_te``: None = Transformer Engine spec iff Megatron can
    use TE on this machine (same checkpoint keys either way). ``recompute``: see
    :func:`~stabledrl_mcore.models.presets.to_transformer_config`. ``stock_local``:
    Megatron's stock local layer (see :func:`dllm_layer_spec`), a reference for
    benchmarks and tests. ``device``: where every parameter and buffer lives
    (default: this rank's GPU, else the CPU), see :func:`place_model`; ``"meta"``
    builds the shapes only (no memory, no initialisation).
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call stabledrl_mcore.parallel.bootstrap.initialize() before build_model()")
    cfg.validate()
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    device = default_device() if device is None else torch.device(device)
    meta = device.type == "meta"
    spec = dllm_layer_spec(
        qk_layernorm=cfg.qk_layernorm, use_te=use_te, stock_local=stock_local, num_experts=cfg.num_experts
    )
    extra = {"perform_initialization": False, "use_cpu_initialization": True} if meta else {}
    if cfg.is_moe:  # TE's grouped experts on the TE spec, Megatron's SequentialMLP otherwise
        from megatron.core.transformer.moe.experts import SequentialMLP

        extra["moe_grouped_gemm"] = spec.submodules.mlp.submodules.experts.module is not SequentialMLP
    config = to_transformer_config(cfg, None, params_dtype, recompute, **extra)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = DLLMModel(cfg, config, spec, pre_process=pre_process, post_process=post_process)
    return place_model(model, device, params_dtype)

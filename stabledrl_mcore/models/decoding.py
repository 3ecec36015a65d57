"""A model's decoding forwards, eager or captured: a few graphs per kind of step, whatever the block.

The samplers run three kinds of forward (:class:`DecodingForward`): a full forward (LLaDA's exact
step), a full forward that also fills a KV cache (the first step of a cached LLaDA block), and a
slot-addressed cached step (a LLaDA prefix/dual block step, an SDAR block step and its
store-by-next-block step, see :class:`~stabledrl_mcore.models.kv_cache.KVCache`). Everything that
changes from one block to the next is a tensor -- the cache slots written, the read positions of
the head, the pad counts -- and the attended keys are the whole fixed-capacity cache under a mask
built in the step from those tensors, so a 256-token generation of 8 or 64 blocks runs the same
graphs. A step reads the logits of the block's masked positions only (the head and the last
layer's queries, output projection and MLP run on those rows), rounded up to a quarter, half, three
quarters or all of the block when compiled (the samplers' ``READ_BUCKETS``), a graph per count. Per
generation shape (rows, prompt + generation length, block) that is:

- LLaDA exact (``cache="none"``): at most 4 graphs (one per read count);
- LLaDA ``dual``: at most 5 (the filling forward, the block step per read count);
- LLaDA ``prefix``: at most 5 (the filling forward; the block-and-suffix step, as one of 4 fixed
  windows ending at the sequence's end -- a quarter, half, three quarters or all of the generation,
  rounded up to whole blocks, so fewer below 4 blocks -- that write the cache from the block on and
  read the whole block:
  ``diffusion/sampling_llada.py`` ``prefix_window``,
  :meth:`~stabledrl_mcore.models.kv_cache.KVCache.writing_from`);
- SDAR: at most 5 (the block step per read count, the store-by-next-block step; the prompt's
  prefill runs eagerly, once per generation, with flex attention on GPU for long prompts).

``compile``: ``none`` (eager), ``default`` (``torch.compile(fullgraph=True)``: inductor, one graph
or an error, never a silent graph break) or ``reduce-overhead`` (on CUDA, CUDA graphs over those
graphs: the KV buffers are marked static addresses and pooled per shape, so a replay writes the
same memory and nothing the step mutates is copied; on CPU, inductor's C++ wrapper, so no Python
runs between the kernels). The graphs are compiled at the first step of each shape and reused by
every later generation of that shape in the process; :attr:`DecodingForward.stats` counts the
graphs and the seconds their compilation took.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import psutil
import torch
from torch import Tensor

from stabledrl_mcore.config.checks import COMPILE_MODES
from stabledrl_mcore.models.kv_cache import KVCache
from stabledrl_mcore.models.masks import AttentionLayout

PROMPT_MULTIPLE = 64
"""Compiled decoding left-pads a batch's prompts to a multiple of this many tokens (rollouts, eval,
generate): the graphs depend on the prompt width, so a run compiles a graph set per 64-token width
bucket, not per batch. The extra pads are masked keys and never count as positions
(:mod:`~stabledrl_mcore.models.positions`), so a padded row decodes the tokens it decodes eagerly."""


def prompt_padding(compile, model, block_length: Optional[int] = None) -> Dict[str, int]:
    """How :func:`~stabledrl_mcore.tasks.prompts.encode_prompts` widens a batch's prompts for
    ``compile`` and ``model``: ``multiple`` (eager: 1, the widest prompt; compiled:
    :data:`PROMPT_MULTIPLE`) and ``step``, the unit of the pads added beyond the widest prompt. An
    SDAR model's blocks are columns of the batch, so its rows are widened by whole blocks only
    (``block_length``, default the model's ``block_size``): every row keeps the block grid it has
    eagerly (up to ``block`` widths, so graph sets, per 64-token bucket); LLaDA's blocks start
    at the prompt's end, so any step (1) keeps them."""
    mode = compile.mode if isinstance(compile, DecodingForward) else check_compile_mode(compile)
    if mode == "none":
        return {"multiple": 1, "step": 1}
    config = getattr(model, "dllm_config", None) or getattr(getattr(model, "module", None), "dllm_config", None)
    sdar = config is not None and str(config.arch).lower() == "sdar"
    step = int(block_length or config.block_size) if sdar else 1
    return {"multiple": PROMPT_MULTIPLE, "step": step}


RECOMPILE_LIMIT = 64
"""Graphs one process may compile for the decoding forward (all shapes and kinds together) before
it refuses to compile more: Dynamo's own default (8) would silently fall back to eager."""

CACHE_POOL = 4
"""Cache shapes kept per :class:`DecodingForward` (the oldest is dropped past this)."""


def check_compile_mode(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return mode


@dataclass
class GraphStats:
    """What the compiled decoding forwards cost (summed over the process's generations)."""

    graphs: int = 0
    """Graphs compiled (0 when eager)."""
    compile_s: float = 0.0
    """Wall seconds of the forwards that compiled a graph (compilation plus that forward)."""
    forwards: int = 0
    """Decoding forwards run (eager or compiled)."""
    unreported: int = 0
    """Graphs compiled since the last line that said so (:meth:`say`, rank 0's console)."""
    unreported_s: float = 0.0
    """Their seconds."""

    def say(self, text: str) -> None:
        """One line on stderr, from rank 0 only (every rank decodes alike)."""
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"stabledrl: {text}", file=sys.stderr, flush=True)


INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
"""Where inductor reads its on-disk cache directory from, at every compilation
(``torch._inductor.runtime.cache_dir_utils.cache_dir``)."""


def use_compile_cache(path: str) -> str:
    """Keep this process's compiled graphs and kernels under ``path`` (created), from the next
    compilation on; returns the absolute path. A later process pointed at the same directory
    compiles from that cache (warm) instead of from scratch."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    os.environ[INDUCTOR_CACHE_VARIABLE] = path
    return path


def _decoding_forward(model, input_ids, attention_mask, kv_cache, cache_slots, logit_positions, layout, pads, extra):
    """The step a graph captures: the mask over the cache slots (from tensors) and the forward."""
    if layout is not None:
        over = layout.over_slots(cache_slots, kv_cache.capacity, pads)
        attention_mask = over if attention_mask is None else attention_mask | over
    return model(
        input_ids,
        attention_mask=attention_mask,
        kv_cache=kv_cache,
        cache_slots=cache_slots,
        logit_positions=logit_positions,
        **extra,
    )


def _parameters_own_storage(model) -> bool:
    """Whether no two parameters of ``model`` share a storage (they do in Megatron DDP's
    contiguous parameter buffer): the layers of a captured step can then be one nested compile
    region, whose inputs may not alias (``DLLMModel._inference_layers``)."""
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    return len(set(storages)) == len(storages)


def _model_device(model) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


class DecodingForward:
    """The decoding forwards of ``model``, eager (``compile="none"``) or compiled.

    Get the model's own with :func:`decoding_forward` (one per model and mode, so graphs and
    caches are shared by every generation of a process). ``model`` follows the samplers'
    protocol: ``model(input_ids, attention_mask=..., kv_cache=..., cache_slots=...,
    logit_positions=...)`` and ``model.kv_cache_layers()``.
    """

    def __init__(self, model, compile: str = "none", *, backend: str = "inductor"):
        self.model = model
        self.mode = check_compile_mode(compile)
        self.backend = backend
        """``torch.compile``'s backend: inductor; a test may count graphs with ``eager``/``aot_eager``."""
        self.stats = GraphStats()
        self._caches: Dict[Tuple, KVCache] = {}
        self._fn = _decoding_forward
        device = _model_device(model).type
        self._replayed = self.mode == "reduce-overhead" and device == "cuda" and backend == "inductor"
        """CUDA graphs: outputs live in the graphs' memory pool, which the next replay reuses."""
        self._regions = False
        """Whether this mode's graphs trace each layer as one nested compile region (set on the
        model for each call only: one model may hold a mode with regions and one without)."""
        self._region_modules = [m for m in model.modules() if hasattr(type(m), "layer_regions")]
        """The model, or the one a wrapper holds."""
        if self.mode != "none":
            # inductor's C++ wrapper (reduce-overhead on CPU) has no code for a nested region
            cpp_wrapper = self.mode == "reduce-overhead" and device != "cuda" and backend == "inductor"
            self._regions = _parameters_own_storage(model) and not cpp_wrapper
            compiler = checked_backend(backend, self.mode, device)
            self._fn = torch.compile(_decoding_forward, fullgraph=True, dynamic=False, backend=compiler)

    @property
    def compiled(self) -> bool:
        return self.mode != "none"

    @contextlib.contextmanager
    def _layer_regions(self):
        """The model's ``layer_regions`` as this mode needs while its step runs (and traces), the
        earlier value back after: a ``default`` and a ``reduce-overhead`` DecodingForward of one
        model on CPU each trace with their own (the C++ wrapper has no code for a region)."""
        before = [m.layer_regions for m in self._region_modules]
        for module in self._region_modules:
            module.layer_regions = self._regions
        try:
            yield
        finally:
            for module, value in zip(self._region_modules, before):
                module.layer_regions = value

    def cache(self, rows: int, capacity: int) -> KVCache:
        """A zeroed KV cache of ``rows`` x ``capacity`` positions for one generation: the same
        buffers for every generation of that shape (static addresses for captured graphs)."""
        if not hasattr(self.model, "kv_cache_layers"):  # a wrapper: buffers made by the first write
            if self.compiled:
                raise ValueError(
                    f"compile={self.mode!r} needs a model with kv_cache_layers() (its KV buffers are "
                    f"allocated before the step is captured); {type(self.model).__name__} has none"
                )
            return KVCache(capacity=capacity)
        layers = self.model.kv_cache_layers()
        dtype, device = self.model.kv_cache_dtype(), _model_device(self.model)
        key = (rows, capacity, dtype, str(device))
        cache = self._caches.pop(key, None)
        fresh = cache is None
        if fresh:
            cache = KVCache(capacity=capacity)
        buffers = cache.allocate(layers, rows, dtype, device)
        if fresh and self.compiled:
            for buffer in buffers:
                torch._dynamo.mark_static_address(buffer)
        self._caches[key] = cache  # most recently used last
        while len(self._caches) > CACHE_POOL:
            self._caches.pop(next(iter(self._caches)))
        return cache

    @torch.no_grad()
    def __call__(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Optional[Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        cache_slots: Optional[Tensor] = None,
        logit_positions: Union[None, slice, Tensor] = None,
        layout: Optional[AttentionLayout] = None,
        pads: Optional[Tensor] = None,
        position_ids: Optional[Tensor] = None,
        segment_ids: Optional[Tensor] = None,
    ) -> Tensor:
        """One decoding forward: logits ``[B, n, V]`` at ``logit_positions``.

        ``kv_cache`` + ``cache_slots``: a slot-addressed step (``cache_slots=None`` with a cache:
        every slot ``0..S-1`` written, the cache filled). ``layout`` (without padding) + ``pads``
        (``[B]`` tensor or None): the mask over the cache slots is built inside the step
        (:meth:`AttentionLayout.over_slots`), joined with ``attention_mask`` when both are given.
        ``position_ids`` / ``segment_ids``: as the model's (default: the slots); the separator
        scheme's, computed by the caller. Runs under ``torch.no_grad()``: nothing of decoding is
        differentiated, and without autograd the model takes its inference path (no Megatron
        ``make_viewless_tensor``, a graph break).
        """
        if kv_cache is not None and cache_slots is None:
            cache_slots = _all_slots(input_ids.shape[1], input_ids.device)
        extra = {} if position_ids is None else {"position_ids": position_ids}
        if segment_ids is not None:
            extra["segment_ids"] = segment_ids
        args = (self.model, input_ids, attention_mask, kv_cache, cache_slots, logit_positions, layout, pads, extra)
        self.stats.forwards += 1
        if not self.compiled:
            return self._fn(*args)
        if self.stats.forwards == 1:  # the first graph compiles now: a wait of tens of seconds or minutes
            self.stats.say(
                f"compiling the decoding graphs (compile={self.mode}; once per generation shape, "
                f"later generations of a shape reuse them) ..."
            )
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        if self._replayed:  # every forward is a new step of the graph trees: earlier outputs are not kept
            torch.compiler.cudagraph_mark_step_begin()
        try:
            with _compile_limits(), self._layer_regions():
                logits = self._fn(*args)
            if self._replayed:  # the caller's copy (a sampler may hold two forwards' logits at once)
                logits = logits.clone()
        except torch._dynamo.exc.BackendCompilerFailed as failed:  # our refusal, not a compiler bug
            if isinstance(failed.inner_exception, HostReadInStepError):
                raise failed.inner_exception from None
            raise
        compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        if compiled:
            spent = time.perf_counter() - start
            self.stats.graphs += compiled
            self.stats.compile_s += spent
            self.stats.unreported += compiled
            self.stats.unreported_s += spent
        elif self.stats.unreported:  # the graphs of this shape are compiled: the first forward without one
            self.stats.say(
                f"compiled {self.stats.unreported} decoding graph{'s' if self.stats.unreported > 1 else ''} "
                f"in {self.stats.unreported_s:.1f} s (compile={self.mode})"
            )
            self.stats.unreported, self.stats.unreported_s = 0, 0.0
        return logits


HOST_READS = ("item", "tolist", "_local_scalar_dense")
"""Graph nodes that read a tensor's value on the host (a device synchronisation, and a graph
CUDA-graph capture skips): refused inside the decoding step."""


class HostReadInStepError(RuntimeError):
    """The traced decoding step reads a tensor on the host."""


def refuse_host_reads(graph_module: torch.fx.GraphModule) -> None:
    """Raise :class:`HostReadInStepError` naming the first node of ``graph_module`` that reads a
    tensor on the host. ``fullgraph=True`` alone does not: Dynamo captures ``Tensor.item()`` /
    ``int(tensor)`` into the graph as a data-dependent scalar instead of breaking it. The nodes of
    its nested graphs are checked too (the subgraph every transformer layer calls, a nested compile
    region: see ``DLLMModel._inference_layers``)."""
    nodes = (
        node
        for module in graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    )
    for node in nodes:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        if node.op in ("call_method", "call_function") and name.split(".")[0] in HOST_READS:
            where = (node.stack_trace or "").strip().splitlines()[-2:]
            raise HostReadInStepError(
                f"the decoding step reads a tensor on the host ({name}), which a captured graph cannot "
                f"do; compute it before the step or keep it a tensor: {' | '.join(w.strip() for w in where)}"
            )


def checked_backend(backend, mode: str, device_type: str):
    """``torch.compile``'s backend for ``mode``, refusing host reads in every graph it compiles."""
    if backend == "inductor":
        if mode == "reduce-overhead" and device_type == "cuda":
            inner = torch._TorchCompileInductorWrapper("reduce-overhead", None, False)
        else:  # on CPU, "reduce-overhead" = inductor's C++ wrapper (no Python between kernels)
            inner = torch._TorchCompileInductorWrapper(None, {"cpp_wrapper": mode == "reduce-overhead"}, False)
    else:
        inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_checked(graph_module, example_inputs):
        refuse_host_reads(graph_module)
        return inner(graph_module, example_inputs)

    return compile_checked


def forward_row_bytes(
    cfg, query: int, keys: int, width: int, *, tp: int = 1, scores: bool = False, mlp_tensors: int = 4
) -> float:
    """Working bytes one row of an inference forward holds at its peak (no autograd: one layer's
    tensors alive at a time), for ``query`` tokens attending over ``keys`` positions of a model of
    shape ``cfg`` (a :class:`~.presets.DLLMConfig`) in activations of ``width`` bytes: the residual
    stream, its normed copy and the sublayer output added to it (``3 H`` per token) beside the
    larger of the attention's tensors (q, k, v and its output: ``(2 n_h + 2 n_g) d / tp`` per token,
    and with ``scores`` its ``n_h/tp x query x keys`` score matrix, which CPU SDPA materialises and
    fused GPU kernels do not) and the gated MLP's (gate and up ``2F``, the activation ``F``, their
    product ``F``: ``mlp_tensors F / tp`` per token, ``mlp_tensors = 3`` for a fused activation;
    ``F`` = top-k x the expert width for MoE). Measured on CPU (llada-tiny, fp32, with ``scores``;
    the peak of the live tensor bytes torch's profiler records, per row added, over
    :func:`decode_row_bytes`): 1.01x at 26 tokens (the sampler's per-position ids and masks, not
    counted), 0.91x at 88, 0.70x at 208 (``tests/test_decode_graphs.py``)."""
    heads, groups, head_dim = cfg.num_attention_heads / tp, cfg.num_query_groups / tp, cfg.kv_channels
    ffn = cfg.moe_ffn_hidden_size * cfg.moe_router_topk if cfg.num_experts else cfg.ffn_hidden_size
    attention = query * width * (3 * cfg.hidden_size + (2 * heads + 2 * groups) * head_dim)
    if scores:
        attention += width * heads * query * keys
    mlp = query * width * (3 * cfg.hidden_size + mlp_tensors * ffn / tp)
    return max(attention, mlp)


def decode_row_bytes(model, capacity: int, block: int, vocab: int, *, query: int, cached: bool) -> int:
    """Device bytes one decoded row costs while a batch decodes: its KV cache (``cached``: keys and
    values of ``capacity`` positions in every layer of this stage), the working memory of its largest
    forward (:func:`forward_row_bytes` of ``query`` tokens over ``capacity`` positions: LLaDA's full
    forwards run over the whole sequence, SDAR's prefill over the prompt; the score matrix counted
    on CPU), plus the sampler's transient per row (the block's logits and the float64 Gumbel/softmax
    work: ``width + 28`` bytes per vocabulary entry and block position, ``stabledrl plan``'s figure)."""
    width = torch.finfo(model.kv_cache_dtype()).bits // 8
    layers = model.kv_cache_layers()
    kv = sum(2 * groups * head_dim * capacity * width for groups, head_dim in layers.values()) if cached else 0
    on_cpu = _model_device(model).type == "cpu"
    tp = model.config.tensor_model_parallel_size
    work = forward_row_bytes(model.dllm_config, query, capacity, width, tp=tp, scores=on_cpu)
    return int(kv + work + block * vocab * (width + 28))


def decode_rows_for_memory(free_bytes: float, row_bytes: float, unit: int, limit: int) -> int:
    """The most rows, a multiple of ``unit`` (whole groups and micro-batches) and at most ``limit``
    rounded up to ``unit``, whose decoding memory (``row_bytes`` each) fits in ``free_bytes``; at
    least ``unit`` (the smallest decoding batch there is)."""
    cap = -(-max(limit, 1) // unit) * unit
    fits = int(free_bytes // max(row_bytes, 1)) // unit * unit
    return max(unit, min(cap, fits))


def free_decoding_memory(device: torch.device, share: float = 0.8) -> float:
    """Bytes a rollout may use for its KV cache: ``share`` of the free device memory on CUDA (what
    the weights, the optimizer and the allocator's cache leave), of the available host memory else."""
    if device.type == "cuda":
        return share * torch.cuda.mem_get_info(device)[0]
    return share * psutil.virtual_memory().available


_ALL_SLOTS: Dict[Tuple[int, str], Tensor] = {}


def _all_slots(length: int, device) -> Tensor:
    """``arange(length)`` on ``device``, one tensor per (length, device)."""
    key = (length, str(device))
    slots = _ALL_SLOTS.get(key)
    if slots is None:
        slots = _ALL_SLOTS[key] = torch.arange(length, device=device)
    return slots


@contextlib.contextmanager
def _compile_limits():
    """Dynamo's recompile limit raised to :data:`RECOMPILE_LIMIT` for the decoding forward, and
    an error instead of a silent eager fallback past it."""
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
        yield


def decoding_forward(model, compile: Union[str, DecodingForward] = "none") -> DecodingForward:
    """``model``'s :class:`DecodingForward` for ``compile`` (made once, kept on the model), or
    ``compile`` itself when it is one (of this model)."""
    if isinstance(compile, DecodingForward):
        if compile.model is not model:
            raise ValueError("the DecodingForward passed as compile belongs to another model")
        return compile
    held = model.__dict__.setdefault("_decoding_forwards", {})
    found = held.get(check_compile_mode(compile))
    if found is None:
        found = held[compile] = DecodingForward(model, compile)
    return found

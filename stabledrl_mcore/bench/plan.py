"""``stabledrl plan``: per-GPU memory and throughput of a layout, and which layouts fit.

Memory of the most loaded pipeline stage of one GPU (bytes; ``b_w`` = 2 for bf16
weights, 4 for fp32; ``b_a`` the activation dtype, the same):

- **weights** ``P_stage * b_w`` with ``P_stage = (L/pp) * P_layer + [first] V_p*H/tp + [last] (V_p*H/tp + H)``,
  ``P_layer = (H*hd*(nh + 2ng) + nh*hd*H + 3*H*F)/tp + 2H (+ 2hd qk-norm)`` (norms are replicated),
  ``V_p`` = vocabulary padded to a multiple of ``tp`` (Megatron's rule);
- **gradients** ``4 * P_stage``: Megatron DDP keeps fp32 ``main_grad`` buffers (``grad_reduce_in_fp32``);
- **optimizer** Adam: ``12 * P_stage`` with bf16 weights (fp32 master copy + m + v), ``8 * P_stage`` with
  fp32 weights; SGD: ``4 * P_stage`` (bf16 master copy) or 0; divided by DP with the distributed optimizer;
- **activations** of one micro-batch of ``T = micro_batch * seq_len`` tokens (``2 seq_len`` for the
  staircase layout), per token and layer (tensors autograd keeps for the backward)::

      te    : b_a * (4H + ((2nh + 2ng)*hd + 3F [+ (nh + ng)*hd qk-norm]) / tp)
      local : b_a * (6H + ((3nh + 2ng)*hd + 5F [+ (2nh + 5ng)*hd qk-norm]) / tp)

  ``te`` (GPU, Transformer Engine: fused norm+linear and SwiGLU, flash attention keeps q, k, v, out)
  is derived from what those kernels save; ``local`` (Megatron's local spec that CPU runs use) was
  counted with saved-tensor hooks and is checked against measured peaks by ``tests/test_plan.py``.
  Full recompute keeps ``b_a * H`` per token and layer, plus the larger of the LM head's tensors
  and one recomputed layer's activations (they are not alive at the same time); selective
  recompute drops the core-attention tensors (pipelining: see below); **head**: at TP = 1 the LM
  head's logits ``b_a * T_c * V`` (``T_c`` = the micro-batch's completion positions, the only ones
  the head runs on) and ``12 * V * f * T_s`` for the float32 log-softmax of the ``K = f * T_s``
  scored rows and its gradient (``f`` = scored fraction of the ``T_s`` sequence tokens); at TP > 1
  the logits stay vocab-sharded (the likelihood and the update never gather them,
  ``diffusion.likelihood.gather_log_probs``): ``b_a * T_c * V_p/tp`` and ``(4 + b_a) * (V_p/tp) * K``
  for the scored rows' ``[K, V_p/tp]`` selection plus the float32 working copy that Megatron's
  vocab-parallel cross-entropy turns in place into the softmax and then the gradient; both add
  ``3 * b_a * H * T`` (final norm, head input);
- **rollout KV cache** (SDAR's block decoding; LLaDA with ``--rollout-cache prefix|dual``):
  ``2 * (L/pp) * (ng/tp) * hd * b_a * seq_len * B_roll`` (``B_roll``: ``--decode-rows``, the rows one
  decoding forward holds: a multiple of ``lcm(--micro-batch, --group-size)``, that by default, as train's
  preflight counts it; ``decode_rows_fit`` is the most that fit beside the training state, what
  ``rollout.decode_rows`` may be set to),
  plus the sampler's transient logits ``B_roll * q * V * b_a`` (``q`` = a block: both samplers run the
  LM head on the decoded block only), ``28 * V`` bytes per decoded position of a block (float64
  Gumbel/softmax work) and the working memory of the largest decoding forward
  (:func:`~stabledrl_mcore.models.decoding.forward_row_bytes` per row, as a lower bound: no score
  matrix, a fused MLP activation; LLaDA's full forwards run over the sequence, SDAR's prefill over
  the prompt);
  under PP the transient is on *every* stage: the last stage's logits are broadcast to the others
  (full vocabulary, the samplers' ``gather_output``) and every stage runs the same sampler on them;
- **reference weights** (``--reference-model``, a KL penalty): a frozen copy, ``P_stage * b_w``; none
  with LoRA (``--lora-rank``: the reference is the base without adapters, and gradients and optimizer
  states cover the adapters only, :func:`~..models.lora.adapter_params_per_layer`);
- total = weights (+ reference) + gradients + optimizer + max(training peak, rollout KV cache + transient,
  likelihood broadcast) + ``overhead`` (CUDA context, communication buffers, fragmentation); training
  peak = activations + head (recompute: see above). Not modelled: the optimizer step's own temporaries
  (they do not coincide with activations) and allocator fragmentation beyond ``overhead``.

Pipeline parallelism (``pp > 1``; :mod:`stabledrl_mcore.engine.pipeline`). Every stage holds ``L/pp``
layers; the first adds the embedding, the last the LM head and the final norm (middle stages hold
neither and fewer micro-batches, so the first or the last is the most loaded). The likelihood and the
update pass every ``(draw, micro-batch)`` chunk as one pipeline micro-batch, ``m = num_mc * ceil(N/mb)``
of them per pass (``N`` = sequences per DP rank). Under 1F1B stage ``s`` holds the activations of
``min(pp - s, m)`` micro-batches (the first ``min(pp, m)``, the last one), and every stage but the last
also keeps the output it sent, ``b_a * H * T`` per micro-batch in flight, until that micro-batch's backward
(Megatron's ``deallocate_pipeline_outputs`` is off); the LM head's tensors exist on the last stage only.
The old-policy pass broadcasts each chunk's token log-probs from the last stage: ``8 * M * N * S`` bytes
(float32; the per-chunk results or the received copies, plus the assembled ``[M, N, S]`` tensor).

Mixture of experts (``num_experts`` E, top-k ``k``, expert width ``F_e``; ``--ep`` EP, ``--etp`` ETP =
TP by default; Megatron's expert grid ``world = PP x ETP x EP x EDP``). A layer's dense part (attention,
norms, the ``E x H`` router, replicated over TP) is split as above; its experts, ``3 H F_e`` each, over
EP x ETP: ``P_layer = (attention)/tp + 2H (+ 2hd) + E*H + E * 3*H*F_e / (EP * ETP)``. The fp32 gradient
buffer holds both; the distributed optimizer shards the dense part's states over DP and the experts'
over the expert-data-parallel size ``EDP = world / (PP * EP * ETP)`` (Megatron's separate expert
buffers). The MLP's activations become those of the ``k`` rows each token is dispatched to (on
average ``T k`` rows per GPU whatever EP): ``b_a * k * (H + 3 F_e/ETP)`` (``te``: grouped GEMM input,
fc1 output, fc2 input; ``local``: ``H + 6 F_e/ETP``, counted with saved-tensor hooks) plus the router's
``4E`` (fp32 scores) + ``E`` (routing map) + ``24 k`` bytes (top-k probabilities and indices, the
permutation's) per token. The all-to-all (EP > 1) moves ``2 * T * k * H * b_a`` bytes per layer and
micro-batch forward (dispatch + combine; ``(EP - 1)/EP`` of it crosses GPUs) and as much in the backward;
its time is not modelled. Model FLOPs count the active parameters (:mod:`stabledrl_mcore.bench.flops`).
EP > 1 needs PP = 1 (as the trainer's preflight refuses) and an MoE model.

Throughput: with ``R = gpus * peak * mfu`` model FLOP/s (FLOPs per token from
:mod:`stabledrl_mcore.bench.flops`), training (forward+backward) tokens/s = ``R * e_train / (3 F_fwd)``;
rollouts at ``rollout_mfu`` (rate ``R_roll * e_roll``) cost ``steps/gen * S * F_fwd(S)`` per generated
token for LLaDA (the whole sequence each step) and ``(steps_per_block + 1) * F_fwd(S/2)`` for SDAR (KV
cache); the step adds ``num_mc`` likelihood passes and ``inner`` updates (the second and later also
re-score). ``e = m / (m + pp - 1)`` is the share of a stage's time not lost to the pipeline bubble
``(pp - 1) / (m + pp - 1)`` of a pass of ``m`` micro-batches: ``m`` as above for the likelihood and the
update; for rollouts ``m = min(2 pp, B_roll)`` (LLaDA: the sampler's rows split into up to ``2 pp``
micro-batches) or ``1`` (SDAR: one micro-batch with the KV cache, so ``e_roll = 1/pp``).
``pipeline_idle`` = 1 - (the step's time without bubbles) / (its time with them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from stabledrl_mcore.bench.flops import forward_flops_per_token
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.checks import check_decode_rows, decode_rows_unit
from stabledrl_mcore.models.decoding import forward_row_bytes
from stabledrl_mcore.models.lora import adapter_params_per_layer
from stabledrl_mcore.parallel.bootstrap import ParallelLayoutError

GIB = 1024**3


@dataclass
class PlanSpec:
    """Everything the estimate depends on (the CLI flags)."""

    model: Any  # DLLMConfig
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    tp: int = 1
    pp: int = 1
    micro_batch: int = 2
    seq_len: int = 512
    gen_length: int = 256
    global_batch: int = 1024  # sequences per step (prompts x group size)
    recompute: str = "none"  # none | full | selective
    dtype: str = "bf16"
    optimizer: str = "adam"
    distributed_optimizer: bool = True
    likelihood: str = "elbo"  # elbo | staircase (2x tokens per training pass)
    impl: str = "te"  # te | local
    scored_fraction: Optional[float] = None
    overhead_gib: float = 4.0
    peak_tflops: float = 989.0
    mfu: float = 0.40
    rollout_mfu: float = 0.10
    rollout_steps: Optional[int] = None
    num_mc: int = 2
    inner_iterations: int = 2
    reference_model: bool = False  # a frozen copy of the policy for the KL penalty (algo.kl_coef > 0)
    lora_rank: int = 0  # model.lora.rank: only the adapters (all-linear) train; the reference is the base
    ep: int = 1  # expert parallel (MoE models)
    etp: Optional[int] = None  # expert tensor parallel (None = TP)
    decode_rows: Optional[int] = None  # rollout.decode_rows: rows per decoding forward (None = decode_rows_unit)
    group_size: int = 8  # rollout.group_size: completions per prompt (a decoding batch holds whole groups)
    rollout_cache: str = "none"  # LLaDA's rollout.cache (prefix | dual keep a KV cache; SDAR always does)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def validate(self) -> "PlanSpec":
        for name in (
            "nodes",
            "gpus_per_node",
            "tp",
            "pp",
            "micro_batch",
            "seq_len",
            "gen_length",
            "global_batch",
            "num_mc",
            "inner_iterations",
            "ep",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.gen_length > self.seq_len:
            raise ConfigError(f"--gen-length ({self.gen_length}) cannot exceed --seq-len ({self.seq_len})")
        for name, allowed in (
            ("recompute", ("none", "full", "selective")),
            ("dtype", ("bf16", "fp32")),
            ("optimizer", ("adam", "sgd")),
            ("likelihood", ("elbo", "staircase")),
            ("impl", ("te", "local")),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.gpu_memory_gib <= 0 or self.peak_tflops <= 0 or not 0 < self.mfu <= 1 or not 0 < self.rollout_mfu <= 1:
            raise ConfigError("--gpu-memory and --gpu-tflops must be > 0, --mfu and --rollout-mfu in (0, 1]")
        if self.etp is not None and self.etp < 1:
            raise ConfigError(f"--etp must be >= 1, got {self.etp}")
        if self.lora_rank < 0:
            raise ConfigError(f"--lora-rank must be >= 0 (0 = full-parameter training), got {self.lora_rank}")
        if self.group_size < 1:
            raise ConfigError(f"--group-size must be >= 1, got {self.group_size}")
        check_decode_rows(
            self.decode_rows,
            self.micro_batch,
            self.group_size,
            names=("--decode-rows", "--micro-batch", "--group-size"),
            sep=" ",
            unset="leave it out (that lcm, as train's preflight counts it)",
        )
        if self.rollout_cache not in ("none", "prefix", "dual"):
            raise ConfigError(f"--rollout-cache must be one of none, prefix, dual, got {self.rollout_cache!r}")
        return self

    @property
    def rollout_rows(self) -> int:
        """Rows per decoding forward: ``--decode-rows``, else the fewest a run can use (train's
        preflight's count, :func:`~stabledrl_mcore.config.checks.decode_rows_unit`)."""
        return self.decode_rows or decode_rows_unit(self.micro_batch, self.group_size)


def check_layout(spec: PlanSpec, tp: int, pp: int, ep: int = 1) -> Optional[str]:
    """Why ``tp x pp`` (experts: ``ep x etp``) cannot hold the model on ``spec.gpus`` GPUs (None if it can)."""
    m = spec.model
    if spec.gpus % (tp * pp):
        return f"{spec.gpus} GPUs are not divisible by TP x PP = {tp * pp}"
    if tp > spec.gpus_per_node:
        return f"TP {tp} spans nodes (gpus per node {spec.gpus_per_node})"
    if m.num_attention_heads % tp or m.num_query_groups % tp:
        return f"heads ({m.num_attention_heads}) / query groups ({m.num_query_groups}) not divisible by TP {tp}"
    if m.num_layers % pp:
        return f"layers ({m.num_layers}) not divisible by PP {pp}"
    return _expert_layout_problem(spec, tp, pp, ep)


def _expert_layout_problem(spec: PlanSpec, tp: int, pp: int, ep: int) -> Optional[str]:
    """The expert grid's rules (``parallel.bootstrap.validate_parallel_layout``, the trainer's preflight)."""
    m, etp = spec.model, spec.etp or tp
    if ep == 1 and spec.etp is None:
        return None
    if not m.is_moe:
        return f"--ep {ep} / --etp {spec.etp} need a mixture-of-experts model; this one is dense: drop them"
    if ep > 1 and pp > 1:
        return f"EP {ep} with PP {pp}: expert parallelism runs with PP = 1 (the trainer refuses it); set one to 1"
    if m.num_experts % ep:
        return f"num_experts ({m.num_experts}) not divisible by EP {ep}"
    if spec.gpus % pp == 0 and (spec.gpus // pp) % (etp * ep):
        return f"{spec.gpus} GPUs / PP {pp} not divisible by ETP x EP = {etp} x {ep}"
    return None


def layer_params(m, tp: int) -> float:
    """Parameters of one transformer layer's dense part on one TP rank (matmul weights split, norms and
    an MoE layer's router replicated); an MoE layer's experts: :func:`expert_layer_params`."""
    h, hd = m.hidden_size, m.kv_channels
    matmul = h * hd * (m.num_attention_heads + 2 * m.num_query_groups) + m.num_attention_heads * hd * h
    router = m.num_experts * h if m.is_moe else 0
    mlp = 0 if m.is_moe else 3 * h * m.ffn_hidden_size
    return (matmul + mlp) / tp + 2 * h + (2 * hd if m.qk_layernorm else 0) + router


def expert_layer_params(m, ep: int, etp: int) -> float:
    """Expert parameters of one MoE layer on one GPU: ``E * 3 H F_e / (EP x ETP)`` (0 for a dense model)."""
    return m.num_experts * 3 * m.hidden_size * m.moe_ffn_hidden_size / (ep * etp) if m.is_moe else 0.0


def activation_bytes_per_token_layer(
    spec: PlanSpec, tp: int, recompute: Optional[str] = None, etp: Optional[int] = None
) -> float:
    """Bytes autograd keeps per token and layer (see the module doc), no recompute."""
    m, b = spec.model, (2 if spec.dtype == "bf16" else 4)
    h, hd, nh, ng, f = m.hidden_size, m.kv_channels, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size
    if spec.impl == "te":
        rep, attn, mlp, qk = 4 * h, (2 * nh + 2 * ng) * hd, 3 * f, (nh + ng) * hd
    else:
        rep, attn, mlp, qk = 6 * h, (3 * nh + 2 * ng) * hd, 5 * f, (2 * nh + 5 * ng) * hd
    if (recompute or spec.recompute) == "selective":
        attn -= (2 * nh + 2 * ng) * hd  # q, k, v, out of the core attention are recomputed
    if m.is_moe:
        return b * (rep + (attn + (qk if m.qk_layernorm else 0)) / tp) + moe_activation_bytes_per_token(
            spec, etp or spec.etp or tp
        )
    return b * (rep + (attn + mlp + (qk if m.qk_layernorm else 0)) / tp)


def moe_activation_bytes_per_token(spec: PlanSpec, etp: int) -> float:
    """An MoE layer's MLP per token: its ``k`` dispatched rows and the router's tensors (module doc)."""
    m, b = spec.model, (2 if spec.dtype == "bf16" else 4)
    k, fe = m.moe_router_topk, m.moe_ffn_hidden_size
    rows = k * (m.hidden_size + (3 if spec.impl == "te" else 6) * fe / etp)
    return b * rows + 5 * m.num_experts + 24 * k


def all_to_all_bytes(spec: PlanSpec, ep: int) -> float:
    """All-to-all bytes one GPU sends and receives per layer and micro-batch forward (dispatch + combine)."""
    if ep == 1:
        return 0.0
    tokens = spec.micro_batch * spec.seq_len * (2 if spec.likelihood == "staircase" else 1)
    return 2.0 * tokens * spec.model.moe_router_topk * spec.model.hidden_size * (2 if spec.dtype == "bf16" else 4)


def _scored_fraction(spec: PlanSpec) -> float:
    if spec.scored_fraction is not None:
        return spec.scored_fraction
    return 0.5 * spec.gen_length / spec.seq_len  # half the completion is masked on average


def pipeline_micro_batches(spec: PlanSpec, dp: int) -> int:
    """``m`` of a likelihood or update pass: its ``(draw, micro-batch)`` chunks on one DP rank."""
    per_rank_seqs = max(spec.global_batch // dp, 1)
    return spec.num_mc * -(-per_rank_seqs // spec.micro_batch)


def rollout_micro_batches(spec: PlanSpec, pp: int) -> int:
    """Pipeline micro-batches of one sampler call: SDAR's KV cache keeps one; LLaDA's rows split in up to 2 pp."""
    return 1 if spec.model.arch == "sdar" else min(2 * pp, spec.micro_batch)


def estimate(
    spec: PlanSpec,
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    recompute: Optional[str] = None,
    ep: Optional[int] = None,
) -> Dict[str, Any]:
    """Per-GPU memory (bytes, worst pipeline stage) and job throughput of one layout."""
    tp, pp, ep = tp or spec.tp, pp or spec.pp, ep or spec.ep
    recompute = recompute or spec.recompute
    why = check_layout(spec, tp, pp, ep)
    if why:
        raise ParallelLayoutError(f"invalid layout TP {tp} x PP {pp}" + (f" x EP {ep}" if ep > 1 else "") + f": {why}")
    m = spec.model
    dp = spec.gpus // (tp * pp)
    etp = spec.etp or tp
    edp = spec.gpus // (pp * ep * etp)
    bw = 2 if spec.dtype == "bf16" else 4
    vpad = m.padded_vocab_size(tp)
    emb = vpad * m.hidden_size / tp
    per_stage_layers = m.num_layers // pp
    body = per_stage_layers * layer_params(m, tp)
    experts = per_stage_layers * expert_layer_params(m, ep, etp)
    # (name, parameters, is the last stage); middle stages never exceed the first (see the module doc)
    stages = [("first", body + emb + (emb + m.hidden_size if pp == 1 else 0), pp == 1)]
    if pp > 1:
        stages.append(("last", body + emb + m.hidden_size, True))
    opt_bytes = {("adam", "bf16"): 12, ("adam", "fp32"): 8, ("sgd", "bf16"): 4, ("sgd", "fp32"): 0}[
        (spec.optimizer, spec.dtype)
    ]
    shard, expert_shard = (dp, edp) if spec.distributed_optimizer else (1, 1)
    tokens = spec.micro_batch * spec.seq_len * (2 if spec.likelihood == "staircase" else 1)
    per_rank_seqs = max(spec.global_batch // dp, 1)
    micro_batches = pipeline_micro_batches(spec, dp)
    full = activation_bytes_per_token_layer(spec, tp, recompute, etp)
    if recompute == "full":
        per_layer_kept, extra_layer = bw * m.hidden_size, full * tokens
    else:
        per_layer_kept, extra_layer = full, 0.0
    frac = _scored_fraction(spec)
    head_rows = spec.micro_batch * spec.gen_length  # the head runs on the completion's positions only
    if tp > 1:  # vocab-sharded logits, Megatron's vocab-parallel cross-entropy on the K scored rows
        width = vpad / tp  # this rank's vocabulary columns
        logits = bw * head_rows * width + (4 + bw) * width * frac * spec.micro_batch * spec.seq_len
    else:  # gathered logits, a float32 log-softmax of the K scored rows (+ its gradient)
        logits = bw * head_rows * m.vocab_size + 12 * m.vocab_size * frac * spec.micro_batch * spec.seq_len
    head = logits + 3 * bw * m.hidden_size * tokens
    block = m.block_size or 32
    cached = m.arch == "sdar" or spec.rollout_cache != "none"
    kv_row = 2 * per_stage_layers * (m.num_query_groups / tp) * m.kv_channels * bw * spec.seq_len if cached else 0.0
    q = min(block, spec.gen_length)  # both samplers run the LM head on the decoded block only
    # the largest decoding forward: LLaDA's over the whole sequence, SDAR's prefill over the prompt
    query = spec.seq_len if m.arch == "llada" else max(spec.seq_len - spec.gen_length, q)
    forward = forward_row_bytes(m, query, spec.seq_len, bw, tp=tp, scores=False, mlp_tensors=3)
    tmp_row = q * m.vocab_size * bw + 28 * m.vocab_size * q + forward
    kv, rollout_tmp = kv_row * spec.rollout_rows, tmp_row * spec.rollout_rows
    logprob_broadcast = 8.0 * spec.num_mc * per_rank_seqs * spec.seq_len if pp > 1 else 0.0
    worst, stage_totals = None, {}
    for name, dense, last in stages:
        params = dense + experts
        in_flight = min(pp, micro_batches) if name == "first" else 1
        act = in_flight * per_stage_layers * per_layer_kept * tokens
        sent = in_flight * bw * m.hidden_size * tokens if not last else 0.0  # outputs kept for the backward
        stage_head = head if last else 0.0
        lora = per_stage_layers * adapter_params_per_layer(m, tp, spec.lora_rank) if spec.lora_rank else 0.0
        trained = lora if spec.lora_rank else params  # LoRA: gradients and optimizer states of the adapters only
        row = {
            "stage": name,
            "params": params + lora,
            "weights": (params + lora) * bw,
            "reference_weights": params * bw if spec.reference_model and not spec.lora_rank else 0.0,
            "gradients": trained * 4.0,
            "expert_params": experts,
            "optimizer": (
                lora * opt_bytes / shard
                if spec.lora_rank
                else dense * opt_bytes / shard + experts * opt_bytes / expert_shard
            ),
            "activations": act + sent + extra_layer,
            "head": stage_head,
            "in_flight": in_flight,
            "pipeline_outputs": sent,
            "rollout_kv_cache": kv,
            "rollout_transient": rollout_tmp,
            "likelihood_peak": logprob_broadcast,
            "overhead": spec.overhead_gib * GIB,
            "recomputed_layer": extra_layer,
        }
        # the recomputed layer lives only while its backward runs, after the head's tensors are gone
        kept = act + sent
        row["training_peak"] = kept + max(stage_head, extra_layer) if extra_layer else kept + stage_head
        row["rollout_peak"] = row["rollout_kv_cache"] + row["rollout_transient"]
        # rows per decoding forward the memory beside the training state holds (whole micro-batches)
        state = row["weights"] + row["reference_weights"] + row["gradients"] + row["optimizer"] + row["overhead"]
        free = spec.gpu_memory_gib * GIB - state
        unit = decode_rows_unit(spec.micro_batch, spec.group_size)  # whole groups and micro-batches
        row["decode_rows_fit"] = int(free // (kv_row + tmp_row)) // unit * unit
        row["total"] = (
            row["weights"]
            + row["reference_weights"]
            + row["gradients"]
            + row["optimizer"]
            + max(row["training_peak"], row["rollout_peak"], row["likelihood_peak"])
            + row["overhead"]
        )
        stage_totals[name] = row["total"]
        if worst is None or row["total"] > worst["total"]:
            worst = row
    a2a = all_to_all_bytes(spec, ep)
    out = dict(
        worst,
        tp=tp,
        pp=pp,
        dp=dp,
        ep=ep,
        etp=etp,
        edp=edp,
        all_to_all_layer_bytes=a2a,
        recompute=recompute,
        micro_batches=micro_batches,
        rollout_micro_batches=rollout_micro_batches(spec, pp),
        stage_totals=stage_totals,
        fits=worst["total"] <= spec.gpu_memory_gib * GIB,
    )
    out.update(_throughput(spec, pp, micro_batches, out["rollout_micro_batches"]))
    out["all_to_all_step_bytes"] = a2a / spec.micro_batch * per_rank_seqs * out["a2a_passes_per_seq"] * m.num_layers
    return out


def _throughput(spec: PlanSpec, pp: int, micro_batches: int, rollout_micro_batches: int) -> Dict[str, float]:

    m, s = spec.model, spec.seq_len
    t_train = s * (2 if spec.likelihood == "staircase" else 1)
    f_train = forward_flops_per_token(m, t_train) * t_train  # one pass over one sequence
    bubble = micro_batches / (micro_batches + pp - 1)
    rollout_bubble = rollout_micro_batches / (rollout_micro_batches + pp - 1)
    ideal = spec.gpus * spec.peak_tflops * 1e12 * spec.mfu
    rate = ideal * bubble
    ideal_rollout = spec.gpus * spec.peak_tflops * 1e12 * spec.rollout_mfu
    rollout_rate = ideal_rollout * rollout_bubble
    if m.arch == "llada":
        steps = spec.rollout_steps or max(spec.gen_length // 2, 1)
        per_gen = steps / spec.gen_length * s * forward_flops_per_token(m, s)
        rollout_tokens = steps * s  # query tokens the sampler runs per sequence
    else:
        steps = spec.rollout_steps or 4
        per_gen = (steps + 1) * forward_flops_per_token(m, s // 2)
        rollout_tokens = (steps + 1) * spec.gen_length
    inner, mc = spec.inner_iterations, spec.num_mc
    # all-to-all volume of a sequence's step in training passes (a backward moves as much as its forward)
    a2a_passes = rollout_tokens / t_train + mc * (1 + 2 * inner + (inner - 1))
    update = mc * f_train * (1 + 3 * inner + (inner - 1))  # old-policy pass, fwd+bwd, re-scoring
    seconds_per_seq = spec.gen_length * per_gen / rollout_rate + update / rate
    without_bubbles = spec.gen_length * per_gen / ideal_rollout + update / ideal
    return {
        "train_tokens_per_s": rate / (3 * f_train) * s,
        "rollout_tokens_per_s": rollout_rate / per_gen,
        "step_tokens_per_s": s / seconds_per_seq,
        "bubble_efficiency": bubble,
        "rollout_bubble_efficiency": rollout_bubble,
        "pipeline_idle": 1 - without_bubbles / seconds_per_seq,
        "a2a_passes_per_seq": a2a_passes,
    }


def all_layouts(spec: PlanSpec) -> List[Dict[str, Any]]:
    """Every valid (TP, PP) on ``spec.gpus`` GPUs (MoE: x EP), with and without full recompute."""
    rows = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= spec.gpus_per_node]
    pps = [p for p in range(1, spec.model.num_layers + 1) if spec.model.num_layers % p == 0]
    m = spec.model
    eps = [e for e in range(1, m.num_experts + 1) if m.num_experts % e == 0] if m.is_moe else [1]
    for tp in tps:
        for pp in pps:
            for ep in eps:
                if check_layout(spec, tp, pp, ep):
                    continue
                est = estimate(spec, tp, pp, ep=ep)
                alt = "full" if spec.recompute != "full" else "none"
                other = estimate(spec, tp, pp, alt, ep=ep)
                rows.append(dict(est, alternative={"recompute": alt, "total": other["total"], "fits": other["fits"]}))
    return rows


def layout_key(row: Dict[str, Any]) -> tuple:
    """``(TP, PP, EP)`` of an estimate row."""
    return row["tp"], row["pp"], row.get("ep", 1)


def format_plan(spec: PlanSpec, chosen: Dict[str, Any], rows: List[Dict[str, Any]]) -> str:
    g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    m = spec.model
    moe = m.is_moe
    active = (
        f" ({m.num_active_parameters() / 1e9:.2f}B active: {m.num_experts} experts, top-{m.moe_router_topk})"
        if moe
        else ""
    )
    lines = [
        f"{m.arch} {m.num_parameters() / 1e9:.2f}B params{active}, {spec.nodes} node(s) x {spec.gpus_per_node} GPUs "
        f"({spec.gpu_memory_gib:g} GiB), {spec.dtype}, micro-batch {spec.micro_batch} x {spec.seq_len} tokens"
        f" ({spec.likelihood}), recompute {spec.recompute}, {spec.impl} kernels, optimizer {spec.optimizer}"
        f"{' (distributed)' if spec.distributed_optimizer else ''}",
        f"layout TP {chosen['tp']} x PP {chosen['pp']} x DP {chosen['dp']}"
        + (f" x EP {chosen['ep']} (ETP {chosen['etp']}, expert DP {chosen['edp']})" if moe else "")
        + f" -- per GPU ({chosen['stage']} stage), GiB:",
        f"  weights {g(chosen['weights'])}"
        + (f" (experts {g(chosen['expert_params'] * chosen['weights'] / chosen['params'])})" if moe else "")
        + (f"  reference {g(chosen['reference_weights'])}" if spec.reference_model else "")
        + f"  gradients {g(chosen['gradients'])}  optimizer "
        f"{g(chosen['optimizer'])}  activations {g(chosen['activations'])}  LM head {g(chosen['head'])}  "
        f"rollout KV cache {g(chosen['rollout_kv_cache'])} (+{g(chosen['rollout_transient'])} transient, "
        f"{spec.rollout_rows} rows per decoding forward)  overhead {g(chosen['overhead'])}",
        f"  decoding rows that fit beside the training state: {max(chosen['decode_rows_fit'], 0)} "
        f"(rollout.decode_rows; unset, a run picks its own from the free memory at its first rollout)",
        f"  total {g(chosen['total'])} GiB of {spec.gpu_memory_gib:g}: {'fits' if chosen['fits'] else 'does NOT fit'}",
        f"  estimated tokens/s (mfu {spec.mfu:g}, rollout mfu {spec.rollout_mfu:g}, peak "
        f"{spec.peak_tflops:g} TFLOP/s): training {chosen['train_tokens_per_s']:.0f}, rollout "
        f"{chosen['rollout_tokens_per_s']:.0f} generated, whole step {chosen['step_tokens_per_s']:.0f}",
        *_pipeline_lines(chosen, g),
        *_expert_lines(spec, chosen, g),
        "",
        f"{'TP':>3}{'PP':>4}{'DP':>5}"
        + (f"{'EP':>4}" if moe else "")
        + f"{'weights':>9}{'grads':>8}{'optim':>8}{'activ.':>8}{'total':>8}"
        f"{'fits':>6}{'alt total':>11}{'step tok/s':>12}{'stage':>7}{'idle':>6}" + (f"{'a2a MiB':>9}" if moe else ""),
    ]
    for r in rows:
        alt = r["alternative"]
        mark = " <" if layout_key(r) == layout_key(chosen) else ""
        piped = r["pp"] > 1
        idle = f"{100 * r['pipeline_idle']:.0f}%" if piped else "-"
        a2a = f"{r['all_to_all_layer_bytes'] / 2**20:>9.1f}" if moe else ""
        lines.append(
            f"{r['tp']:>3}{r['pp']:>4}{r['dp']:>5}"
            + (f"{r['ep']:>4}" if moe else "")
            + f"{g(r['weights']):>9}{g(r['gradients']):>8}"
            f"{g(r['optimizer']):>8}{g(r['training_peak']):>8}{g(r['total']):>8}"
            f"{'yes' if r['fits'] else 'no':>6}{g(alt['total']) + ('*' if alt['fits'] else ''):>11}"
            f"{r['step_tokens_per_s']:>12.0f}{r['stage'] if piped else '-':>7}{idle:>6}{a2a}{mark}"
        )
    alt = rows[0]["alternative"]["recompute"] if rows else "full"
    lines.append(
        f"(GiB per GPU; 'alt total' = with recompute {alt}, * = fits; < = the requested layout; PP > 1: "
        f"pipelined, totals of the most loaded 'stage', 'idle' = the step's pipeline-bubble share"
        + ("; 'a2a MiB' = all-to-all per layer and micro-batch forward, per GPU, time not modelled)" if moe else ")")
    )
    return "\n".join(lines)


def _expert_lines(spec: PlanSpec, est: Dict[str, Any], g) -> List[str]:
    """The expert layout's share of one estimate (nothing for a dense model)."""
    if not spec.model.is_moe:
        return []
    ep = est["ep"]
    line = (
        f"  experts: {spec.model.num_experts // ep} of {spec.model.num_experts} per GPU (EP {ep} x ETP "
        f"{est['etp']}), optimizer states sharded over DP {est['dp']} (dense) and expert DP {est['edp']}"
    )
    if ep > 1:
        line += (
            f"; all-to-all {est['all_to_all_layer_bytes'] / 2**20:.1f} MiB per layer and micro-batch "
            f"forward (as much backward), {g(est['all_to_all_step_bytes'])} GiB per GPU per step, "
            f"{100 * (ep - 1) / ep:.0f}% of it across GPUs (its time is not modelled)"
        )
    return [line]


def _pipeline_lines(est: Dict[str, Any], g) -> List[str]:
    """The pipeline's share of one layout's estimate (nothing at PP = 1)."""
    if est["pp"] == 1:
        return []
    stages = ", ".join(f"{name} {g(total)}" for name, total in est["stage_totals"].items())
    held = min(est["pp"], est["micro_batches"])
    return [
        f"  pipeline PP {est['pp']}: GiB per stage {stages}; 1F1B holds {held} of {est['micro_batches']} "
        f"micro-batches on the first stage; {est['rollout_micro_batches']} micro-batch(es) per sampler call; "
        f"bubble efficiency training {est['bubble_efficiency']:.2f}, rollout "
        f"{est['rollout_bubble_efficiency']:.2f}; stages idle {100 * est['pipeline_idle']:.0f}% of the step"
    ]


def spec_for_run(cfg, mcfg, world: int, *, gpu_memory_gib: float, impl: str) -> PlanSpec:
    """The :class:`PlanSpec` of a run config (``RunConfig`` ``cfg``, model shape ``mcfg``) on ``world``
    ranks, as the preflight's memory check uses it: a lower bound of what one rank holds. The
    sequence is ``rollout.gen_length`` tokens (the prompt, unknown before the data is tokenised, adds to
    it), no ``overhead``, and a decoding forward holds the fewest rows a run can use: ``rollout.decode_rows``,
    else ``lcm(parallel.micro_batch_size, rollout.group_size)`` (whole groups and micro-batches)."""
    p, r, a = cfg.parallel, cfg.rollout, cfg.algo
    return PlanSpec(
        model=mcfg,
        nodes=1,
        gpus_per_node=world,
        gpu_memory_gib=gpu_memory_gib,
        tp=p.tensor_parallel,
        pp=p.pipeline_parallel,
        ep=p.expert_parallel,
        etp=p.expert_tensor_parallel,
        micro_batch=p.micro_batch_size,
        decode_rows=r.decode_rows,
        group_size=r.group_size,
        rollout_cache=r.cache if mcfg.arch == "llada" else "none",
        seq_len=r.gen_length,
        gen_length=r.gen_length,
        global_batch=r.generated_prompts * r.group_size,
        recompute="full" if cfg.model.recompute else "none",
        dtype="fp32" if cfg.model.dtype == "fp32" else "bf16",
        optimizer="sgd" if cfg.optim.name == "sgd" else "adam",
        distributed_optimizer=cfg.optim.distributed,
        likelihood="staircase" if a.likelihood == "staircase" else "elbo",
        impl=impl,
        overhead_gib=0.0,
        num_mc=a.num_mc,
        inner_iterations=a.inner_iterations,
        reference_model=a.kl_coef > 0,
        lora_rank=cfg.model.lora.rank,
    ).validate()

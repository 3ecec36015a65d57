"""Typed run configuration: one dataclass per concern, YAML + dotted overrides.

A run is described by :class:`RunConfig`; each section is documented field by
field. Load with :func:`load_config` (``YAML file`` + ``["algo.eps=0.1", ...]``),
validated once; :func:`save_config` writes the resolved config that is stored
beside every checkpoint. Unknown keys name the closest valid ones; wrong types
name the field and the expected type.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.checks import validate_run_config
from stabledrl_mcore.config.io import apply_overrides, from_dict, to_dict


@dataclass
class LoRASection:
    """LoRA adapters on the Megatron linears (``stabledrl_mcore/models/lora.py``, PEFT's semantics):
    only the adapters train, checkpoints hold only them, the KL reference is the base without them."""

    rank: int = 0
    """Adapter rank r; 0 = off (every parameter trains)."""
    alpha: float = 16.0
    """Scale numerator: the update is ``(alpha / rank) B A x`` (PEFT's ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapter input in forwards that record a graph (PEFT's ``lora_dropout``)."""
    targets: List[str] = field(default_factory=lambda: ["all-linear"])
    """Projections that get an adapter, each its own: any of ``q_proj k_proj v_proj o_proj gate_proj
    up_proj down_proj`` (LLaDA's ``attn_out`` / ``ff_proj`` / ``ff_out`` are ``o_proj`` / ``gate_proj``
    / ``down_proj``), or ``[all-linear]``."""


@dataclass
class ModelSection:
    """Which backbone to train and where its weights come from."""

    preset: str = "llada-tiny"
    """Architecture preset (``stabledrl_mcore.models.available_presets()``), e.g. ``llada-8b``."""
    overrides: Dict[str, Any] = field(default_factory=dict)
    """Fields of the preset's ``DLLMConfig`` to replace, e.g. ``{num_layers: 2}``."""
    checkpoint: Optional[str] = None
    """A converted Megatron checkpoint or a Hugging Face directory to start from; None = random init."""
    tokenizer: Optional[str] = None
    """Tokenizer directory (HF ``tokenizer.json`` or sentencepiece ``*.model``); None = beside the checkpoint."""
    dtype: str = "fp32"
    """Parameter/compute dtype: ``fp32`` or ``bf16`` (bf16 is the GPU default in the 8B recipes)."""
    recompute: bool = False
    """Full activation recompute of every transformer layer (saves memory, costs ~30% compute)."""
    lora: LoRASection = field(default_factory=LoRASection)
    """LoRA instead of full-parameter training (``rank > 0``); see :class:`LoRASection`."""


@dataclass
class ParallelSection:
    """How the job is laid out over ranks. Data-parallel size = world / (TP x PP)."""

    tensor_parallel: int = 1
    """Tensor-parallel size (heads, query groups and vocab must divide by it)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (layers must divide by it)."""
    expert_parallel: int = 1
    """Expert-parallel size of a mixture-of-experts model: its experts are split over this many ranks
    of the data-parallel dimension (``num_experts`` and world / PP / expert_tensor_parallel must divide
    by it); tokens travel to their experts by all-to-all. 1 = every rank holds every expert."""
    expert_tensor_parallel: Optional[int] = None
    """Tensor-parallel size inside each expert; None = ``tensor_parallel`` (Megatron's default)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward micro-batch on one rank."""
    backend: str = "auto"
    """``auto`` (NCCL with CUDA, gloo without), ``nccl`` or ``gloo``."""
    timeout_minutes: int = 30
    """Collective time-out before a stuck job fails."""
    threads: Optional[int] = None
    """torch intra-op threads per rank (None = torch's default). 1 is fastest for tiny CPU models."""
    seed: int = 1234
    """Base seed; pipeline stages offset it, TP ranks get distinct dropout streams."""
    retain_update_graph: bool = False
    """Inner iterations after the first keep their scoring forward's graph for the backward
    instead of scoring without gradients and running the forward again: one forward less per
    iteration, but activations of the whole rank batch x ``algo.num_mc`` are held at once."""


@dataclass
class RolloutSection:
    """Prompt sampling and generation (phase 1 of a step)."""

    task: str = "sudoku"
    """Task name (``stabledrl_mcore.tasks.available_tasks()``)."""
    data_path: Optional[str] = None
    """Local data for file-backed tasks (qa, GSM8K, MATH500, AIME): a JSONL/JSON/parquet/CSV file, a
    ``save_to_disk`` folder or a folder of ``<split>.<ext>`` files (docs/data.md)."""
    data_seed: Optional[int] = None
    """Seed of generated prompt pools (Sudoku, Countdown); None = ``parallel.seed``."""
    prompt_style: str = "chat"
    """``chat`` (system prompt + the tokenizer's chat template) or ``compact`` (bare puzzle, tiny models)."""
    task_options: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task, e.g. ``{blanks: [6, 10], solved_bonus: 1.0}`` for sudoku."""
    prompts_per_step: int = 16
    """Prompts per optimizer step over the whole job (split over data-parallel ranks)."""
    group_size: int = 8
    """Completions per prompt (G)."""
    gen_length: int = 64
    """New tokens per completion (LLaDA: a whole number of ``block_length`` blocks)."""
    steps: int = 32
    """Diffusion denoising steps: LLaDA over the whole completion (a multiple of the number of
    blocks, ``gen_length / block_length``), SDAR per block."""
    block_length: int = 32
    """Semi-autoregressive block length (LLaDA, divides ``gen_length``); SDAR: the model's own
    ``block_size`` (4 for SDAR-8B), checked at preflight."""
    temperature: float = 0.9
    """Gumbel sampling temperature; 0 = greedy."""
    threshold: Optional[float] = None
    """Confidence threshold (e.g. 0.9); None = fixed schedule. SDAR: upstream's dynamic rule; LLaDA:
    Fast-dLLM's parallel decoding (every masked position of the block at or above it, at least the
    scheduled count, a block ends once decoded)."""
    cache: str = "none"
    """LLaDA rollouts: ``none`` (exact: a full forward per step), ``prefix`` or ``dual`` (Fast-dLLM's
    approximate KV cache of the prompt and earlier blocks, and of the later blocks too; refreshed at
    each block's first step). The likelihood phases always score with exact attention, so with a
    cache the sampling policy differs slightly from the scored one. SDAR always uses its own cache."""
    compile: str = "none"
    """How rollouts (and ``eval.every``'s held-out decoding) run the model's decoding forwards: ``none``
    (eager), ``default`` (each kind of forward -- LLaDA's full step, cache fill, cached block step;
    SDAR's block step and store step -- compiled once by ``torch.compile(fullgraph=True)``, one graph
    for every block) or ``reduce-overhead`` (those graphs replayed as CUDA graphs on GPU; inductor's
    C++ wrapper on CPU). Graphs are compiled at the first rollout of each shape, and its seconds are
    logged (``rollout_compile_s``). The model then uses the local layer spec (Transformer Engine's
    modules are not captured). Refused with tensor or pipeline parallelism and with mixture-of-experts
    models. See docs/performance.md."""
    compile_cache_dir: Optional[str] = None
    """With ``rollout.compile`` set: where inductor keeps what it compiled (kernels, graphs; torch's
    ``TORCHINDUCTOR_CACHE_DIR``, which this replaces for the run). None = ``<logging.run_dir>/inductor-cache``,
    so a requeued or resumed job reuses it (measured 4-6 s per graph warm against 20-130 s cold on a
    CPU, docs/performance.md). Refused with ``rollout.compile=none`` (nothing would be compiled)."""
    decode_rows: Optional[int] = None
    """Rollout rows (whole groups) decoded together by one forward, independent of
    ``parallel.micro_batch_size``; a multiple of ``lcm(micro_batch_size, group_size)`` (a decoding batch
    ends on a group and a micro-batch boundary). None = chosen at the first rollout from the memory
    left for decoding (a row's forward working memory and KV cache, ``models/decoding.py::decode_row_bytes``)
    and logged; one micro-batch when not even one such unit fits."""
    cache_gap_every: int = 0
    """With ``rollout.cache`` set: every N steps the rollout also runs the exact forward at each cached
    step and logs ``rollout_cache_gap``, the mean |log p_cached - log p_exact| of the committed tokens
    (how far the sampling policy is from the scored one); costs the exact sampler's work on those
    steps. 0 = never."""
    filter_uniform_groups: bool = False
    """Dynamic sampling (DAPO): drop every prompt group whose ``group_size`` rewards are all equal
    (its advantages are all 0: no policy gradient) before the old-policy scoring and the update,
    which then average over the kept groups only. Decided over the whole job, so the kept groups do
    not depend on the data-parallel split; ``groups_kept`` logs the kept share. A step that keeps
    no group makes no optimizer update (the LR schedule still advances); see
    ``rl/dynamic_sampling.py``. Needs ``algo.kl_coef: 0`` (a dropped group still has a KL gradient)."""
    oversample_prompts: int = 0
    """With ``filter_uniform_groups``: extra prompts generated per step (the total must split over
    data-parallel ranks like ``prompts_per_step``); the first ``prompts_per_step`` groups with
    differing rewards, in prompt-stream order, are trained on (DAPO's refill, in one round)."""
    system_prompt: Optional[str] = None
    """System prompt of every rollout, eval and generate prompt; None = the task's own, "" = none."""
    prompt_template: str = "{question}"
    """The user turn: ``{question}`` is replaced by the example's question (nothing else is)."""
    chat_template: Optional[str] = None
    """A Jinja chat template file used instead of the tokenizer's (checked at preflight); None = the
    tokenizer's own, or the plain ``Question: ... Answer:`` fallback when it has none."""
    prompt_key: Optional[str] = None
    """File-backed tasks: the column holding the question (None = the task's own: ``prompt`` for
    ``qa``, ``question`` for GSM8K, ...); see docs/data.md."""
    answer_key: Optional[str] = None
    """File-backed tasks: the column holding the reference answer (None = the task's own, ``answer``)."""
    split: str = "train"
    """Split trained on: a ``<split>.<ext>`` file of a ``rollout.data_path`` folder (or of the task's
    data root), or a split of a ``save_to_disk`` DatasetDict; a ``data_path`` file is read whatever it is."""
    reward_fn: Optional[str] = None
    """Your reward, ``path/to/file.py:function`` or ``package.module:function``, called as
    ``fn(completion, reference) -> float`` instead of the task's reward (docs/data.md)."""
    reward_timeout_s: float = 10.0
    """Time limit of one ``reward_fn`` call; a call past it scores 0 and counts in ``reward_errors``."""
    reward_isolation: str = "process"
    """Where ``reward_fn`` runs: ``process`` (a worker process per rank, killed and restarted when a
    call overruns its limit, so the limit always holds) or ``thread`` (in the rank itself, under a
    ``SIGALRM`` deadline a function can outlive); see docs/data.md."""
    reward_workers: Optional[int] = None
    """``reward_fn`` calls in flight at once per rank (each under its own ``reward_timeout_s``;
    ``process``: that many worker processes): a step's rewards are scored by this pool, in sample
    order, so a function that hangs on every call costs one limit per this many samples, not one
    per sample. None = min(8, CPUs the rank may use); 1 = one call at a time in the training
    thread (``thread`` mode's ``SIGALRM`` deadline). Module-level state of your file is per worker."""
    max_reward_error_frac: float = 0.5
    """A step whose share of failed reward calls (``reward_errors`` / samples, over all data-parallel
    ranks together: a call that raised, timed out or returned no finite number, scored 0) exceeds
    this ends the run with ``RewardErrorsError`` (exit 1) naming the share and the first failure,
    instead of training on zeros. In (0, 1]; 1 = never stop. Not a skipped update."""

    @property
    def generated_prompts(self) -> int:
        """Prompts generated per step over the whole job: ``prompts_per_step + oversample_prompts``."""
        return self.prompts_per_step + self.oversample_prompts


@dataclass
class AlgorithmSection:
    """The policy-gradient update (phases 2-4)."""

    loss: str = "stabledrl"
    """Registered policy loss: ``stabledrl``, ``stabledrl_released``, ``grpo``, ``espo``, ``spg``
    (sequence level) or ``diffu_grpo`` (d1's token level; needs ``likelihood: mean_field``)."""
    loss_options: Dict[str, Any] = field(default_factory=dict)
    """The loss's own keyword options, checked against its signature: ``{log_weight_cap: 1.609}``
    (stabledrl_released), ``{aggregation: length_weighted}`` (spg), ``{aggregation:
    global_token_mean}`` (diffu_grpo)."""
    eps: float = 0.2
    """Clipping range of the importance ratio, [1 - eps, 1 + eps]."""
    advantage: str = "center"
    """Group advantage: ``center`` (r - mean, as released), ``zscore`` ((r - mean) / std) or
    ``leave_one_out`` (r_i - mean of the others, RLOO / ESPO); see ``rl/advantages.py``."""
    inner_iterations: int = 2
    """Policy updates (mu) per rollout batch."""
    likelihood: str = "elbo"
    """Sequence log-likelihood proxy: ``elbo``, ``mean_field``, ``spg`` (ELBO/EUBO), ``staircase`` (SDAR)."""
    num_mc: int = 2
    """Monte-Carlo masks per likelihood evaluation."""
    mask_sampling: str = "fresh"
    """``fresh``: independent masks for the old-policy estimate and for every inner iteration
    (the StableDRL release's ``random_masking``: ratios are noisy estimates even at the first
    iteration); ``replay``: one mask plan per rollout batch for the old policy and every
    iteration (common random numbers, LLaDA-1.5's VRPO: the first ratio is exactly 1);
    ``per_iteration``: iteration k replays its own plan, drawn and scored for the old policy
    at rollout time (d1's per-iteration mask seeds)."""
    mask_scheme: str = "uniform"
    """Masks of the ``elbo``/``spg`` estimators: ``uniform`` (a uniform count over the
    completion) or ``block_random`` (SPG and the release: one random block partly masked,
    every later position masked, earlier positions with ``prefix_mask_prob``; blocks of
    ``rollout.block_length``). ``mean_field`` always masks the whole completion, ``staircase``
    draws a count per block."""
    staircase_t: str = "per_block"
    """Masks of the ``staircase`` likelihood: ``per_block`` (a uniform count drawn for each block,
    weight L_b/l_b) or ``per_sequence`` (SDAR's own training objective, ``modeling_sdar.py``: one
    t per sequence shared by its blocks, each token masked with p = eps + (1 - eps) t, weight
    1/p; not with ``coupled_masks``). Both unbiased; variances in docs/algorithms.md."""
    prefix_mask_prob: float = 0.0
    """Probability of masking each visible position outside the scored region (prompt; with
    ``block_random`` also the earlier completion blocks); never scored. 0.15 in d1's
    mean-field estimate and in SPG / the release."""
    post_eos: str = "visible"
    """Positions after a completion's first EOS: ``visible`` (clean, never scored),
    ``mask_and_skip`` (always masked, never scored: the release) or ``score`` (scored as
    completion tokens)."""
    spg_beta: float = 1.5
    """SPG's EUBO temperature beta (1.5 in the StableDRL release)."""
    spg_omega: float = 0.5
    """SPG's mixture weight of the EUBO for A <= 0 (0.5 in the release)."""
    coupled_masks: bool = False
    """Draw masks in complementary pairs (DiffuCoder's coupled sampling): every completion
    token is scored exactly once per pair, a lower-variance ELBO; needs an even ``num_mc``."""
    length_normalize: bool = True
    """Divide sequence log-likelihoods by a length (as released)."""
    normalize_by: str = "completion"
    """What ``length_normalize`` divides by: ``completion`` (each sequence's own length up to
    and including EOS, as released) or ``generation`` (the fixed generation width, ESPO)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to a frozen reference policy (0 = off). With ``kl_coef > 0``
    a copy of the initial policy is built in the actor's layout (its weights' memory:
    ``stabledrl plan --reference-model``) and scored with the same masks."""
    reference_sync_every: int = 0
    """Every N optimizer updates move the reference towards the policy, ref <- a theta + (1 - a) ref
    (TRL's ``sync_ref_model``, d1: every 64 with a = 0.6); 0 = the reference stays the initial
    policy. A synced reference is saved in every checkpoint."""
    reference_mixup: float = 0.6
    """``a`` of ``reference_sync_every``."""
    kl_estimator: str = "k3"
    """``k1`` (log-ratio), ``k2`` (half squared log-ratio, ESPO) or ``k3`` (Schulman's, d1), on
    the likelihood the loss uses (token level for ``diffu_grpo``)."""
    ratio_noise: Optional[str] = None
    """Stress switch: None, ``lognormal`` or ``student_t`` noise on the estimated log-ratio."""
    ratio_noise_sigma: float = 1.0
    """Scale of the stress noise."""
    ratio_noise_dof: float = 3.0
    """Degrees of freedom of the Student-t stress noise."""
    max_skipped_updates: Optional[int] = 10
    """Optimizer updates that may be skipped in a row (a non-finite estimate, loss or gradient on
    any rank skips the update on every rank, logged with its reason); one more ends the run with
    ``SkippedUpdatesError`` and a non-zero exit. None = no limit. Whatever the limit, a run none
    of whose updates was applied fails at its end."""


@dataclass
class OptimizerSection:
    """Megatron optimizer and learning-rate schedule."""

    name: str = "adam"
    """``adam`` (AdamW) or ``sgd``."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the decay."""
    betas: Tuple[float, float] = (0.9, 0.99)
    """Adam betas."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    clip_grad: float = 0.2
    """Global gradient-norm clip (0 = off)."""
    warmup_steps: int = 0
    """Linear warm-up, in optimizer updates (``algo.inner_iterations`` per step)."""
    decay_style: str = "constant"
    """``constant``, ``linear`` or ``cosine``, from ``lr`` to ``min_lr`` over all optimizer updates
    (``steps`` x ``algo.inner_iterations``; the release's ``linear_decay`` to 0 is ``linear``)."""
    decay_norms_and_biases: bool = False
    """Weight decay on 1-D parameters (norm weights) and biases too. False = Megatron's default,
    which exempts them; the StableDRL release's ``torch.optim.AdamW`` decays every parameter (true)."""
    lr_step: str = "before_update"
    """When the schedule advances, so which rate update k (0-based) uses: ``before_update`` (the
    schedule steps before every update: update k uses the rate at k + 1) or ``release`` (the
    release's ``scheduler.step(training_step)`` after the update: updates 0 and 1 both use the rate
    at 0, update k >= 1 the rate at k - 1)."""
    distributed: bool = True
    """Megatron's distributed (ZeRO-1) optimizer (GPU and CPU/gloo): each data-parallel rank keeps
    only its shard of the fp32 main weights and Adam moments. Adam only (Megatron's
    ``DistributedOptimizer`` wraps nothing else: ``sgd`` needs ``distributed: false``). Its
    checkpoints reshard across data- and pipeline-parallel sizes but need the same tensor-parallel size
    to resume, and a resume must use the same setting as the save."""


@dataclass
class CheckpointSection:
    """Where and how often the training state is saved."""

    dir: Optional[str] = None
    """Checkpoint directory; None = ``<run_dir>/checkpoints``."""
    save_every: int = 100
    """Save every N steps (0 = only at the end)."""
    keep_last: int = 3
    """Keep the newest K complete checkpoints."""
    resume: str = "none"
    """``none``, ``auto`` (newest complete checkpoint) or a checkpoint path."""
    overwrite: bool = False
    """A fresh run into a directory that holds an earlier run moves that run aside (never deletes);
    without it such a run is refused (docs/checkpoints.md)."""
    save_every_minutes: float = 0.0
    """Also save when this many minutes of rank 0's clock have passed since the last save (0 = off);
    with ``save_every`` too, whichever comes first. Every rank saves the same step."""
    preemption_lead_s: Optional[float] = None
    """Seconds between the pre-emption signal and the hard kill (SLURM ``--signal=...@N``; the job
    scripts set it). The trainer warns when it is shorter than one step plus twice the measured
    save time (``<run_dir>/checkpoint_timing.json``). None = unknown, no check."""
    write_timeout_s: Optional[float] = None
    """Time limit in seconds of a checkpoint's shard writes on each rank; a write past it (a stalled
    file system) ends the run with a ``CheckpointError`` naming the file and the worker on every rank.
    None = automatic: 600 s plus 1 s per 10 MiB the rank writes."""
    trust_unverified: bool = False
    """Load a Megatron checkpoint (``model.checkpoint``, ``checkpoint.resume``) that has no
    ``checksums.json``, unverified (written by an older stabledrl); refused otherwise. Links, FIFOs
    and devices in it are refused either way (docs/checkpoints.md)."""


@dataclass
class EvalSection:
    """Held-out evaluation during training (greedy decoding, sharded over data-parallel ranks)."""

    every: int = 0
    """Evaluate every N steps, before the first step and after the last (0 = never)."""
    split: str = "test"
    """Task split to evaluate on."""
    data_path: Optional[str] = None
    """Local data file of that split for file-backed tasks (GSM8K, MATH500); None = the task's
    default ``<data root>/<task>/<split>.jsonl``. Never ``rollout.data_path`` (the training file)."""
    num_examples: int = 200
    """Examples of that split (generated tasks draw this many; file tasks take the first N)."""
    seed: int = 0
    """Seed of generated evaluation sets (Sudoku, Countdown)."""
    micro_batch_size: int = 128
    """Prompts decoded together per rank."""


@dataclass
class LoggingSection:
    """One logger: console, JSONL metrics and wandb, silent on non-zero ranks."""

    run_dir: str = "runs/default"
    """Everything a run writes lives here."""
    log_every: int = 1
    """Console line every N steps."""
    wandb_mode: str = "offline"
    """``offline`` (default), ``online`` or ``disabled``."""
    wandb_project: str = "stabledrl"
    """wandb project name."""
    progress: bool = True
    """Progress bars on the console."""
    wandb_entity: Optional[str] = None
    """wandb entity (team or user); None = wandb's default."""
    wandb_name: Optional[str] = None
    """wandb run name; None = wandb's generated name. Requeues and resumes keep the run (its id
    is kept in ``<run_dir>/wandb_run_id``)."""
    wandb_group: Optional[str] = None
    """wandb group (e.g. one sweep or ablation)."""
    wandb_tags: Tuple[str, ...] = ()
    """wandb tags, a list."""
    drift_to_initial: bool = False
    """Log ``drift_to_initial`` (k1) and ``drift_to_initial_k3`` every step: the old policy's
    estimated log-ratio to the frozen initial policy on the step's own rollouts and masks
    (``rl/drift.py``), one extra forward of a copy of the initial policy per step (its weights'
    memory; the KL reference is reused when it stays the initial policy)."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to ``<run_dir>/tensorboard`` (rank 0)."""
    run_lock: bool = True
    """Rank 0 holds an exclusive lock on ``<run_dir>/.lock`` for the whole run, so a second run into
    the directory is refused (docs/checkpoints.md). ``false`` only for a file system without file
    locks: nothing then refuses a second run."""
    lock_wait_s: float = 300.0
    """A SLURM requeue whose earlier instance (same job id) still holds the lock waits this long for
    it to end, then is refused naming it; 0 = refuse at once. Other holders are refused at once."""
    samples_every: int = 0
    """RL only: every N steps rank 0 writes ``<run_dir>/samples/step_<N>.jsonl`` (prompt, completion,
    reward, advantage, sequence log-ratio, group) and a wandb table when wandb is on; 0 = off."""
    samples_per_step: int = 8
    """Samples per dump: the first K of rank 0's share (whole prompt groups first)."""
    samples_max_chars: int = 4000
    """Each dumped prompt and completion is cut to this many characters (the dump stays bounded)."""


@dataclass
class RunConfig:
    """A whole run. ``steps`` optimizer steps of StableDRL."""

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algo: AlgorithmSection = field(default_factory=AlgorithmSection)
    optim: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)
    steps: int = 10
    """Optimizer steps to run."""

    def validate(self) -> "RunConfig":
        """Check values that types alone cannot (:func:`~stabledrl_mcore.config.checks.validate_run_config`)."""
        return validate_run_config(self)


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (), cls: type = RunConfig) -> Any:
    """Read YAML (optional), apply dotted overrides, build and validate the config."""
    data: Dict[str, Any] = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file not found: {path}")
        with open(path) as handle:
            try:
                data = yaml.safe_load(handle) or {}
            except yaml.YAMLError as err:
                raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    cfg = from_dict(cls, apply_overrides(data, overrides))
    return cfg.validate() if hasattr(cfg, "validate") else cfg


def save_config(cfg: Any, path: str) -> str:
    """Write the resolved config as YAML, atomically (temp file + rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".config-", suffix=".yaml")
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(to_dict(cfg), handle, sort_keys=False)
    os.replace(tmp, path)
    return path

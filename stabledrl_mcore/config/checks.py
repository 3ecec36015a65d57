"""Every check of a run configuration that types alone cannot make: value choices, cross-field
rules, loss options, pipeline and mixture-of-experts options. ``RunConfig.validate`` (at load),
the preflight (before ranks start) and the set-up on every rank all call these, so a field is
checked in one place.
"""

from __future__ import annotations

import difflib
import math
import os
from typing import Any, Dict, Optional, Sequence

from stabledrl_mcore.algorithms.losses import (
    available_policy_losses,
    available_token_policy_losses,
    get_policy_loss,
    get_token_policy_loss,
)
from stabledrl_mcore.algorithms.losses_common import option_names
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.common.files import directory_problem
from stabledrl_mcore.config.io import get_dotted
from stabledrl_mcore.parallel.bootstrap import validate_parallel_layout
from stabledrl_mcore.tasks import available_tasks
from stabledrl_mcore.tasks.custom_reward import ISOLATION as REWARD_ISOLATION

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections ``model.lora.targets`` may name (PEFT's names; ``stabledrl_mcore/models/lora.py``)."""


def validate_lora(lora) -> None:
    """``model.lora``: rank >= 0 and, when on, alpha > 0, dropout in [0, 1), known targets."""
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank must be >= 0 (0 = off), got {lora.rank}")
    if not lora.rank:
        return
    if not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha must be > 0, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    names = list(LORA_TARGETS) if list(lora.targets) == ["all-linear"] else list(lora.targets)
    unknown = [t for t in names if t not in LORA_TARGETS]
    if unknown or not names or len(set(names)) != len(names):
        raise ConfigError(
            f"model.lora.targets={list(lora.targets)}: use distinct names from {list(LORA_TARGETS)} or [all-linear]"
        )


def check_lora_model(lora, mcfg, description: str = "the model") -> None:
    """``model.lora`` against the model: the experts of a mixture of experts take no adapters."""
    if lora.rank and mcfg.is_moe and set(lora.targets) & {"all-linear", "gate_proj", "up_proj", "down_proj"}:
        raise ConfigError(
            f"model.lora.targets={list(lora.targets)}: {description} is a mixture of experts, whose expert "
            "MLPs take no adapters; target the attention (q_proj, k_proj, v_proj, o_proj)"
        )


def _validate_reward_limits(r) -> None:
    frac = r.max_reward_error_frac
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac <= 1.0:
        raise ConfigError(
            f"rollout.max_reward_error_frac must be in (0, 1] (the share of a step's reward calls that may "
            f"fail before the run stops; 1 never stops), got {frac!r}"
        )
    workers = r.reward_workers
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ConfigError(f"rollout.reward_workers must be an integer >= 1 or null (min(8, CPUs)), got {workers!r}")
    if workers is not None and not r.reward_fn:
        raise ConfigError(
            f"rollout.reward_workers={workers} sets how many rollout.reward_fn calls run at once: set rollout.reward_fn too"
        )


COMPILE_MODES = ("none", "default", "reduce-overhead")
"""``rollout.compile`` / ``--compile``: how the decoding forwards run (``models/decoding.py``)."""


def _validate_decoding(cfg) -> None:
    """``rollout.compile`` and ``rollout.decode_rows``, refused by name before any rank starts."""
    r, p = cfg.rollout, cfg.parallel
    choice("rollout.compile", r.compile, COMPILE_MODES)
    if r.compile != "none" and (p.tensor_parallel > 1 or p.pipeline_parallel > 1):
        raise ConfigError(
            f"rollout.compile={r.compile} captures one rank's whole model; with parallel.tensor_parallel="
            f"{p.tensor_parallel} and parallel.pipeline_parallel={p.pipeline_parallel} its collectives would "
            f"be inside the graph, which this project has not verified: set rollout.compile=none, or "
            f"decode at tensor_parallel=1 and pipeline_parallel=1"
        )
    if r.compile_cache_dir is not None and r.compile == "none":
        raise ConfigError(
            f"rollout.compile_cache_dir={r.compile_cache_dir!r} is where compiled decoding graphs are kept, "
            f"but rollout.compile=none compiles nothing: set rollout.compile=default (or reduce-overhead), "
            f"or drop rollout.compile_cache_dir"
        )
    check_decode_rows(r.decode_rows, p.micro_batch_size, r.group_size)


COMPILE_CACHE = "inductor-cache"
"""``rollout.compile_cache_dir``'s default, under ``logging.run_dir`` (a requeued job reuses it)."""


def compile_cache_path(cfg) -> str:
    """Where a run keeps its compiled decoding graphs: ``rollout.compile_cache_dir``, else
    ``<logging.run_dir>/inductor-cache``."""
    return cfg.rollout.compile_cache_dir or os.path.join(cfg.logging.run_dir, COMPILE_CACHE)


def compile_cache_error(cfg, problem: str) -> ConfigError:
    """The one-line refusal of a run's compile cache directory, naming the option (and
    ``logging.run_dir`` when the directory is its default under it)."""
    path = compile_cache_path(cfg)
    given = cfg.rollout.compile_cache_dir
    where = (
        f"rollout.compile_cache_dir={given}"
        if given
        else f"rollout.compile_cache_dir (unset: <logging.run_dir>/{COMPILE_CACHE} = {path})"
    )
    return ConfigError(
        f"{where} {problem}; compiled decoding (rollout.compile={cfg.rollout.compile}) keeps its graphs there: "
        f"set rollout.compile_cache_dir=DIR to a directory this user can create or write in"
        + ("" if given else " (or another logging.run_dir)")
    )


def check_compile_cache_dir(cfg) -> None:
    """``rollout.compile_cache_dir`` (or its default) with ``rollout.compile`` on: a directory this
    process can write in or create, refused in one line before any rank starts (an existing file, a
    directory it cannot create or cannot write in); reads only, creates nothing."""
    if cfg.rollout.compile == "none":
        return
    problem = directory_problem(compile_cache_path(cfg))
    if problem:
        raise compile_cache_error(cfg, problem)


DECODE_ROWS_NAMES = ("rollout.decode_rows", "parallel.micro_batch_size", "rollout.group_size")
"""How :func:`check_decode_rows` names its three values by default (the run config's fields)."""


def decode_rows_unit(micro_batch: int, group_size: int) -> int:
    """The fewest rows a decoding forward holds, and what every row count is a multiple of:
    ``lcm(micro_batch, group_size)`` (a decoding batch ends on a group and a micro-batch boundary).
    The planner's (``stabledrl plan``) and the preflight's default rows."""
    return math.lcm(max(micro_batch, 1), max(group_size, 1))


def check_decode_rows(
    rows,
    micro_batch: int,
    group_size: int,
    *,
    names: Sequence[str] = DECODE_ROWS_NAMES,
    sep: str = "=",
    unset: str = "null (chosen from the memory left for decoding)",
) -> None:
    """Rows per decoding forward (``rollout.decode_rows``, ``stabledrl plan --decode-rows``): None, or
    a positive multiple of :func:`decode_rows_unit`; refused in one line naming ``names`` (the
    config fields, or the flags; ``sep`` joins a name and its value; ``unset``: what leaving it out means)."""
    if rows is None:
        return
    unit = decode_rows_unit(micro_batch, group_size)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 or rows % unit:
        r, m, g = names
        raise ConfigError(
            f"{r}{sep}{rows!r}: a decoding batch holds whole groups and whole micro-batches, "
            f"so it must be a multiple of lcm({m}{sep}{micro_batch}, "
            f"{g}{sep}{group_size}) = {unit} (e.g. {unit}, {2 * unit}, {4 * unit}), or {unset}"
        )


def validate_run_config(cfg):
    """Check values that types alone cannot; raise :class:`ConfigError`."""
    choice("model.dtype", cfg.model.dtype, ("fp32", "bf16"))
    validate_lora(cfg.model.lora)
    if cfg.model.lora.rank and cfg.algo.reference_sync_every:
        raise ConfigError(
            "algo.reference_sync_every > 0 with model.lora: the KL reference of a LoRA run is the frozen "
            "base without its adapters (no copy to sync); set algo.reference_sync_every=0"
        )
    choice("parallel.backend", cfg.parallel.backend, ("auto", "nccl", "gloo"))
    choice("optim.name", cfg.optim.name, ("adam", "sgd"))
    choice("optim.decay_style", cfg.optim.decay_style, ("constant", "linear", "cosine"))
    choice("optim.lr_step", cfg.optim.lr_step, LR_STEPS)
    choice("logging.wandb_mode", cfg.logging.wandb_mode, ("offline", "online", "disabled"))
    validate_logging_and_saving(cfg.logging, cfg.checkpoint)
    choice("algo.advantage", cfg.algo.advantage, ("center", "zscore", "leave_one_out"))
    choice("rollout.prompt_style", cfg.rollout.prompt_style, ("chat", "compact"))
    choice("rollout.cache", cfg.rollout.cache, ("none", "prefix", "dual"))
    _validate_decoding(cfg)
    choice("rollout.reward_isolation", cfg.rollout.reward_isolation, REWARD_ISOLATION)
    _validate_reward_limits(cfg.rollout)
    if cfg.rollout.cache_gap_every < 0 or cfg.rollout.cache_gap_every and cfg.rollout.cache == "none":
        raise ConfigError(
            f"rollout.cache_gap_every={cfg.rollout.cache_gap_every} measures the cached "
            f"sampler's gap to exact decoding: needs a value >= 0 and rollout.cache=prefix|dual"
        )
    choice("rollout.task", cfg.rollout.task, available_tasks())
    choice("algo.likelihood", cfg.algo.likelihood, ("elbo", "mean_field", "spg", "staircase"))
    _validate_algorithm(cfg)
    if cfg.algo.ratio_noise is not None:
        choice("algo.ratio_noise", cfg.algo.ratio_noise, ("lognormal", "student_t"))
    for name in (
        "parallel.tensor_parallel",
        "parallel.pipeline_parallel",
        "parallel.micro_batch_size",
        "rollout.prompts_per_step",
        "rollout.group_size",
        "rollout.gen_length",
        "rollout.steps",
        "rollout.block_length",
        "algo.inner_iterations",
        "algo.num_mc",
        "checkpoint.keep_last",
        "eval.num_examples",
        "eval.micro_batch_size",
    ):
        if get_dotted(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {get_dotted(cfg, name)}")
    if cfg.algo.coupled_masks and (cfg.algo.num_mc % 2 or cfg.algo.likelihood == "mean_field"):
        raise ConfigError(
            f"algo.coupled_masks needs an even algo.num_mc (got {cfg.algo.num_mc}) "
            f"and a masked estimator, not {cfg.algo.likelihood!r}"
        )
    if not 0.0 < cfg.algo.eps < 1.0:
        raise ConfigError(f"algo.eps must be in (0, 1), got {cfg.algo.eps}")
    if cfg.optim.distributed and cfg.optim.name != "adam":
        raise ConfigError(
            f"optim.distributed=true needs optim.name=adam (Megatron's distributed "
            f"optimizer wraps Adam only); set optim.distributed=false for "
            f"{cfg.optim.name!r}"
        )
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {cfg.optim.lr}")
    _validate_dynamic_sampling(cfg)
    if cfg.steps < 0 or cfg.checkpoint.save_every < 0 or cfg.eval.every < 0:
        raise ConfigError("steps, checkpoint.save_every and eval.every must be >= 0")
    return cfg


def _validate_dynamic_sampling(cfg) -> None:
    """``rollout.filter_uniform_groups`` / ``rollout.oversample_prompts``, refused by name."""
    r = cfg.rollout
    if r.oversample_prompts < 0:
        raise ConfigError(f"rollout.oversample_prompts must be >= 0, got {r.oversample_prompts}")
    if r.oversample_prompts and not r.filter_uniform_groups:
        raise ConfigError(
            "rollout.oversample_prompts needs rollout.filter_uniform_groups=true (without the "
            "filter the extra prompts would be generated and never trained on)"
        )
    if r.filter_uniform_groups and cfg.algo.kl_coef > 0:
        raise ConfigError(
            f"rollout.filter_uniform_groups drops groups whose policy gradient is 0, but with "
            f"algo.kl_coef={cfg.algo.kl_coef} they still carry the KL gradient: set "
            f"algo.kl_coef=0 (as DAPO) or rollout.filter_uniform_groups=false"
        )


def _validate_algorithm(cfg) -> None:
    """Combinations of ``algo.*`` fields that cannot work, refused by name."""
    a = cfg.algo
    choice("algo.mask_sampling", a.mask_sampling, ("fresh", "replay", "per_iteration"))
    choice("algo.mask_scheme", a.mask_scheme, ("uniform", "block_random"))
    choice("algo.post_eos", a.post_eos, ("visible", "mask_and_skip", "score"))
    choice("algo.normalize_by", a.normalize_by, ("completion", "generation"))
    choice("algo.kl_estimator", a.kl_estimator, ("k1", "k2", "k3"))
    if a.mask_scheme != "uniform" and a.likelihood not in ("elbo", "spg"):
        raise ConfigError(
            f"algo.mask_scheme={a.mask_scheme} applies to the elbo/spg likelihoods, not "
            f"{a.likelihood!r} (mean_field masks the whole completion, staircase per block)"
        )
    if a.coupled_masks and a.mask_scheme != "uniform":
        raise ConfigError("algo.coupled_masks needs algo.mask_scheme=uniform")
    if not 0.0 <= a.prefix_mask_prob < 1.0:
        raise ConfigError(f"algo.prefix_mask_prob must be in [0, 1), got {a.prefix_mask_prob}")
    if a.prefix_mask_prob and a.likelihood == "staircase":
        raise ConfigError("algo.prefix_mask_prob is not defined for the staircase likelihood")
    choice("algo.staircase_t", a.staircase_t, ("per_block", "per_sequence"))
    if a.staircase_t != "per_block" and a.likelihood != "staircase":
        raise ConfigError(
            f"algo.staircase_t={a.staircase_t} chooses the staircase likelihood's masks: set "
            f"algo.likelihood=staircase, or drop it"
        )
    if a.staircase_t == "per_sequence" and a.coupled_masks:
        raise ConfigError(
            "algo.staircase_t=per_sequence draws mask probabilities, not counts: set algo.coupled_masks=false"
        )
    if a.spg_beta <= 0 or not 0.0 <= a.spg_omega <= 1.0:
        raise ConfigError(f"algo.spg_beta must be > 0 and algo.spg_omega in [0, 1], got {a.spg_beta}, {a.spg_omega}")
    if (a.spg_beta, a.spg_omega) != (1.5, 0.5) and a.likelihood != "spg":
        raise ConfigError("algo.spg_beta / algo.spg_omega shape SPG's bound: set algo.likelihood=spg")
    if a.kl_coef < 0:
        raise ConfigError(f"algo.kl_coef must be >= 0, got {a.kl_coef}")
    if a.max_skipped_updates is not None and a.max_skipped_updates < 0:
        raise ConfigError(f"algo.max_skipped_updates must be >= 0 or null (no limit), got {a.max_skipped_updates}")
    if a.kl_estimator != "k3" and a.kl_coef == 0:
        raise ConfigError("algo.kl_estimator has no effect with algo.kl_coef=0")
    if a.reference_sync_every < 0 or not 0.0 < a.reference_mixup <= 1.0:
        raise ConfigError(
            f"algo.reference_sync_every must be >= 0 and algo.reference_mixup in (0, 1], got "
            f"{a.reference_sync_every}, {a.reference_mixup}"
        )
    if (a.reference_sync_every or a.reference_mixup != 0.6) and a.kl_coef == 0:
        raise ConfigError("algo.reference_sync_every / reference_mixup need a reference: set algo.kl_coef > 0")
    sequence, token = available_policy_losses(), available_token_policy_losses()
    if a.loss not in sequence + token:
        close = difflib.get_close_matches(a.loss, sequence + token, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"algo.loss: unknown loss {a.loss!r}{hint} (choose from {', '.join(sequence + token)})")
    if a.loss in token and a.likelihood != "mean_field":
        raise ConfigError(
            f"algo.loss={a.loss} is token level: it needs algo.likelihood=mean_field "
            f"(per-token log-probs of the fully masked completion), not {a.likelihood!r}"
        )
    if a.loss in token and (a.normalize_by != "completion" or not a.length_normalize):
        raise ConfigError(
            f"algo.length_normalize / algo.normalize_by shape sequence estimates; the token-level "
            f"loss {a.loss!r} aggregates tokens itself (see algo.loss_options)"
        )
    if a.loss in ("spg", "stabledrl_released") and a.eps != 0.2:
        raise ConfigError(
            f"algo.eps has no effect with algo.loss={a.loss} (it does not clip the ratio"
            + ("; its cap is algo.loss_options.log_weight_cap)" if a.loss != "spg" else ")")
        )
    if a.loss == "spg" and a.ratio_noise is not None:
        raise ConfigError("algo.ratio_noise has no effect with algo.loss=spg (no importance ratio)")
    _check_loss_options(a.loss, a.loss_options, token=a.loss in token)


def _check_loss_options(loss: str, options: Dict[str, Any], *, token: bool) -> None:
    """``algo.loss_options`` must be keyword options of the loss function itself."""
    accepted = option_names((get_token_policy_loss if token else get_policy_loss)(loss), configurable=True)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ConfigError(
            f"algo.loss_options: {', '.join(unknown)} not an option of loss {loss!r} "
            f"(its options: {', '.join(accepted) or 'none'})"
        )


def choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), list(allowed), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}{hint}")


def validate_logging_and_saving(lg, ck) -> None:
    """wandb fields without wandb, and checkpoint timing fields, refused by name (train and sft)."""
    given = [f"logging.{n}" for n in ("wandb_entity", "wandb_name", "wandb_group", "wandb_tags") if getattr(lg, n)]
    if given and lg.wandb_mode == "disabled":
        raise ConfigError(
            f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect with "
            f"logging.wandb_mode=disabled: set "
            f"logging.wandb_mode=offline or online, or drop them"
        )
    if any(not isinstance(t, str) or not t for t in lg.wandb_tags):
        raise ConfigError(f"logging.wandb_tags must be non-empty strings, got {list(lg.wandb_tags)}")
    if lg.lock_wait_s < 0:
        raise ConfigError(f"logging.lock_wait_s must be >= 0 seconds (0 = refuse at once), got {lg.lock_wait_s}")
    for name in ("samples_every", "samples_per_step", "samples_max_chars"):
        if getattr(lg, name) < (0 if name == "samples_every" else 1):
            bound = ">= 0 (0 = off)" if name == "samples_every" else ">= 1"
            raise ConfigError(f"logging.{name} must be {bound}, got {getattr(lg, name)}")
    if ck.save_every_minutes < 0:
        raise ConfigError(f"checkpoint.save_every_minutes must be >= 0 (0 = off), got {ck.save_every_minutes}")
    if ck.preemption_lead_s is not None and ck.preemption_lead_s <= 0:
        raise ConfigError(f"checkpoint.preemption_lead_s must be > 0 seconds or null, got {ck.preemption_lead_s}")
    if ck.write_timeout_s is not None and not ck.write_timeout_s > 0:
        raise ConfigError(
            f"checkpoint.write_timeout_s must be > 0 seconds or null (automatic), got {ck.write_timeout_s}"
        )


def check_pipeline_options(cfg) -> None:
    """Options a pipelined or expert-parallel run cannot honour, refused by name (also checked on
    every rank)."""
    p = cfg.parallel
    if p.pipeline_parallel > 1 and p.retain_update_graph:
        raise ConfigError(
            f"parallel.retain_update_graph=true keeps each micro-batch's autograd graph for "
            f"the update, which Megatron's pipeline schedules cannot reuse: set it to false "
            f"with parallel.pipeline_parallel={p.pipeline_parallel}"
        )
    if p.expert_parallel > 1 and p.pipeline_parallel > 1:
        raise ConfigError(
            f"parallel.expert_parallel={p.expert_parallel} with parallel.pipeline_parallel="
            f"{p.pipeline_parallel}: expert parallelism runs with PP=1 (each stage's "
            f"experts would need its own all-to-all lockstep); set one of them to 1"
        )
    if p.expert_parallel > 1 and p.retain_update_graph:
        raise ConfigError(
            f"parallel.retain_update_graph=true with parallel.expert_parallel={p.expert_parallel}: "
            f"a kept graph's backward all-to-all cannot be matched by the other expert ranks; "
            f"set it to false"
        )


ROLLOUT_SHAPE_NAMES = ("rollout.gen_length", "rollout.steps", "rollout.block_length")
"""How :func:`check_sampler_shape` names the rollout's sampler fields (``train``; eval names its flags)."""


def _divisors_near(n: int, near: int, count: int = 3) -> str:
    divisors = sorted((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - near), d))
    return " or ".join(str(d) for d in sorted(divisors[:count]))


def check_sampler_shape(
    arch: str,
    block_size: Optional[int],
    *,
    gen_length: int,
    steps: int,
    block_length: Optional[int],
    names: Sequence[str] = ROLLOUT_SHAPE_NAMES,
    sep: str = "=",
    description: str = "the model",
) -> None:
    """The shape rules of the samplers (``diffusion/sampling_llada.py``, ``sampling_sdar.py``) and of
    the staircase likelihood, refused in one line before any rank starts (train's preflight, every
    rank's set-up, ``eval`` and ``generate``). ``names``: how the three values are written (the
    config fields, or the flags ``--gen-length`` ...; ``sep`` joins a name and its value).

    * every value >= 1;
    * LLaDA: ``gen_length`` is a whole number of blocks of ``block_length``, and ``steps`` (over
      the whole completion) a multiple of that number of blocks (each block takes ``steps / blocks``);
    * SDAR: ``block_length`` (None = the model's) is the model's own ``block_size``: the model was
      trained, decodes its KV cache and is scored by the staircase likelihood in those blocks.
    """
    g, s, b = names

    def show(name, value):
        return f"{name}{sep}{value}"

    for name, value in zip(names, (gen_length, steps, block_length)):
        if value is not None and value < 1:
            raise ConfigError(f"{show(name, value)}: must be >= 1")
    if arch == "sdar":
        if block_length is not None and block_size and block_length != block_size:
            raise ConfigError(
                f"{show(b, block_length)}: {description} is SDAR with blocks of {block_size} tokens "
                f"(it decodes, caches and is scored in those blocks): set {show(b, block_size)}"
            )
        return
    if block_length is None:
        return
    if gen_length % block_length:
        raise ConfigError(
            f"{show(g, gen_length)} is not a whole number of blocks of {show(b, block_length)} "
            f"(LLaDA decodes block by block): set {b} to a divisor of {gen_length}, e.g. "
            f"{_divisors_near(gen_length, block_length)}"
        )
    blocks = gen_length // block_length
    if steps % blocks:
        low = max(blocks, steps // blocks * blocks)
        raise ConfigError(
            f"{show(s, steps)} is not a multiple of the number of blocks, {gen_length} / {block_length} = "
            f"{blocks} (each block takes the same number of steps): set {s} to a multiple of {blocks}, e.g. "
            f"{low} or {low + blocks}"
        )


def check_model_options(cfg, mcfg, description: str = "the model") -> None:
    """Settings the model ``mcfg`` cannot honour (the sampler's shape, :func:`check_sampler_shape`;
    staircase without blocks, LLaDA's caches on SDAR, mixture-of-experts router losses under PP),
    refused by name (preflight and every rank)."""
    if cfg.algo.likelihood == "staircase" and not mcfg.block_size:
        raise ConfigError(
            f"algo.likelihood=staircase needs a block-diffusion (SDAR) model; {description} has no block_size"
        )
    if cfg.rollout.cache != "none" and mcfg.arch != "llada":
        raise ConfigError(
            f"rollout.cache={cfg.rollout.cache} is LLaDA's prefix/dual cache; {description} "
            f"decodes with its own KV cache of finished blocks: set rollout.cache=none"
        )
    check_lora_model(cfg.model.lora, mcfg, description)
    if cfg.rollout.compile != "none" and mcfg.is_moe:
        raise ConfigError(
            f"rollout.compile={cfg.rollout.compile} with {description}, a mixture of experts: Megatron's "
            f"token dispatch reads routing counts on the host, which a captured graph cannot hold; set "
            f"rollout.compile=none"
        )
    p = cfg.parallel
    if mcfg.is_moe and p.pipeline_parallel > 1 and (mcfg.moe_aux_loss_coeff or mcfg.moe_z_loss_coeff):
        raise ConfigError(
            f"model.overrides moe_aux_loss_coeff / moe_z_loss_coeff > 0 with parallel.pipeline_parallel="
            f"{p.pipeline_parallel}: Megatron's schedules would sum the router losses over "
            f"micro-batches where the PP=1 update averages them; set them to 0 or PP to 1"
        )
    r = cfg.rollout
    check_sampler_shape(
        mcfg.arch,
        mcfg.block_size,
        gen_length=r.gen_length,
        steps=r.steps,
        block_length=r.block_length,
        description=description,
    )


def check_layout(cfg, mcfg, world_size: Optional[int]) -> Optional[int]:
    """The layout against the model's shape, and against ``world_size`` when it is known."""
    p = cfg.parallel
    known = world_size is not None
    # an unknown world is checked as the smallest one the layout fits (the expert grid included)
    smallest = p.pipeline_parallel * math.lcm(
        max(p.tensor_parallel, 1), max((p.expert_tensor_parallel or p.tensor_parallel) * p.expert_parallel, 1)
    )
    data_parallel = validate_parallel_layout(
        world_size if known else smallest,
        p.tensor_parallel,
        p.pipeline_parallel,
        num_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_attention_heads,
        num_query_groups=mcfg.num_query_groups,
        expert_parallel=p.expert_parallel,
        expert_tensor_parallel=p.expert_tensor_parallel,
        num_experts=mcfg.num_experts or 0,
    )
    if not known:
        return None
    r = cfg.rollout
    if r.prompts_per_step % data_parallel:
        raise ConfigError(
            f"rollout.prompts_per_step ({r.prompts_per_step}) must be divisible by the "
            f"data-parallel size {data_parallel} (world {world_size} / TP {p.tensor_parallel} "
            f"/ PP {p.pipeline_parallel})"
        )
    if r.generated_prompts % data_parallel:
        raise ConfigError(
            f"rollout.oversample_prompts ({r.oversample_prompts}) must be divisible by the "
            f"data-parallel size {data_parallel}"
        )
    rows = r.generated_prompts // data_parallel * r.group_size
    if rows % p.micro_batch_size:
        raise ConfigError(
            f"each data-parallel rank holds {rows} sequences (rollout.prompts_per_step / DP x "
            f"rollout.group_size = {r.generated_prompts} / {data_parallel} x {r.group_size}), "
            f"not a multiple of parallel.micro_batch_size ({p.micro_batch_size})"
        )
    return data_parallel


CHAT_TEMPLATES = ("auto", "never")
"""``sft.chat_template``: render conversations with the tokenizer's template when it has one, or never."""
LR_STEPS = ("before_update", "release")
"""Values of ``optim.lr_step`` (engine/optimizer.lr_steps_before)."""

RL_ONLY = (
    "parallel.retain_update_graph",
    "logging.samples_every",  # sample dumps are of rollouts
    "logging.samples_per_step",
    "logging.samples_max_chars",
)
"""Fields of the shared sections with no meaning for SFT (refused unless left at their default)."""


def validate_sft_config(cfg):
    """``stabledrl sft``'s config (:class:`~stabledrl_mcore.sft.config.SFTConfig`): its own ``sft`` section
    and the shared sections as SFT uses them (TP and DP only; RL-only fields refused by name)."""
    choice("model.dtype", cfg.model.dtype, ("fp32", "bf16"))
    validate_lora(cfg.model.lora)
    choice("parallel.backend", cfg.parallel.backend, ("auto", "nccl", "gloo"))
    choice("optim.name", cfg.optim.name, ("adam", "sgd"))
    choice("optim.decay_style", cfg.optim.decay_style, ("constant", "linear", "cosine"))
    choice("optim.lr_step", cfg.optim.lr_step, LR_STEPS)
    choice("logging.wandb_mode", cfg.logging.wandb_mode, ("offline", "online", "disabled"))
    choice("sft.chat_template", cfg.sft.chat_template, CHAT_TEMPLATES)
    if not cfg.sft.data_path:
        raise ConfigError(
            "sft.data_path is required: a JSONL or parquet file of prompt/response or "
            "messages rows (or a datasets.save_to_disk folder)"
        )
    for name in ("parallel.tensor_parallel", "parallel.micro_batch_size", "sft.batch_size", "checkpoint.keep_last"):
        if get_dotted(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {get_dotted(cfg, name)}")
    if cfg.parallel.pipeline_parallel != 1:
        raise ConfigError(
            f"parallel.pipeline_parallel={cfg.parallel.pipeline_parallel}: SFT runs on "
            f"tensor and data parallelism only; set it to 1"
        )
    if cfg.parallel.expert_parallel != 1 or cfg.parallel.expert_tensor_parallel is not None:
        raise ConfigError(
            "parallel.expert_parallel / expert_tensor_parallel: SFT runs on tensor and data "
            "parallelism only (experts replicated); set them to 1 / null"
        )
    if cfg.sft.max_length is not None and cfg.sft.max_length < 2:
        raise ConfigError(f"sft.max_length must be >= 2 or null, got {cfg.sft.max_length}")
    if not 0.0 <= cfg.sft.eps < 0.5:
        raise ConfigError(f"sft.eps must be in [0, 0.5), got {cfg.sft.eps}")
    if cfg.optim.distributed and cfg.optim.name != "adam":
        raise ConfigError(
            f"optim.distributed=true needs optim.name=adam; set optim.distributed=false for {cfg.optim.name!r}"
        )
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr must be > 0, got {cfg.optim.lr}")
    if cfg.sft.max_skipped_updates is not None and cfg.sft.max_skipped_updates < 0:
        raise ConfigError(f"sft.max_skipped_updates must be >= 0 or null, got {cfg.sft.max_skipped_updates}")
    if cfg.steps < 0 or cfg.checkpoint.save_every < 0:
        raise ConfigError("steps and checkpoint.save_every must be >= 0")
    validate_logging_and_saving(cfg.logging, cfg.checkpoint)
    defaults = type(cfg)(sft=type(cfg.sft)(data_path="-"))
    for name in RL_ONLY:
        if get_dotted(cfg, name) != get_dotted(defaults, name):
            raise ConfigError(f"{name} belongs to the RL loop ('stabledrl train'); SFT does not use it: remove it")
    return cfg

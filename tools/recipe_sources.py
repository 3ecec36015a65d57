"""Write docs/recipes.md: every line of every recipe in examples/configs/, with its source.

    python tools/recipe_sources.py            # rewrite docs/recipes.md
    python tools/recipe_sources.py --check    # exit 1 if docs/recipes.md is stale (a test runs this)

A line's source is looked up per recipe, then in the shared table below; a recipe
line with no source fails the run, so a new line cannot ship undocumented.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "recipes.md")

REL = "StableDRL release (JianyuanZhong/StableDRL @26ad014)"
RC = "release `configs/*_spg_snis.yaml`"
RT = "release `training/training_loop_spg_snis.py`"
RN = "release `networks/llada_svpo.py`"
D1Y = "d1 `diffu-grpo/slurm_scripts/train.yaml`"
D1T = "d1 `diffu-grpo/diffu_grpo_trainer.py`"
ESY = "ESPO `recipes/train.yaml`"
EST = "ESPO `espo/espo_trainer.py`"
OURS = "project choice"

SHARED = {
    "model.preset": f"{OURS}: the architecture; the shapes come from the converted checkpoint",
    "model.checkpoint": f"{OURS}: where `slurm/convert.sh` writes GSAI-ML/LLaDA-8B-Instruct",
    "model.dtype": f"{RC} `precision: bf16`",
    "model.recompute": f"{RC} `activation_checkpointing: whole_layer`",
    "parallel.tensor_parallel": f"{OURS}: 8B full-parameter Adam fits TP=2 with the distributed optimizer "
    "(`stabledrl plan`)",
    "parallel.pipeline_parallel": f"{OURS}: TP x DP fits; PP=2 in `llada_8b_stabledrl_tp4pp2.yaml`",
    "parallel.micro_batch_size": f"{OURS}: memory per forward (does not change the update)",
    "parallel.seed": f"{RC} `seed: 113`",
    "rollout.task": f"{RC} data loader (Countdown is scored by the release's rule only with "
    "`task_options.reward_rule: release`; without it, d1's strict rule: every number exactly once, malformed 0)",
    "rollout.task_options.anti_short_boxed": f"{RN} `anti_short_boxed_reward`, added to every task's reward",
    "rollout.task_options.reward_rule": "release `dataloaders/logic_puzzles.py`: `collate_fn_countdown`'s prompt, "
    "`compute_score_countdown` (1 if the numbers used are a sub-multiset of the given ones and the value is the "
    "target, 0.1 otherwise, 0 without an `<answer>` tag); puzzles generated here unless `rollout.data_path` names "
    "its `countdown_cd3_test.jsonl` (`input`/`output` rows)",
    "rollout.prompts_per_step": f"{RC} `batch_size: 1` x `grad_accumulation: 4` x 8 GPUs = 32 prompts per update",
    "rollout.group_size": f"{RC} `num_generations: 8` x `repeat_times: 2`",
    "rollout.gen_length": f"{RC} `gen_length: 256`",
    "rollout.steps": f"{RC} `max_steps: 128`",
    "rollout.block_length": f"{RC} `block_size: 32` (decoding and block_random masking)",
    "rollout.temperature": f"{RC} `temperature: 0.9`",
    "algo.advantage": f"{RN} `rewards - mean_grouped_rewards`",
    "algo.inner_iterations": f"{RC} `num_iterations: 2`",
    "algo.likelihood": f"{RC} `spg_omega: 0.5` -> `logp_estimation: mix` (SPG's sandwich)",
    "algo.spg_beta": f"{RC} `spg_beta: 1.5`",
    "algo.spg_omega": f"{RC} `spg_omega: 0.5`",
    "algo.num_mc": f"{RC} `num_mc_samples: 2`",
    "algo.mask_sampling": f"{RC} `random_masking: true` (fresh seeds at rollout and in every iteration, {RN})",
    "algo.mask_scheme": f"{RN} `SPGConfig(forward_type='block_random')`",
    "algo.prefix_mask_prob": f"{RC} `p_mask_perturb: 0.15`",
    "algo.post_eos": f"{RN} `forward_process_spg`: `is_mask |= ~completion_mask_append`, scored only up to EOS",
    "algo.length_normalize": f"{RN} per-draw mean over masked completion tokens",
    "optim.name": f"{RC} `torch.optim.AdamW`",
    "optim.lr": f"{RC} `lr` (1e-6 Countdown/Sudoku, 2e-6 GSM8K/MATH)",
    "optim.min_lr": f"{RC} `linear_decay` to 0",
    "optim.betas": f"{RC} `betas: [0.9, 0.99]`",
    "optim.weight_decay": f"{RC} `weight_decay: 0.1`",
    "optim.clip_grad": f"{RC} `max_grad_norm: 0.2`",
    "optim.decay_norms_and_biases": f"{RC} `torch.optim.AdamW` over `model.parameters()`: every parameter decays "
    "(Megatron's default exempts norms and biases)",
    "optim.lr_step": f"{RT} `scheduler.step(training_step)` after `optimizer.step()`: updates 0 and 1 at the "
    "full rate, update k at the rate for k - 1",
    "optim.decay_style": f"{RC} `training.utils.lr_scheduler.linear_decay`, `total_steps: 2000` (per update)",
    "optim.distributed": f"{OURS}: Megatron's ZeRO-1 (the release uses FSDP through accelerate)",
    "checkpoint.save_every": f"{RC} `snapshot_ticks: 25` with `step_per_tick: 1` and {RT}'s save only at the end "
    "of a 2-update cycle: its saves fall on updates 26, 76, 126, ..., every 50 updates = 25 rollout steps here "
    "(saved after updates 50, 100, ...)",
    "checkpoint.keep_last": f"{OURS}",
    "checkpoint.resume": f"{OURS}: requeued SLURM jobs continue",
    "logging.run_dir": f"{OURS}",
    "logging.wandb_mode": f"{OURS}: offline by default (`logging.wandb_mode=online` to stream)",
    "steps": f"{RC} `total_steps: 2000` optimizer updates / 2 inner iterations = 1000 rollout batches",
}

PER_RECIPE = {
    "llada_8b_stabledrl_release": {
        "algo.loss": f"{RN} `compute_loss_spg` with `use_snis: true`",
        "algo.loss_options.log_weight_cap": f"{RC} `ais_clip_iw: 5.0` (log-weight capped at log 5)",
    },
    "llada_8b_stabledrl_release_sudoku": {"rollout.task": f"{RC} `sudoku_spg_snis.yaml`"},
    "llada_8b_stabledrl_release_gsm8k": {
        "rollout.task": f"{RC} `gsm8k_math_spg_snis.yaml` (`sampling_weights: [0.0, 1.0]`: GSM8K only)",
        "rollout.data_path": f"{OURS}: the GSM8K train split as JSONL (see the task's docstring)",
    },
    "llada_8b_stabledrl_release_math": {
        "rollout.task": f"{RC} `math_spg_snis.yaml` (`qwedsacf/competition_math`, MATH only)",
        "rollout.data_path": f"{OURS}: the MATH training set in MATH500's JSONL fields (problem, solution, answer)",
    },
    "llada_8b_stabledrl": {
        "algo.loss": "StableDRL paper (Zhong et al. 2026), Sec. 3: unconditional clip + self-normalisation",
        "algo.eps": "StableDRL paper: clip range [1 - eps, 1 + eps] with eps 0.2",
    },
    "llada_8b_stabledrl_tp4pp2": {
        "algo.loss": "StableDRL paper (Zhong et al. 2026), Sec. 3: unconditional clip + self-normalisation",
        "algo.eps": "StableDRL paper: clip range [1 - eps, 1 + eps] with eps 0.2",
        "parallel.tensor_parallel": f"{OURS}: TP=4 x PP=2 on 2 nodes (DP=2) for where TP=2 x DP does not fit "
        "(longer sequences, larger models; `stabledrl plan`)",
        "parallel.pipeline_parallel": f"{OURS}: 2 stages of 16 layers (Megatron's 1F1B schedule)",
        "parallel.micro_batch_size": f"{OURS}: 256 sequences per DP rank in 32 micro-batches per pipeline "
        "call (bubble 3%), 8 rows per decode",
        "logging.run_dir": f"{OURS}: its own run directory",
    },
    "llada_8b_grpo": {
        "algo.loss": "GRPO (Shao et al. 2024) on the estimated sequence ratio: the paper's contrast",
        "algo.eps": "GRPO / PPO's 0.2",
    },
    "llada_8b_spg": {
        "algo.loss": "SPG (Wang et al. 2025): no ratio, policy gradient through the sandwiched bound",
        "algo.loss_options.aggregation": f"{RN} non-SNIS branch: `sum(-A logp len) / sum(len)` (SPG's loss)",
        "algo.spg_beta": "SPG: EUBO beta 2.0 for Countdown (1.0 for Sudoku)",
    },
    "llada_8b_espo": {
        "parallel.seed": f"{ESY} `seed: 42`",
        "model.recompute": f"{OURS}: full-parameter 8B needs it (ESPO: LoRA, no gradient checkpointing)",
        "rollout.task": "ESPO `recipes/run_countdown_llada.sh` `DATASET=countdown`",
        "rollout.prompts_per_step": f"{ESY} `per_device_train_batch_size: 2` x `gradient_accumulation_steps: 5` x "
        "8 GPUs / 10 completions = 8",
        "rollout.group_size": f"{ESY} `num_generations: 10`",
        "rollout.gen_length": f"{ESY} `max_completion_length: 256`",
        "rollout.steps": f"{ESY} `diffusion_steps: 256`",
        "rollout.block_length": f"{OURS}: ESPO's sampler takes a block length argument; 32 as d1 and the release",
        "rollout.temperature": f"{ESY} `generation_temperature: 1.0`",
        "algo.loss": f"{EST} `coef_1 = exp((logp - old) / logits_to_keep)`, PPO min, `.sum() / batch_size`",
        "algo.eps": f"{ESY} `epsilon: 0.2`",
        "algo.advantage": f"{EST} leave-one-out advantages (`scale_rewards: false`)",
        "algo.inner_iterations": f"{ESY} `num_iterations: 2`",
        "algo.likelihood": f"{EST} `_get_elbo_mc`: the ELBO",
        "algo.num_mc": f"{ESY} `num_mc: 1` with `reduce_var: true`: read here as one coupled complementary pair",
        "algo.coupled_masks": f"{ESY} `reduce_var: true` (coupled complementary masks; reading not verified)",
        "algo.mask_sampling": f"{EST} `mask_seeds[this_itr_idx]`, old log-probs per seed at rollout",
        "algo.length_normalize": f"{EST} the ratio divides dELBO by `logits_to_keep`",
        "algo.normalize_by": f"{EST} `logits_to_keep` = the generation width",
        "algo.kl_coef": f"{ESY} `beta: 0.01` on k2 of the unnormalised ELBO / width = 0.01 x 256 on k2 of the "
        "width-normalised ELBO used here",
        "algo.kl_estimator": f'{EST} `compute_approx_kl(..., "k2")`',
        "algo.reference_sync_every": f"{ESY} `sync_ref_model: True`, `ref_model_sync_steps: 64`",
        "algo.reference_mixup": "TRL `GRPOConfig` default `ref_model_mixup_alpha: 0.6`",
        "optim.name": "TRL's default optimizer, AdamW",
        "optim.lr": f"{ESY} `learning_rate: 1.0e-06`",
        "optim.min_lr": f"{ESY} `lr_scheduler_kwargs: {{min_lr_rate: 0.1}}`",
        "optim.betas": f"{ESY} `adam_beta1: 0.9`, `adam_beta2: 0.99`",
        "optim.weight_decay": f"{ESY} `weight_decay: 0.1`",
        "optim.clip_grad": f"{ESY} `max_grad_norm: 0.2`",
        "optim.decay_style": f"{ESY} `lr_scheduler_type: cosine_with_min_lr`",
        "checkpoint.save_every": f"{ESY} `save_steps: 500`",
        "steps": f"{OURS}: ESPO trains `num_train_epochs: 1` over its Countdown set",
    },
    "llada_8b_d1": {
        "parallel.seed": f"{D1Y} `seed: 42`",
        "model.dtype": f"{D1Y} `bf16: true`",
        "optim.name": "TRL's default optimizer, AdamW",
        "model.recompute": f"{OURS}: full-parameter 8B needs it (d1: LoRA, no gradient checkpointing)",
        "rollout.task": f"{D1Y} `dataset: gsm8k`",
        "rollout.data_path": f"{OURS}: the GSM8K train split as JSONL",
        "rollout.prompts_per_step": f"{D1Y} 6 completions x 8 GPUs x `gradient_accumulation_steps: 2` / 6 = 16",
        "rollout.group_size": f"{D1Y} `num_generations: 6`",
        "rollout.gen_length": f"{D1Y} `max_completion_length: 256`",
        "rollout.steps": f"{D1Y} `diffusion_steps: 256`",
        "rollout.block_length": f"{D1Y} `block_length: 32`",
        "rollout.temperature": "d1 `diffu_grpo_config.py` default `temperature: 0.9`",
        "algo.loss": f"{D1T} token-level PPO clip",
        "algo.loss_options.aggregation": f"{D1T} `(per_token_loss * completion_mask).sum() / completion_mask.sum()`",
        "algo.eps": f"{D1Y} `epsilon: 0.5`",
        "algo.advantage": f"{D1T} rewards minus the group mean",
        "algo.inner_iterations": f"{D1Y} `num_iterations: 12`",
        "algo.likelihood": f"{D1T} `forward_process`: completion fully masked",
        "algo.num_mc": f"{D1T} one masked copy per iteration",
        "algo.mask_sampling": f"{D1T} `mask_seeds[this_itr_idx]`, old log-probs per seed at rollout",
        "algo.prefix_mask_prob": f"{D1Y} `p_mask_prompt: 0.15`",
        "algo.kl_coef": f"{D1Y} `beta: 0.04`",
        "algo.kl_estimator": f"{D1T} `exp(ref - logp) - (ref - logp) - 1` (k3)",
        "algo.reference_sync_every": f"{D1Y} `sync_ref_model: True`, `ref_model_sync_steps: 64`",
        "algo.reference_mixup": "TRL `GRPOConfig` default `ref_model_mixup_alpha: 0.6`",
        "optim.lr": f"{D1Y} `learning_rate: 3e-6`",
        "optim.betas": f"{D1Y} `adam_beta1: 0.9`, `adam_beta2: 0.99`",
        "optim.weight_decay": f"{D1Y} `weight_decay: 0.1`",
        "optim.clip_grad": f"{D1Y} `max_grad_norm: 0.2`",
        "optim.decay_style": f"{D1Y} `lr_scheduler_type: constant_with_warmup` (`warmup_ratio: 0.0001`, < 1 update)",
        "checkpoint.save_every": f"{D1Y} `save_steps: 100`",
        "steps": f"{D1Y} `num_train_epochs: 10` over GSM8K's 7,473 problems at 16 per step",
    },
    "sdar_8b_stabledrl": {
        "model.preset": f"{OURS}: JetLM/SDAR-8B-Chat (the release has no SDAR code: this recipe goes beyond it)",
        "model.checkpoint": f"{OURS}: where `slurm/convert.sh` writes SDAR-8B-Chat",
        "parallel.tensor_parallel": f"{OURS}: TP=4 leaves room for the staircase's 2x tokens",
        "parallel.micro_batch_size": f"{OURS}",
        "rollout.task": f"{OURS}: MATH500 (the paper reports SDAR on math)",
        "rollout.prompts_per_step": f"{OURS}",
        "rollout.group_size": "as the LLaDA release recipes: 16",
        "rollout.gen_length": f"{OURS}: 512 for math reasoning",
        "rollout.steps": "SDAR: denoising steps per block = block size 4",
        "rollout.block_length": "SDAR-8B-Chat `block_size: 4`",
        "rollout.temperature": "as the release: 0.9",
        "rollout.threshold": "SDAR `low_confidence_dynamic` threshold 0.9",
        "algo.loss": "StableDRL paper, Sec. 3",
        "algo.eps": "StableDRL paper: eps 0.2",
        "algo.likelihood": "StableDRL paper: the staircase block ELBO for block diffusion",
        "algo.num_mc": f"{OURS}: the staircase scores every block in one pass",
        "algo.inner_iterations": "as the release: 2",
        "model.dtype": "as the release: bf16",
        "model.recompute": "as the release: whole-layer recompute",
        "optim.name": "as the release: AdamW",
        "optim.betas": "as the release",
        "optim.weight_decay": "as the release",
        "optim.clip_grad": "as the release: 0.2",
        "optim.lr": "as the release's math recipes: 2e-6",
        "checkpoint.save_every": "as the release: 25 ticks",
        "steps": f"{OURS}: 2000 rollout batches",
    },
    "sdar_30b_a3b_stabledrl": {
        "model.preset": f"{OURS}: JetLM/SDAR-30B-A3B-Chat (Qwen3-30B-A3B's 128 experts, top-8); router losses "
        "off (`moe_aux_loss_coeff` 0: RL should not re-balance the released routing)",
        "model.checkpoint": f"{OURS}: where the converted SDAR-30B-A3B-Chat goes (no MoE converter yet)",
        "parallel.tensor_parallel": f"{OURS}: TP=1; the experts are split by expert parallelism instead",
        "parallel.pipeline_parallel": f"{OURS}: PP=1 (expert parallelism with PP > 1 is refused)",
        "parallel.expert_parallel": f"{OURS}: 16 of 128 experts per GPU on one 8-GPU node (expert-data-parallel 1)",
        "rollout.block_length": "SDAR-30B-A3B-Chat `block_size: 4`",
        "optim.distributed": f"{OURS}: Megatron's ZeRO-1 shards the dense layers' Adam state over DP=8",
        "logging.run_dir": f"{OURS}: its own run directory",
    },
    "tiny_cpu": {
        "model.preset": f"{OURS}: the laptop-CPU smoke run",
        "model.dtype": f"{OURS}: fp32 on CPU",
        "parallel.tensor_parallel": OURS,
        "parallel.pipeline_parallel": OURS,
        "parallel.micro_batch_size": OURS,
        "parallel.threads": f"{OURS}: one thread is fastest for tiny models",
        "rollout.task": f"{OURS}: generated 4x4 Sudoku",
        "rollout.prompt_style": f"{OURS}: bare puzzles",
        "rollout.prompts_per_step": OURS,
        "rollout.group_size": OURS,
        "rollout.gen_length": "16 cells",
        "rollout.steps": OURS,
        "rollout.block_length": OURS,
        "rollout.temperature": OURS,
        "algo.loss": "StableDRL paper, Sec. 3",
        "algo.eps": "StableDRL paper: 0.2",
        "algo.inner_iterations": "as the release: 2",
        "algo.likelihood": f"{OURS}: the plain ELBO",
        "algo.num_mc": "as the release: 2",
        "optim.name": "AdamW",
        "optim.lr": f"{OURS}: tiny models train fast",
        "optim.weight_decay": OURS,
        "optim.clip_grad": OURS,
        "checkpoint.save_every": OURS,
        "checkpoint.keep_last": OURS,
        "logging.run_dir": OURS,
        "steps": OURS,
    },
}


def _lora_variant(twin: str, paper: str, yaml_file: str, trainer: str) -> dict:
    """The sources of a LoRA variant: its twin's, with the adapter lines and what LoRA changes."""
    return {
        **PER_RECIPE[twin],
        "model.recompute": f"{OURS}: off, as {paper} trains LoRA without gradient checkpointing (the frozen "
        "bf16 base and rank-128 adapters fit; `stabledrl plan --lora-rank 128`)",
        "model.lora.rank": f"{yaml_file} `lora_r: 128`",
        "model.lora.alpha": f"{yaml_file} `lora_alpha: 64`",
        "model.lora.dropout": f"{yaml_file} `lora_dropout: 0.05`",
        "model.lora.targets": f"{paper}'s target list (q/k/v/o/up/down/gate_proj) as PEFT applies it to LLaDA's "
        "modules, which have q/k/v/up_proj only (`attn_out`, `ff_proj`, `ff_out` are not matched)",
        "algo.reference_sync_every": f"{trainer}: with LoRA the reference is the base, `disable_adapter()` "
        "(`sync_ref_model` does not act on it): 0",
        "logging.run_dir": f"{OURS}: its own run directory",
    }


PER_RECIPE["llada_8b_d1_lora"] = _lora_variant("llada_8b_d1", "d1", D1Y, f"{D1T} l. 474")
PER_RECIPE["llada_8b_espo_lora"] = _lora_variant("llada_8b_espo", "ESPO", ESY, f"{EST} l. 636")


def source_of(recipe: str, key: str):
    """The recipe's own entry, then its twin's (the release's per-task variants, the SDAR MoE recipe's
    8B twin), then the shared table."""
    twin = {"sdar_30b_a3b_stabledrl": "sdar_8b_stabledrl"}.get(recipe)  # the 8B recipe's lines
    if recipe.startswith("llada_8b_stabledrl_release"):
        twin = "llada_8b_stabledrl_release"
    for name in (recipe, twin):
        if name and key in PER_RECIPE.get(name, {}):
            return PER_RECIPE[name][key]
    return SHARED.get(key)


def flatten(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def render() -> str:
    lines = [
        "# The recipes, line by line",
        "",
        "Every line of every recipe in `examples/configs/`, with where its value comes from. "
        f'"{REL}" is the code the paper released; "{OURS}" marks a value this project chose, and why. '
        "Written by `python tools/recipe_sources.py` (a test checks it is current).",
        "",
    ]
    missing = []
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*.yaml"))):
        name = os.path.basename(path)[:-5]
        with open(path) as handle:
            recipe = yaml.safe_load(handle)
        lines += [f"## `{name}.yaml`", "", "| line | value | source |", "| --- | --- | --- |"]
        for key, value in flatten(recipe):
            source = source_of(name, key)
            if source is None:
                missing.append(f"{name}: {key}")
                source = "?"
            shown = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
            cell = source.replace("|", "\\|")  # a bare | would split the table cell
            lines.append(f"| `{key}` | `{shown}` | {cell} |")
        lines.append("")
    if missing:
        raise SystemExit(
            "recipe lines without a source (add them to tools/recipe_sources.py):\n  " + "\n  ".join(missing)
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/recipes.md is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = open(OUT).read() if os.path.isfile(OUT) else ""
        if current != text:
            print("docs/recipes.md is stale: run python tools/recipe_sources.py", file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as handle:
        handle.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

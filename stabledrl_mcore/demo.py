"""The README's main job: a complete tiny StableDRL experiment on a laptop CPU.

    python -m stabledrl_mcore.demo --out runs/demo [--seed 0]

1. generate 4x4 Sudoku puzzles (train / validation / held-out test, disjoint grids);
2. train the project's own character tokenizer (sentencepiece) on them;
3. SFT a tiny LLaDA-style masked-diffusion model from scratch (Megatron-Core
   layers, masked-diffusion loss) on a *small labelled* set, stopping when the
   validation accuracy first reaches ``--sft-target`` (chosen by accuracy, not time);
4. StableDRL from that checkpoint on *unlabelled* puzzles scored by the
   verifier (the verifier adds information the labels do not);
5. evaluate on the held-out test puzzles before and after RL, and write the
   run directory: configs, metrics JSONL, checkpoints, offline wandb run,
   ``curves.png`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Dict, List

import torch

from .config import load_config, save_config
from .tasks import get_task
from .tasks.base import Example


def _sft_batches(tokenizer, task, examples: List[Example]):
    rows = [tokenizer.encode(task.prompt(ex)) + tokenizer.encode(ex.reference["solution"])
            + [tokenizer.eos_token_id] for ex in examples]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    completion = torch.zeros_like(ids, dtype=torch.bool)
    prompt_len = len(tokenizer.encode(task.prompt(examples[0])))
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        completion[i, prompt_len:len(row)] = True
    return ids, completion, width - prompt_len


def run_sft(model, tokenizer, task, labelled, validation, *, steps: int, batch: int, lr: float,
            target: float, eval_every: int, seed: int, log) -> Dict[str, float]:
    """Masked-diffusion SFT until validation accuracy reaches ``target`` (or ``steps``)."""
    from .diffusion.pretrain import masked_diffusion_loss
    from .evaluation import evaluate_model

    ids, completion, gen_length = _sft_batches(tokenizer, task, labelled)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    accuracy = 0.0
    for step in range(1, steps + 1):
        rows = torch.randint(0, ids.shape[0], (batch,), generator=generator)
        loss = masked_diffusion_loss(model, ids[rows], completion[rows], generator=generator,
                                     mask_id=tokenizer.mask_token_id)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % eval_every == 0:
            accuracy = evaluate_model(model, tokenizer, task, validation, gen_length=gen_length,
                                      steps=gen_length, block_length=gen_length,
                                      micro_batch=len(validation)).accuracy
            log(f"sft step {step:4d} | loss {loss.item():.3f} | validation accuracy {accuracy:.3f}")
            if accuracy >= target:
                break
    return {"sft_steps": step, "sft_validation_accuracy": accuracy, "gen_length": gen_length}


def plot_curves(metrics_path: str, out_png: str, start_accuracy: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(metrics_path)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    steps = [r["step"] for r in rows]
    axes[0].plot(steps, [r["reward_mean"] for r in rows], label="train reward")
    evals = [(0, start_accuracy)] + [(r["step"], r["test_accuracy"]) for r in rows if "test_accuracy" in r]
    axes[0].plot(*zip(*evals), "o-", label="held-out accuracy (0 = SFT start)")
    axes[0].set_xlabel("RL step")
    axes[0].legend()
    axes[1].plot(steps, [r.get("grad_norm", float("nan")) for r in rows])
    axes[1].set_xlabel("RL step")
    axes[1].set_ylabel("grad norm")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stabledrl_mcore.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--labelled", type=int, default=2000, help="labelled SFT puzzles")
    parser.add_argument("--test", type=int, default=200, help="held-out test puzzles")
    parser.add_argument("--sft-steps", type=int, default=800)
    parser.add_argument("--sft-target", type=float, default=0.15,
                        help="stop SFT once validation accuracy reaches this")
    parser.add_argument("--rl-steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20, help="RL steps between test evaluations")
    args = parser.parse_args(argv)
    return run_demo(args)


def run_demo(args) -> int:
    from .checkpoint.mcore_io import save_model_checkpoint
    from .evaluation import evaluate_model
    from .models import build_model, get_preset
    from .parallel import bootstrap
    from .rl.trainer import train
    from .tokenizer import train_sentencepiece

    start = time.time()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    task = get_task("sudoku", prompt_style="compact")
    labelled = task.load("train", n=args.labelled, seed=args.seed)
    validation = task.load("train", n=args.labelled + 100, seed=args.seed + 1)[-100:]
    test = task.load("test", n=args.test, seed=args.seed)
    tok_dir = os.path.join(args.out, "tokenizer")
    tokenizer = train_sentencepiece([task.prompt(e) + e.reference["solution"] for e in labelled],
                                    tok_dir, vocab_size=16)
    bootstrap.initialize(1, 1, seed=args.seed)
    mcfg = get_preset("llada-tiny", vocab_size=tokenizer.vocab_size, hidden_size=128, num_layers=4,
                      num_attention_heads=4, num_query_groups=4, ffn_hidden_size=384,
                      mask_token_id=tokenizer.mask_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    model = build_model(mcfg)
    print(f"[demo] model: {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"{len(labelled)} labelled puzzles for SFT, {len(test)} held-out test puzzles", flush=True)
    sft = run_sft(model, tokenizer, task, labelled, validation, steps=args.sft_steps, batch=64, lr=1e-3,
                  target=args.sft_target, eval_every=25, seed=args.seed, log=lambda m: print(m, flush=True))
    gen = sft["gen_length"]

    def test_accuracy(m) -> float:
        return evaluate_model(m, tokenizer, task, test, gen_length=gen, steps=gen, block_length=gen,
                              micro_batch=len(test)).accuracy

    start_accuracy = test_accuracy(model)
    sft_ckpt = os.path.join(args.out, "sft_checkpoint")
    save_model_checkpoint(model, sft_ckpt, hf_assets=tok_dir, overwrite=True)
    cfg = load_config(None, [
        f"model.checkpoint={sft_ckpt}", "rollout.task=sudoku", "rollout.prompt_style=compact",
        "rollout.prompts_per_step=16", "rollout.group_size=8", f"rollout.gen_length={gen}",
        f"rollout.steps={gen}", f"rollout.block_length={gen}", "rollout.temperature=1.0",
        "parallel.micro_batch_size=32", "parallel.threads=1", f"parallel.seed={args.seed}",
        "algo.loss=stabledrl", "algo.num_mc=2", "algo.inner_iterations=2", "optim.lr=3e-5",
        "optim.weight_decay=0.0", "optim.clip_grad=1.0", f"steps={args.rl_steps}",
        f"logging.run_dir={args.out}", f"checkpoint.save_every={args.eval_every}", "checkpoint.keep_last=2"])
    save_config(cfg, os.path.join(args.out, "rl_config.yaml"))

    def eval_hook(setup, step):
        if step % args.eval_every and step != cfg.steps:
            return {}
        accuracy = test_accuracy(setup.model)
        print(f"[demo] RL step {step}: held-out accuracy {accuracy:.3f}", flush=True)
        return {"test_accuracy": accuracy}

    setup = train(cfg, hooks=[eval_hook])
    final_accuracy = test_accuracy(setup.model)
    plot_curves(os.path.join(args.out, "metrics.jsonl"), os.path.join(args.out, "curves.png"), start_accuracy)
    summary = {"seed": args.seed, "start_accuracy": start_accuracy, "final_accuracy": final_accuracy,
               "gain": final_accuracy - start_accuracy, "wall_seconds": round(time.time() - start, 1),
               "test_puzzles": len(test), "labelled_puzzles": len(labelled), "rl_steps": cfg.steps, **sft}
    with open(os.path.join(args.out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
    width = max(map(len, summary))
    print("\n".join(["", "StableDRL tiny demo", "-" * (width + 12)]
                    + [f"{k:<{width}}  {v}" for k, v in summary.items()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

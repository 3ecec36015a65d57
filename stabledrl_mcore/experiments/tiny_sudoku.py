"""The embedded tiny setting: 4x4 Sudoku, an own tokenizer, a 0.86M-parameter LLaDA-style model.

``prepare_sft_checkpoint`` does everything before RL:

1. labelled puzzles (with solutions) for SFT and a validation set, from the
   ``train`` split with the run's seed (held-out ``test`` grids never occur);
2. a character sentencepiece tokenizer trained on them;
3. masked-diffusion SFT from scratch (``stabledrl sft``'s loop, LLaDA eq. 3) until the
   validation accuracy *first* reaches ``sft_target``: the RL start point is
   chosen by accuracy, not by time, because SFT on this task goes through a
   sharp phase transition (0% -> 90%+ within a few hundred steps);
4. a converted-format checkpoint (``sft_checkpoint/``) that ``stabledrl train``
   loads through ``model.checkpoint``.

``rl_overrides`` is the matching RL recipe (dotted overrides of ``RunConfig``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from stabledrl_mcore.checkpoint.mcore_io import save_model_checkpoint
from stabledrl_mcore.config.schema import load_config
from stabledrl_mcore.evaluation.distributed import evaluate_model
from stabledrl_mcore.evaluation.scoring import write_jsonl
from stabledrl_mcore.models import get_preset
from stabledrl_mcore.parallel import bootstrap
from stabledrl_mcore.sft import SFTConfig, SFTSection, encode_rows, train_sft
from stabledrl_mcore.tasks import get_task
from stabledrl_mcore.tasks.base import Example
from stabledrl_mcore.tasks.tokenizer import train_sentencepiece


@dataclass
class TinySudoku:
    """Every knob of the embedded setting (the demo and stress CLIs expose the important ones)."""

    seed: int = 0
    labelled: int = 2000  # SFT puzzles with solutions
    validation: int = 100  # puzzles that pick the SFT stopping point
    sft_steps: int = 800  # upper bound; SFT stops at sft_target
    sft_target: float = 0.15  # validation accuracy that ends SFT
    sft_batch: int = 64
    sft_lr: float = 1e-3
    sft_eval_every: int = 25
    sft_eval_every_rising: int = 5  # once validation accuracy is above 0 (the transition is steep)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    ffn_hidden_size: int = 384
    # Blank ranges (None = the task's default, 6-10). A curriculum -- labels only for
    # easy puzzles, the verifier on hard ones -- is e.g. sft_blanks=(3, 7) with
    # sft_target=0.5 and rl_blanks=(8, 11); rl_blanks also sets the held-out test set.
    sft_blanks: Optional[Tuple[int, int]] = None
    rl_blanks: Optional[Tuple[int, int]] = None
    # Model inputs, one of POSITION_INPUTS (see position_overrides). With LLaDA's RoPE
    # ("rope") the same recipe learned far less from RL (docs/experiments.md, "The demo").
    positions: str = "learned"
    init_std: float = 0.02  # normal init of the weight matrices (Megatron's init_method_std)


POSITION_INPUTS = ("learned", "rope")  # the demo's --positions choices


def position_overrides(positions: str, tokenizer) -> Dict[str, object]:
    """``DLLMConfig`` fields of an input scheme.

    ``learned``: learned positions that restart after the prompt's ``"="`` (answer cell
    i gets puzzle cell i's position id) plus a puzzle/answer segment embedding, the
    embeddings initialised N(0, 1). ``rope``: ``llada-tiny``'s own (RoPE over 0..S-1).
    """
    if positions == "learned":
        return dict(
            position_embedding="learned",
            embedding_init_std=1.0,
            segment_separator_id=answer_separator_id(tokenizer),
            num_segments=2,
        )
    if positions == "rope":
        return {}
    raise ValueError(f"positions must be one of {POSITION_INPUTS}, got {positions!r}")


def sft_rows(task, examples: List[Example]) -> List[Dict[str, str]]:
    """The labelled puzzles as ``stabledrl sft`` prompt/response rows (compact prompt, solution)."""
    return [{"prompt": task.prompt(ex), "response": ex.reference["solution"]} for ex in examples]


def sft_batches(tokenizer, task, examples: List[Example]):
    """``[prompt | solution | EOS]`` rows as the SFT library encodes :func:`sft_rows`, the answer
    mask, and the answer length (every grid has the same length: no padding)."""

    records = [(f"example {i}", row) for i, row in enumerate(sft_rows(task, examples))]
    data = encode_rows(records, SFTSection(data_path="-"), tokenizer, source="labelled puzzles")
    prompt_len = len(tokenizer.encode(task.prompt(examples[0])))
    return data.ids, data.answer, data.ids.shape[1] - prompt_len


def sft_overrides(out: str, setting: TinySudoku, tokenizer, data_path: str) -> List[str]:
    """The setting's SFT as a ``stabledrl sft`` config (one rank; AdamW, no clipping, no decay)."""
    model = json.dumps(tiny_model_overrides(tokenizer, setting))
    return [
        f"model.overrides={model}",
        f"model.tokenizer={tokenizer.path}",
        f"sft.data_path={data_path}",
        f"sft.batch_size={setting.sft_batch}",
        f"parallel.micro_batch_size={setting.sft_batch}",
        "parallel.threads=1",
        f"parallel.seed={setting.seed}",
        f"steps={setting.sft_steps}",
        "optim.name=adam",
        f"optim.lr={setting.sft_lr}",
        "optim.betas=[0.9, 0.999]",
        "optim.weight_decay=0.0",
        "optim.clip_grad=0.0",
        "optim.distributed=false",
        f"logging.run_dir={os.path.join(out, 'sft')}",
        "logging.wandb_mode=disabled",
        "logging.log_every=25",
        "logging.progress=false",
        "checkpoint.save_every=0",
        "checkpoint.keep_last=1",
        "checkpoint.overwrite=true",
    ]


def run_sft(out: str, tokenizer, task, labelled: List[Example], validation: List[Example], *, setting: TinySudoku):
    """Masked-diffusion SFT (``stabledrl sft``'s loop) until validation accuracy first reaches
    ``setting.sft_target``; returns ``(model, record)``."""

    data_path = os.path.join(out, "sft_data.jsonl")
    write_jsonl(data_path, sft_rows(task, labelled))
    cfg = load_config(None, sft_overrides(out, setting, tokenizer, data_path), cls=SFTConfig)
    gen_length = sft_batches(tokenizer, task, labelled[:1])[2]
    last = {"accuracy": 0.0}

    def validate(s, step: int) -> Dict[str, float]:
        every = setting.sft_eval_every_rising if last["accuracy"] > 0 else setting.sft_eval_every
        if step % every:
            return {}
        last["accuracy"] = evaluate_model(
            s.model,
            tokenizer,
            task,
            validation,
            gen_length=gen_length,
            steps=gen_length,
            block_length=gen_length,
            micro_batch=len(validation),
        ).accuracy
        print(f"sft step {step:4d} | validation accuracy {last['accuracy']:.3f}", flush=True)
        return {"validation_accuracy": last["accuracy"]}

    s = train_sft(cfg, hooks=[validate], stop_when=lambda m: m.get("validation_accuracy", 0.0) >= setting.sft_target)
    steps = s.scheduler.num_steps
    return s.model, {"sft_steps": steps, "sft_validation_accuracy": last["accuracy"], "gen_length": gen_length}


def prepare_sft_checkpoint(out: str, setting: TinySudoku, log: Callable[[str], None] = print) -> Dict[str, object]:
    """Data, tokenizer and SFT under ``out``; returns ``sft.json``'s content (also written there).

    Runs in this process on one rank (gloo). Reuses ``out/sft_checkpoint`` when
    ``out/sft.json`` says it was made with the same setting.
    """

    record_path = os.path.join(out, "sft.json")
    if os.path.exists(record_path):
        with open(record_path) as handle:
            record = json.load(handle)
        if record.get("setting") == json.loads(json.dumps(asdict(setting))) and os.path.isdir(record["checkpoint"]):
            log(f"[sft] reusing {record['checkpoint']} (same setting)")
            return record
    start = time.time()
    torch.set_num_threads(1)
    os.makedirs(out, exist_ok=True)
    task = get_task(
        "sudoku", prompt_style="compact", **({"blanks": tuple(setting.sft_blanks)} if setting.sft_blanks else {})
    )
    labelled = task.load("train", n=setting.labelled + setting.validation, seed=setting.seed)
    labelled, validation = labelled[: setting.labelled], labelled[setting.labelled :]
    tok_dir = os.path.join(out, "tokenizer")
    tokenizer = train_sentencepiece(
        [task.prompt(e) + e.reference["solution"] for e in labelled], tok_dir, vocab_size=16
    )
    log(
        f"[sft] {len(labelled)} labelled puzzles, {len(validation)} for validation (stabledrl sft's loop, "
        f"run directory {os.path.join(out, 'sft')})"
    )
    try:
        model, result = run_sft(out, tokenizer, task, labelled, validation, setting=setting)
        checkpoint = os.path.join(out, "sft_checkpoint")
        save_model_checkpoint(model, checkpoint, hf_assets=tok_dir, overwrite=True)
    finally:
        bootstrap.destroy()
    record = {
        "setting": asdict(setting),
        "checkpoint": checkpoint,
        "tokenizer": tok_dir,
        "sft_seconds": round(time.time() - start, 1),
        **result,
    }
    tmp = record_path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(record, handle, indent=2)
    os.replace(tmp, record_path)
    return record


def tiny_model_overrides(tokenizer, setting: TinySudoku) -> Dict[str, object]:
    """The ``llada-tiny`` fields the setting replaces (``model.overrides``), the tokenizer's ids included."""
    return dict(
        vocab_size=tokenizer.vocab_size,
        hidden_size=setting.hidden_size,
        init_std=setting.init_std,
        **position_overrides(setting.positions, tokenizer),
        num_layers=setting.num_layers,
        num_attention_heads=setting.num_heads,
        num_query_groups=setting.num_heads,
        ffn_hidden_size=setting.ffn_hidden_size,
        mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def tiny_model_config(tokenizer, setting: TinySudoku):
    """``llada-tiny`` resized to the setting, with the tokenizer's special ids."""

    return get_preset("llada-tiny", **tiny_model_overrides(tokenizer, setting))


def answer_separator_id(tokenizer, separator: str = "=") -> int:
    """Id of the token that ends the compact Sudoku prompt (``"2400...0012="``)."""
    ids = tokenizer.encode(separator)
    if not ids or tokenizer.decode(ids[-1:]).strip() != separator:
        raise ValueError(f"the tokenizer has no single token for {separator!r} (got ids {ids})")
    return ids[-1]


LIKELIHOODS = ("elbo", "mean_field", "spg")  # the estimators the tiny setting's CLIs offer


def rl_overrides(
    sft: Dict[str, object],
    run_dir: str,
    *,
    seed: int,
    steps: int,
    nproc: int,
    eval_every: int,
    eval_examples: int,
    loss: str = "stabledrl",
    rollout_steps: Optional[int] = None,
    lr: float = 3e-5,
    likelihood: str = "elbo",
    extra: Optional[List[str]] = None,
) -> List[str]:
    """The RL recipe of the tiny setting as dotted overrides.

    StableDRL, 16 unlabelled puzzles x G=8 per step, eps 0.2, 2 Monte-Carlo masks
    shared by the old and new policy (``likelihood="elbo"``, ``algo.mask_sampling=replay``:
    the setting the demo's gains were measured with), 2 inner iterations,
    Adam lr 3e-5. d1's one-step ``mean_field`` estimate is 1.6x cheaper per step
    but did not improve held-out accuracy here (it trains only the all-masked
    context, while decoding fills cells one at a time). The unlabelled puzzles
    come from ``rollout.data_seed = 1000 + seed``, a pool drawn independently of
    the labelled set; with the setting's ``rl_blanks`` (recorded in ``sft``) the
    pool and the held-out test set use that blank range.
    """
    gen = int(sft["gen_length"])
    rows_per_rank = 16 // nproc * 8
    rl_blanks = sft.get("setting", {}).get("rl_blanks")
    task_options = [f"rollout.task_options={{blanks: [{rl_blanks[0]}, {rl_blanks[1]}]}}"] if rl_blanks else []
    return [
        *task_options,
        f"model.checkpoint={sft['checkpoint']}",
        f"model.tokenizer={sft['tokenizer']}",
        "rollout.task=sudoku",
        "rollout.prompt_style=compact",
        f"rollout.data_seed={1000 + seed}",
        "rollout.prompts_per_step=16",
        "rollout.group_size=8",
        f"rollout.gen_length={gen}",
        f"rollout.steps={rollout_steps or gen}",
        f"rollout.block_length={gen}",
        "rollout.temperature=1.0",
        f"parallel.micro_batch_size={rows_per_rank}",
        "parallel.threads=1",
        f"parallel.seed={seed}",
        "parallel.retain_update_graph=true",
        f"algo.loss={loss}",
        "algo.eps=0.2",
        f"algo.likelihood={likelihood}",
        "algo.num_mc=2",
        "algo.inner_iterations=2",
        "algo.mask_sampling=replay",
        f"optim.lr={lr}",
        "optim.weight_decay=0.0",
        "optim.clip_grad=1.0",
        f"steps={steps}",
        f"eval.every={eval_every}",
        f"eval.num_examples={eval_examples}",
        f"eval.seed={seed}",
        f"logging.run_dir={run_dir}",
        "checkpoint.save_every=0",
        "checkpoint.keep_last=1",
        "checkpoint.overwrite=true",  # a re-run starts its RL run afresh (the old one moves to attic/)
        *(extra or []),
    ]

"""Per-step sample dumps (``logging.samples_every``): what the policy wrote at step N.

Every ``samples_every`` steps rank 0 writes ``<run_dir>/samples/step_<N>.jsonl``, one line per
sample of the first ``samples_per_step`` rows of its own share (prompt groups are contiguous, so
whole groups come first): ``step``, ``group`` (the prompt's index in rank 0's share), ``prompt``,
``completion``, ``reference``, ``reward``, ``advantage`` and ``log_ratio`` (the sequence log-ratio
the first inner iteration's ratio compares, null when no update ran). Prompts and completions are
cut to ``samples_max_chars`` characters (marked ``...[cut N chars]``), so a dump holds at most
``samples_per_step`` lines of bounded size. The file is written to a temporary name and renamed,
so a reader never sees half a dump; the same rows go to wandb as the table ``samples`` when
wandb is on.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import torch

SAMPLES_DIR = "samples"


def dump_due(every: int, step: int) -> bool:
    """True on the steps ``logging.samples_every`` picks (``step`` counts from 1)."""
    return every > 0 and step % every == 0


def cut(text: str, limit: int) -> str:
    """``text`` up to ``limit`` characters, the rest replaced by a marker that says how much."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}...[cut {len(text) - limit} chars]"


def _value(t: Optional[torch.Tensor], i: int) -> Optional[float]:
    return None if t is None else float(t[i])


def sample_rows(
    batch, tokenizer, *, step: int, count: int, max_chars: int, log_ratio: Optional[torch.Tensor]
) -> List[Dict[str, Any]]:
    """The first ``count`` samples of ``batch`` (a scored :class:`~.rollout.RolloutBatch`) as dicts.
    ``log_ratio`` [N] belongs to ``batch``'s rows (None: not computed this step)."""
    n = min(int(count), len(batch.completions))
    prompts = batch.sequences[:n, : batch.prompt_len].tolist()
    valid = batch.prompt_valid[:n].tolist()
    rows = []
    for i in range(n):
        prompt_ids = [t for t, keep in zip(prompts[i], valid[i]) if keep]
        rows.append(
            {
                "step": step,
                "group": int(batch.group_index[i]),
                "prompt": cut(tokenizer.decode(prompt_ids, stop_at_eos=False), max_chars),
                "completion": cut(batch.completions[i], max_chars),
                "reference": cut(batch.references[i], max_chars),
                "reward": _value(batch.rewards, i),
                "advantage": _value(batch.advantages, i),
                "log_ratio": _value(log_ratio, i),
            }
        )
    return rows


def write_sample_dump(run_dir: str, step: int, rows: List[Dict[str, Any]]) -> str:
    """``<run_dir>/samples/step_<N>.jsonl`` written atomically; returns its path."""
    folder = os.path.join(run_dir, SAMPLES_DIR)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step:08d}.jsonl")
    tmp = path + ".part"
    with open(tmp, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def dump_samples(logging_cfg, logger, batch, kept, update: Dict[str, Any], tokenizer, step: int) -> None:
    """Rank 0's dump of step ``step`` when it is due (call on every rank; others do nothing).

    ``kept`` is the batch the update saw (dynamic sampling's rows, or ``batch``; None when it
    dropped every group): its rows are dumped with their log-ratios; else ``batch``'s without."""
    if not dump_due(logging_cfg.samples_every, step) or torch.distributed.get_rank() != 0:
        return
    log_ratio = update.get("sample_log_ratio_first")
    source = kept if kept is not None else batch
    if kept is None:
        log_ratio = None
    rows = sample_rows(
        source,
        tokenizer,
        step=step,
        count=logging_cfg.samples_per_step,
        max_chars=logging_cfg.samples_max_chars,
        log_ratio=log_ratio,
    )
    write_sample_dump(logging_cfg.run_dir, step, rows)
    logger.table(step, "samples", rows)

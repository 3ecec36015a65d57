"""``stabledrl bench --rollout-mode``: the rollout phase under several decoding settings, side by side.

A mode is a name and a set of ``rollout.*`` overrides applied on top of the
benchmark's config (``--rollout-mode NAME:KEY=VALUE,KEY=VALUE``; ``NAME:`` alone
is the config as given). Every mode decodes the same prompts on the same model;
per mode the report gives rollout tokens/s (generated positions per second),
the forwards per completion (NFE: the batch rows of every model forward of the
rollout summed, divided by the completions; a prefill shared by a prompt's G
completions counts once per prompt), and -- when the model is loaded from a
checkpoint (``model.checkpoint``) -- greedy held-out accuracy with the mode's
settings (``eval.split`` / ``eval.num_examples``, one completion per example,
temperature 0), so speed and quality are read together.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from stabledrl_mcore.bench.phases import _reduce, bench_config
from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.schema import RunConfig
from stabledrl_mcore.evaluation.scoring import shard_examples
from stabledrl_mcore.rl import rollout, trainer
from stabledrl_mcore.tasks import from_config

# rollout fields the training set-up reads once (prompt stream, task): a mode cannot change them
SETUP_FIELDS = (
    "task",
    "data_path",
    "data_seed",
    "prompt_style",
    "task_options",
    "prompts_per_step",
    "system_prompt",
    "prompt_template",
    "chat_template",
)
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


def parse_rollout_modes(specs: Sequence[str]) -> List[Tuple[str, List[str]]]:
    """``["exact:", "fast:rollout.threshold=0.9,rollout.steps=2"]`` -> ``[(name, [override, ...]), ...]``."""
    modes: List[Tuple[str, List[str]]] = []
    for spec in specs:
        name, sep, rest = spec.partition(":")
        name = name.strip()
        if not sep or not _NAME.match(name):
            raise ConfigError(
                f"--rollout-mode {spec!r}: expected NAME:KEY=VALUE,... (NAME of letters, digits, "
                "_.+-; 'NAME:' alone for the config as given)"
            )
        if name in [n for n, _ in modes]:
            raise ConfigError(f"--rollout-mode: the name {name!r} is given twice")
        overrides = [o.strip() for o in rest.split(",") if o.strip()]
        for o in overrides:
            key = o.partition("=")[0].strip()
            if "=" not in o or not key.startswith("rollout.") or key.count(".") != 1:
                raise ConfigError(f"--rollout-mode {name}: {o!r} is not a rollout.FIELD=VALUE override")
            if key.split(".", 1)[1] in SETUP_FIELDS:
                raise ConfigError(
                    f"--rollout-mode {name}: {key} is fixed when the set-up is built; "
                    "set it in the config or the positional overrides instead"
                )
        modes.append((name, overrides))
    return modes


def mode_configs(
    config: Optional[str],
    overrides: Sequence[str],
    modes: Sequence[Tuple[str, List[str]]],
    *,
    keep_tokenizer_vocab: bool = False,
) -> Dict[str, RunConfig]:
    """Each mode's full config (validated: a misspelt field is refused by name)."""

    out = {}
    for name, extra in modes:
        try:
            out[name] = bench_config(config, list(overrides) + list(extra), keep_tokenizer_vocab=keep_tokenizer_vocab)
        except ConfigError as err:
            raise ConfigError(f"--rollout-mode {name}: {err}") from None
    return out


class _RowCounter:
    """Batch rows and calls of every forward of ``model`` while active."""

    def __init__(self, model):
        self.model, self.rows, self.calls, self._handle = model, 0, 0, None

    def _hook(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.rows += int(ids.shape[0])
            self.calls += 1

    def __enter__(self):
        self.rows = self.calls = 0
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


class _Examples:
    """A prompt stream that returns the same examples for every step."""

    def __init__(self, examples):
        self.examples = examples

    def for_step(self, step: int):
        return self.examples


class RolloutMode:
    """The rollout phase of ``setup`` with one mode's ``rollout`` section."""

    def __init__(self, setup, name: str, cfg: RunConfig, overrides: Sequence[str]):
        self.name, self.overrides = name, list(overrides)
        self.s = dataclasses.replace(setup, cfg=dataclasses.replace(setup.cfg, rollout=cfg.rollout))
        self.nfe: Optional[float] = None
        self.forwards: Optional[int] = None
        self.completions = 0

    def rollout(self) -> float:

        with _RowCounter(self.s.model) as counter:
            batch = trainer.rollout_phase(self.s, 0)
        self.completions = batch.size
        self.nfe, self.forwards = counter.rows / batch.size, counter.calls
        return float(batch.size * (batch.sequences.shape[1] - batch.prompt_len))

    def accuracy(self) -> Dict[str, Any]:
        """Greedy held-out accuracy with this mode's decoding settings (one completion per example)."""

        cfg = self.s.cfg
        held_out = from_config.heldout_examples(cfg, self.s.task)
        examples = shard_examples(held_out, self.s.dp_rank, self.s.dp_size)
        greedy = dataclasses.replace(
            cfg,
            rollout=dataclasses.replace(cfg.rollout, group_size=1, temperature=0.0),
            parallel=dataclasses.replace(cfg.parallel, micro_batch_size=cfg.eval.micro_batch_size),
        )
        s = dataclasses.replace(self.s, cfg=greedy, prompts=_Examples(examples))
        correct = total = 0
        if examples:
            batch = rollout.score_rollouts(trainer.rollout_phase(s, 0), s.task)
            correct, total = int(batch.correct.sum()), batch.size
        # every rank of a replica counts its shard alike, so the ratio over all ranks is the DP accuracy
        correct, total = (
            _reduce([float(correct), float(total)], torch.distributed.ReduceOp.SUM)
            if torch.distributed.is_initialized()
            else (correct, total)
        )
        return {"greedy_accuracy": correct / total if total else None, "accuracy_examples": len(held_out)}


def summarize_modes(
    modes: Sequence[RolloutMode],
    results,
    peak_flops,
    mp,
    accuracy: Dict[str, Dict[str, Any]],
    baseline: Optional[Dict[str, Any]],
) -> Dict[str, Any]:
    """The ``rollout_modes`` section of the result: per mode tokens/s, NFE, accuracy and speed-ups."""
    out: Dict[str, Any] = {}
    first = None
    for mode in modes:
        ph = results[f"rollout[{mode.name}]"].summary(peak_flops, mp)
        r = mode.s.cfg.rollout
        row = {
            "overrides": mode.overrides,
            "tokens_per_s": ph["tokens_per_s"],
            "median_s": ph["median_s"],
            "iqr_s": ph["iqr_s"],
            "cpu_median_s": ph["cpu_median_s"],
            "tokens": ph["tokens"],
            "nfe_per_completion": mode.nfe,
            "forwards": mode.forwards,
            "completions": mode.completions,
            "settings": {
                k: getattr(r, k)
                for k in ("group_size", "gen_length", "steps", "block_length", "temperature", "threshold")
            },
            "greedy_accuracy": None,
            "accuracy_examples": None,
        }
        row.update(accuracy.get(mode.name, {}))
        first = first or row
        row["speedup_vs_first"] = (
            row["tokens_per_s"] / first["tokens_per_s"] if row["tokens_per_s"] and first["tokens_per_s"] else None
        )
        base = (baseline or {}).get("tokens_per_s")
        row["speedup_vs_baseline"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
        out[mode.name] = row
    return out


def format_modes(result: Dict[str, Any]) -> List[str]:
    """Console lines of the per-mode table (empty without modes)."""
    modes = result.get("rollout_modes")
    if not modes:
        return []
    base = result.get("rollout_modes_baseline") or {}
    first = next(iter(modes))
    header = (
        f"{'rollout mode':<16}{'median s':>10}{'IQR s':>8}{'CPU s':>8}{'tokens/s':>11}{'NFE/compl.':>12}"
        f"{'vs ' + first:>12}{'vs base':>9}{'greedy acc':>12}  overrides"
    )
    lines = ["", header, "-" * len(header)]
    for name, m in modes.items():
        acc = "-" if m.get("greedy_accuracy") is None else f"{100 * m['greedy_accuracy']:.1f}%"
        lines.append(
            f"{name:<16}{m['median_s']:>10.3f}{m['iqr_s']:>8.3f}{_f(m['cpu_median_s'], '{:.3f}'):>8}"
            f"{_f(m['tokens_per_s'], '{:.1f}'):>11}"
            f"{_f(m['nfe_per_completion'], '{:.2f}'):>12}{_f(m['speedup_vs_first'], '{:.2f}x'):>12}"
            f"{_f(m['speedup_vs_baseline'], '{:.2f}x'):>9}{acc:>12}  {','.join(m['overrides']) or '-'}"
        )
    if base:
        lines.append(
            f"{'baseline (HF)':<16}{base['median_s']:>10.3f}{base['iqr_s']:>8.3f}"
            f"{_f(base.get('cpu_median_s'), '{:.3f}'):>8}"
            f"{_f(base['tokens_per_s'], '{:.1f}'):>11}  (the config's rollout settings)"
        )
    n = next((m["accuracy_examples"] for m in modes.values() if m.get("accuracy_examples")), None)
    if n:
        lines.append(f"greedy accuracy: {n} held-out examples, one completion each, temperature 0")
    return lines


def _f(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else fmt.format(value)

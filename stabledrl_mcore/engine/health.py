"""Run health, checked after every step on every rank: skipped updates and a missing learning signal
(RL and SFT alike; SFT has no groups, so only its skips are watched).

* Skipped updates (a non-finite estimate, loss or gradient, agreed over all ranks): each is
  reported with its reason; more than ``algo.max_skipped_updates`` in a row end the run with
  :class:`~stabledrl_mcore.engine.gradients.SkippedUpdatesError`, and so does a run none of whose updates was applied.
  A step whose every group dynamic sampling dropped attempts no update: not a skip, but a run
  from step 0 made only of such steps trained nothing and fails too.
* No learning signal: when every prompt group of :data:`NO_SIGNAL_STEPS` consecutive steps
  scored all its completions the same, every advantage is zero and nothing is learned; a
  warning says so once.

The decisions use values that are identical on every rank (the agreed skips, the DP-reduced
``groups_varied``), so every rank raises together; only rank 0's logger prints.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from stabledrl_mcore.engine.gradients import SkippedUpdatesError

NO_SIGNAL_STEPS = 5
"""Consecutive steps without any group whose rewards differ before the no-signal warning."""


class RunHealth:
    """``after_step(step, update_skips, metrics, final=...)`` after each step's log line."""

    def __init__(
        self,
        max_skipped_updates: Optional[int],
        logger: Any,
        *,
        from_step_zero: bool = True,
        limit_field: str = "algo.max_skipped_updates",
        what: str = "optimizer",
    ):
        self.limit = max_skipped_updates
        self.limit_field = limit_field  # the config field that sets the limit, named in every message
        self.what = what  # "optimizer" (RL) or "SFT"
        self.from_step_zero = from_step_zero  # a resumed launch continues a run that trained before
        self.logger = logger
        self.in_a_row = 0
        self.applied = 0
        self.skipped = 0
        self.last_reason = ""
        self.steps_without_update = 0  # dynamic sampling dropped every group: no update was attempted
        self.quiet_steps = 0
        self.warned_no_signal = False

    def after_step(
        self, step: int, update_skips: Sequence[Optional[str]], metrics: Dict[str, Any], *, final: bool
    ) -> None:
        self._skips(step, update_skips, final)
        self._signal(step, metrics)

    def _skips(self, step: int, update_skips: Sequence[Optional[str]], final: bool) -> None:
        self.steps_without_update += not update_skips
        for reason in update_skips:
            if reason is None:
                self.applied += 1
                self.in_a_row = 0
            else:
                self.skipped += 1
                self.in_a_row += 1
                self.last_reason = reason
        skipped = sum(r is not None for r in update_skips)
        if skipped:
            limit = "no limit" if self.limit is None else f"the run stops after {self.limit}"
            self.logger.info(
                f"warning: step {step}: skipped={skipped} of {len(update_skips)} {self.what} updates "
                f"({self.last_reason}); {self.in_a_row} in a row ({limit}, {self.limit_field})"
            )
        if self.limit is not None and self.in_a_row > self.limit:
            raise SkippedUpdatesError(
                f"{self.in_a_row} {self.what} updates in a row were skipped at step {step} "
                f"({self.limit_field}={self.limit}); last reason: {self.last_reason}. The weights, the "
                f"learning rate or the data produce non-finite values: check the starting checkpoint, lower "
                f"optim.lr or resume from an earlier checkpoint ({self.limit_field}=null removes the limit)"
            )
        if final and self.from_step_zero and self.steps_without_update and not self.applied and not self.skipped:
            raise SkippedUpdatesError(
                f"no optimizer update in this run: in each of its {self.steps_without_update} steps every group's "
                f"completions scored the same, so rollout.filter_uniform_groups dropped them all; start from a "
                f"checkpoint whose completions already score differently, sample more diversely "
                f"(rollout.temperature) or check the reward"
            )
        if final and self.skipped and not self.applied:
            raise SkippedUpdatesError(
                f"every one of this run's {self.skipped} {self.what} updates was skipped, so nothing was trained "
                f"(last reason: {self.last_reason}); check the starting checkpoint's weights and optim.lr"
            )

    def _signal(self, step: int, metrics: Dict[str, Any]) -> None:
        varied = metrics.get("groups_varied")
        if varied is None or self.warned_no_signal:
            return
        self.quiet_steps = self.quiet_steps + 1 if varied == 0 else 0
        if self.quiet_steps >= NO_SIGNAL_STEPS:
            self.warned_no_signal = True
            self.logger.info(
                f"warning: step {step}: no learning signal: every group had identical rewards for "
                f"{NO_SIGNAL_STEPS} steps (all completions of each prompt scored the same, so every advantage "
                f"is 0 and the policy loss has no gradient); start from a checkpoint whose completions already score "
                f"differently (model.checkpoint, e.g. the demo's runs/demo/sft_checkpoint), sample more "
                f"diversely (rollout.temperature) or check the reward"
            )

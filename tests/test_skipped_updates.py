"""An exception is an exception: only non-finite values skip an update, skips are reported with
their reason, too many end the run by name, a run that trained nothing fails; no-signal warning.

In-process runs (one gloo rank) of the tiny CPU config, a few tenths of a second per step."""

from __future__ import annotations

import math
import os

import pytest
import torch
from test_trainer import CONFIG, DigitsTask, overrides

from stabledrl_mcore.tasks.base import register_task
from stabledrl_mcore.tasks.sudoku import SudokuTask


class ConstantTask(SudokuTask):
    """Every completion scores the same: no group ever has a learning signal."""

    name = "test_constant"

    def _reward(self, completion, reference):
        return 0.0


@pytest.fixture(scope="module")
def tiny_run():
    """``run(run_dir, **overrides) -> setup``: an in-process training run; Megatron torn down after."""
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.parallel import bootstrap, cpu_compat
    from stabledrl_mcore.rl.trainer import train
    from stabledrl_mcore.tasks import available_tasks
    from stabledrl_mcore.tasks import base as task_base

    added = [task for task in (DigitsTask, ConstantTask) if task.name not in available_tasks()]
    for task in added:
        register_task(task.name)(task)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def run(run_dir, mutate=None, **extra):
        cfg = load_config(
            CONFIG, overrides(str(run_dir), **{"logging.progress": False, "rollout.prompts_per_step": 2, **extra})
        )
        if mutate:
            mutate(cfg)  # after validation: what library callers can do
        return train(cfg)

    yield run
    for task in added:  # other modules check the registry's exact contents
        task_base._REGISTRY.pop(task.name)
    bootstrap.destroy()
    cpu_compat.disable()
    torch.set_num_threads(threads)


@pytest.fixture
def console(monkeypatch):
    """The rank-0 logger's console lines (``MetricsLogger.info``) of the test, as one string."""
    from stabledrl_mcore.engine.metrics import MetricsLogger

    lines, real = [], MetricsLogger.info
    monkeypatch.setattr(MetricsLogger, "info", lambda self, message: (lines.append(message), real(self, message))[1])

    class Lines:
        def text(self):
            out = "\n".join(lines)
            lines.clear()
            return out

    return Lines()


def _rows(run_dir):
    from stabledrl_mcore.engine.metrics import read_metrics

    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def test_an_unknown_loss_raises_instead_of_being_counted_as_a_skip(tiny_run, tmp_path):
    from test_mask_sampling import toy_batch, toy_model

    from stabledrl_mcore.rl.estimates import LikelihoodSpec, all_token_logp, draw_plan, estimate
    from stabledrl_mcore.rl.update import loss_coefficients

    batch, spec = toy_batch(n=6), LikelihoodSpec(kind="elbo", num_mc=2)
    plan = draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(k), micro_batch=3)
    tok = all_token_logp(toy_model(), batch, plan, spec, micro_batch=3, mask_id=11)
    common = dict(plan=plan, old=estimate(tok, plan, batch, spec), eps=0.2, ratio_noise=None, noise_generator=None)
    with pytest.raises(ValueError, match="ppo"):
        loss_coefficients(tok, batch, spec, loss="ppo", **common)
    bad = tok.clone()
    bad[0, 0, -1] = float("nan")  # a non-finite value is a skip, with its reason
    coef, metrics = loss_coefficients(bad, batch, spec, loss="stabledrl", **common)
    assert coef is None and metrics["nonfinite_reason"].startswith("non-finite values in current token log-probs")
    # the same through train() with a config changed after validation: the run fails, no skip is counted
    run_dir = tmp_path / "typo"
    with pytest.raises(ValueError, match="ppo"):
        tiny_run(run_dir, mutate=lambda cfg: setattr(cfg.algo, "loss", "ppo"), steps=1)
    assert not os.path.exists(run_dir / "metrics.jsonl") or not _rows(run_dir)


def _nan_loss_after(monkeypatch, applied_updates):
    """From optimizer update ``applied_updates + 1`` on, every loss value is NaN (the losses themselves
    run; only their value is replaced)."""
    from stabledrl_mcore.rl import update

    real, calls = update.sequence_policy_loss, []

    def nan_loss(*args, **kwargs):
        value, metrics = real(*args, **kwargs)
        calls.append(1)
        return (value * math.nan if len(calls) > applied_updates else value), metrics

    monkeypatch.setattr(update, "sequence_policy_loss", nan_loss)


def test_a_run_whose_every_update_was_skipped_fails_with_the_reason(tiny_run, tmp_path, monkeypatch, console):
    from stabledrl_mcore.engine.gradients import SkippedUpdatesError

    _nan_loss_after(monkeypatch, 0)
    run_dir = tmp_path / "nan"
    with pytest.raises(SkippedUpdatesError, match="every one of this run's 4 optimizer updates was skipped"):
        tiny_run(run_dir, steps=2)
    out = console.text()
    assert "skipped=2 of 2 optimizer updates (stabledrl loss is nan)" in out, out
    assert [r["skipped_updates"] for r in _rows(run_dir)] == [2.0, 2.0]
    assert not os.path.exists(run_dir / "checkpoints" / "step_00000002")  # nothing trained, nothing saved


def test_max_skipped_updates_ends_the_run_by_name(tiny_run, tmp_path, monkeypatch, console):
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.engine.gradients import SkippedUpdatesError

    _nan_loss_after(monkeypatch, 2)  # step 1 trains, then every update is skipped
    run_dir = tmp_path / "diverged"
    with pytest.raises(
        SkippedUpdatesError,
        match=r"4 optimizer updates in a row were skipped at step 3 "
        r"\(algo.max_skipped_updates=3\); last reason: stabledrl loss",
    ):
        tiny_run(run_dir, steps=6, **{"algo.max_skipped_updates": 3})
    assert [r["step"] for r in _rows(run_dir)] == [1, 2, 3]
    assert "2 in a row (the run stops after 3" in console.text()
    with pytest.raises(ConfigError, match="algo.max_skipped_updates must be >= 0"):
        load_config(CONFIG, ["algo.max_skipped_updates=-1"])


def test_no_learning_signal_is_warned_once_and_only_without_signal(tiny_run, tmp_path, console):
    from stabledrl_mcore.engine.health import NO_SIGNAL_STEPS

    steps = NO_SIGNAL_STEPS + 1
    tiny_run(tmp_path / "constant", steps=steps, **{"rollout.task": "test_constant"})
    out = console.text()
    assert out.count("no learning signal: every group had identical rewards for") == 1, out
    assert f"identical rewards for {NO_SIGNAL_STEPS} steps" in out
    assert all(r["groups_varied"] == 0.0 for r in _rows(tmp_path / "constant"))
    tiny_run(tmp_path / "digits", steps=steps)
    assert "no learning signal" not in console.text()
    assert all(r["groups_varied"] > 0 for r in _rows(tmp_path / "digits"))


def test_an_rl_skip_names_an_overflowing_kl_term_not_the_ratio():
    """Issue 40: the skip reason is what happened (here the k3 KL term), with the actual largest
    |log-ratio|, not a fixed exp()-overflow guess."""
    from test_mask_sampling import toy_batch, toy_model

    from stabledrl_mcore.rl.estimates import LikelihoodSpec, all_token_logp, draw_plan, estimate
    from stabledrl_mcore.rl.update import loss_coefficients

    batch, spec = toy_batch(n=6), LikelihoodSpec(kind="elbo", num_mc=2)
    plan = draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(k), micro_batch=3)
    tok = all_token_logp(toy_model(), batch, plan, spec, micro_batch=3, mask_id=11)
    old = estimate(tok, plan, batch, spec)
    common = dict(plan=plan, old=old, eps=0.2, ratio_noise=None, noise_generator=None, kl_coef=0.1)
    coef, _ = loss_coefficients(tok, batch, spec, loss="grpo", ref_tok=tok, kl_estimator="k3", **common)
    assert coef is not None  # the same reference: finite
    coef, metrics = loss_coefficients(tok, batch, spec, loss="grpo", ref_tok=tok + 1000.0, kl_estimator="k3", **common)
    reason = metrics["nonfinite_reason"]
    assert coef is None and reason.startswith("grpo loss is inf: the KL term is inf"), reason
    assert "the largest |log-ratio| is 0, below 709.8 where exp() overflows in torch.float64" in reason, reason


class _FakeSFT:
    """The parts of an SFT set-up ``sft_update`` touches: one linear layer, SGD, two rows."""

    def __init__(self):
        from types import SimpleNamespace as NS

        self.model = torch.nn.Linear(2, 1)
        self.model.dllm_config = NS(mask_token_id=0)
        self.ddp = NS(zero_grad_buffer=lambda: None)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scheduler = NS(step=lambda increment: None)
        self.cfg = NS(parallel=NS(micro_batch_size=2, seed=0), sft=NS(eps=1e-3), optim=NS(lr_step="before_update"))
        self.prompts = NS(for_step=lambda step: [0, 1])
        self.data = NS(ids=torch.zeros(2, 3, dtype=torch.long), answer=torch.ones(2, 3, dtype=torch.bool))
        self.dp_rank, self.dp_size, self.block_size = 0, 1, None


@pytest.mark.parametrize(
    "losses, reason",
    [
        (lambda w: (w.sum() * math.nan).expand(2), "non-finite SFT loss (the job's mean is nan)"),
        (lambda w: torch.sqrt(w * 0.0).sum().expand(2), "non-finite gradients"),  # loss 0, gradient 0 * inf
        (lambda w: (w.sum() * 0.0).expand(2), None),
    ],
)
def test_an_sft_skip_names_the_loss_or_the_gradients(monkeypatch, losses, reason):
    from stabledrl_mcore.sft import trainer

    s = _FakeSFT()
    monkeypatch.setattr(trainer, "sft_sequence_losses", lambda model, *a, **k: (losses(s.model.weight), None))
    monkeypatch.setattr(trainer, "sync_gradients", lambda ddp: None)
    monkeypatch.setattr(trainer, "_job_mean", lambda total, rows: float(total) / rows)
    monkeypatch.setattr(s.optimizer, "step", lambda: (True, 0.0, None))
    metrics, why = trainer.sft_update(s, 0)
    assert why == reason and metrics["skipped_updates"] == (0.0 if reason is None else 1.0)


def _toy_coefficients():
    """``(batch, spec, current token log-probs, common options)`` of a toy ELBO batch."""
    from test_mask_sampling import toy_batch, toy_model

    from stabledrl_mcore.rl.estimates import LikelihoodSpec, all_token_logp, draw_plan, estimate

    batch, spec = toy_batch(n=6), LikelihoodSpec(kind="elbo", num_mc=2)
    plan = draw_plan(batch, spec, lambda k: torch.Generator().manual_seed(k), micro_batch=3)
    tok = all_token_logp(toy_model(), batch, plan, spec, micro_batch=3, mask_id=11)
    common = dict(plan=plan, old=estimate(tok, plan, batch, spec), eps=0.2, ratio_noise=None, noise_generator=None)
    return batch, spec, tok, common


def test_a_nan_gradient_behind_a_finite_loss_is_named_as_the_gradient(monkeypatch):
    """Issue 71 (2a): the loss value is finite, its gradient is not: the skip names the loss
    gradient, not "stabledrl loss is 0.53" (a finite number is no reason)."""
    from stabledrl_mcore.rl import update

    batch, spec, tok, common = _toy_coefficients()
    real = update.sequence_policy_loss

    def nan_gradient(loss, logp, *args, **kwargs):
        value, metrics = real(loss, logp, *args, **kwargs)
        never = torch.zeros_like(logp, dtype=torch.bool)  # adds 0; its gradient is 0 x sqrt'(-1) = NaN
        return value + torch.where(never, torch.sqrt(logp.abs().neg() - 1.0), torch.zeros_like(logp)).sum(), metrics

    coef, metrics = update.loss_coefficients(tok, batch, spec, loss="stabledrl", **common)
    assert coef is not None and torch.isfinite(coef).all()
    monkeypatch.setattr(update, "sequence_policy_loss", nan_gradient)
    coef, metrics = update.loss_coefficients(tok, batch, spec, loss="stabledrl", **common)
    reason = metrics["nonfinite_reason"]
    assert coef is None and reason.startswith("non-finite values in loss gradient: "), reason
    assert "loss is" not in reason, reason


@pytest.mark.parametrize("loss", ["stabledrl", "grpo"])
def test_nan_advantages_are_named_as_the_advantages(loss):
    """Issue 71 (2b): a NaN advantage makes the loss NaN; the skip names the advantages (an input
    checked before the loss), not "loss is nan"."""
    from stabledrl_mcore.rl.update import loss_coefficients

    batch, spec, tok, common = _toy_coefficients()
    batch.advantages = batch.advantages.clone()
    batch.advantages[3] = float("nan")
    coef, metrics = loss_coefficients(tok, batch, spec, loss=loss, **common)
    reason = metrics["nonfinite_reason"]
    assert coef is None and reason == "non-finite values in advantages: 1 of 6 entries", reason

"""Host reads of the likelihood and update paths (issue: the captured decoding step, item 5).

On a GPU every read of a tensor's value (``.item()``, ``.tolist()``, ``bool(t)``, boolean-mask
indexing) drains the pipeline. The old-policy scoring, each inner iteration's scoring, the loss
coefficients and the micro-batched backward read a constant number of times per step, none per
micro-batch: a run with 4 micro-batches per forward reads exactly as often as one with 1, and
never more than once per micro-batch forward. (Megatron's optimizer step and the ranks' agreement
on a finite update are outside: one grad-norm read and one all-reduced flag per update.)
"""

from __future__ import annotations

import pytest
from test_decode_paths import HostReads
from test_trainer import in_process_trainer, one_step_config

from stabledrl_mcore.rl import trainer

PATHS = ("old_logp_phase", "iteration_inputs", "loss_coefficients", "accumulate_gradients")


def _reads(monkeypatch, run_dir, micro_batch, likelihood):
    """(host reads in PATHS, micro-batch forwards they ran) of one trainer step."""
    with monkeypatch.context() as patch:
        return _counted_step(patch, run_dir, micro_batch, likelihood)


def _counted_step(monkeypatch, run_dir, micro_batch, likelihood):
    counted = {"reads": 0, "forwards": 0}
    for name in PATHS:
        real = getattr(trainer, name)

        def counting(*args, _real=real, **kwargs):
            with HostReads() as reads:
                out = _real(*args, **kwargs)
            counted["reads"] += reads.count
            return out

        monkeypatch.setattr(trainer, name, counting)
    with in_process_trainer():
        cfg = one_step_config(
            run_dir,
            **{
                "parallel.micro_batch_size": micro_batch,
                "algo.inner_iterations": 2,
                "algo.num_mc": 2,
                "algo.likelihood": likelihood,
            },
        )
        setup = trainer.build_training(cfg)
        setup.model.register_forward_pre_hook(lambda *_: counted.__setitem__("forwards", counted["forwards"] + 1))
        trainer.train(cfg, setup=setup)
    return counted["reads"], counted["forwards"]


@pytest.mark.parametrize("likelihood", ["elbo", "mean_field"])
def test_the_update_path_reads_the_host_per_step_not_per_micro_batch(tmp_path, monkeypatch, likelihood):
    few, few_forwards = _reads(monkeypatch, tmp_path / "one", 8, likelihood)  # 8 rows: 1 micro-batch
    many, many_forwards = _reads(monkeypatch, tmp_path / "four", 2, likelihood)  # 4 micro-batches
    assert many_forwards > few_forwards
    assert many == few, f"{many} reads with 4 micro-batches, {few} with 1: a read per micro-batch"
    assert many <= many_forwards, (many, many_forwards)

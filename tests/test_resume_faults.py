"""A resume after a save that failed on a full disk (issue #52): the unfinished ``.tmp-step_*`` of
the earlier launch is removed first (it is what fills the disk), and a disk that is still full is
one line (``DiskFullError``), not a traceback. The full disk is simulated: the copy of
``metrics.jsonl`` into the attic (the first large write of a resume) raises ENOSPC while the stale
save is there, or always. In-process tiny runs (one gloo rank)."""

import errno
import os
import shutil

import pytest
from test_save_schedule import tiny_run  # noqa: F401 - the fixture

from stabledrl_mcore.common.errors import DiskFullError, one_line


def _failed_save(run_dir):
    """What a save of step 2 that failed with ENOSPC leaves: step 1 committed, step 2 logged, its
    temporary directory (with a shard) not committed."""
    root = run_dir / "checkpoints"
    os.replace(root / "step_00000002", root / ".tmp-step_00000002")
    os.remove(root / ".tmp-step_00000002" / "train_state.json")
    return root / ".tmp-step_00000002"


def _full_while(condition, monkeypatch):
    from stabledrl_mcore.engine import metrics

    copy = shutil.copy2

    def copy2(src, dst, **kwargs):
        if os.path.basename(src) == "metrics.jsonl" and condition():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return copy(src, dst, **kwargs)

    monkeypatch.setattr(metrics.shutil, "copy2", copy2)


def test_a_resume_removes_the_unfinished_save_before_it_writes(tiny_run, tmp_path, monkeypatch):  # noqa: F811
    run_dir = tmp_path / "run"
    tiny_run(run_dir, steps=2, **{"checkpoint.save_every": 1})
    stale = _failed_save(run_dir)
    _full_while(stale.exists, monkeypatch)  # the disk is full as long as the stale save is there
    s = tiny_run(run_dir, steps=2, **{"checkpoint.save_every": 1, "checkpoint.resume": "auto"})
    assert s.finished and not stale.exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if "step_" in p.name) == [
        "step_00000001",
        "step_00000002",
    ]
    assert list((run_dir / "attic").glob("resumed-*/metrics.jsonl")), "metrics.jsonl's old copy is kept"


def test_a_disk_that_stays_full_is_one_line(tiny_run, tmp_path, monkeypatch):  # noqa: F811
    run_dir = tmp_path / "run"
    tiny_run(run_dir, steps=2, **{"checkpoint.save_every": 1})
    _failed_save(run_dir)
    _full_while(lambda: True, monkeypatch)
    with pytest.raises(DiskFullError) as err:
        tiny_run(run_dir, steps=2, **{"checkpoint.save_every": 1, "checkpoint.resume": "auto"})
    message = one_line(err.value)
    assert message == str(err.value), "one line"
    assert message.startswith("the training run stopped: no space left on the device (No space left on device)")
    assert "--resume auto" in message and "logging.run_dir" in message

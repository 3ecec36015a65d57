"""Megatron's checkpoint writer without helper processes that outlive their trainer.

``dist_checkpointing``'s ``torch_dist`` save hands each rank's write results over
through a queue served by a ``multiprocessing.Manager``: a spawned server process
(~250 MB, it re-imports the launching module) that lives until its creator exits
cleanly, so a SIGKILLed trainer or converter leaves it running for ever (with the
resource tracker it holds open). Each file is written by a forked worker, which a
SIGKILL of its parent would leave writing as well.

:func:`bind_checkpoint_writers` keeps the results in an in-process queue (the saves
here are synchronous: the workers report to their own fork queue, and the results
are read back in the same process) and makes every forked worker die with its
parent. Call it once per process before the first save.
"""

from __future__ import annotations

import queue

from stabledrl_mcore.parallel.launch import bind_forked_children


def bind_checkpoint_writers() -> None:
    """No Manager server for write results; forked write workers get a parent-death SIGKILL."""
    bind_forked_children()
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # None = no queue yet (Megatron would start a Manager for it); a queue already made is kept
    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()

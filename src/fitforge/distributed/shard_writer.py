"""One rank's sharded (FSDP) checkpoint saves in the background, through DCP's ``async_save``
(``CheckpointHandler(async_save=True)`` with ``strategy="fsdp"``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future

import torch.distributed as dist

from fitforge.core.state import EstimatorLike
from fitforge.distributed.fsdp import Where, dcp_failure, save_sharded_async, shards_failed


def shards_written(future: Future, name: str) -> None:
    """Wait for DCP's save of the shards named ``name``; its failure as the CheckpointError a save raises."""
    try:
        future.result()
    except (Exception, dcp_failure()) as err:
        raise shards_failed(err, name) from err


class ShardWriter:
    """This rank's sharded saves, one in flight, over a gloo group of their own: made here, so on
    every rank at the same point (the CheckpointHandler's ``train_begin``), and destroyed by
    :meth:`close`."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self._in_flight: Future | None = None

    def submit(
        self, estimator: EstimatorLike, folder: Where, grads: bool, name: str, storage_options: dict
    ) -> Callable[[], None]:
        """Stage this rank's shards (the only part that blocks training) and write them to
        ``folder`` in DCP's background thread. Returns the wait for every rank's shards (named
        ``name`` in its error: a CheckpointError)."""
        future = self._in_flight = save_sharded_async(estimator, folder, grads, storage_options, self.group)
        return lambda: shards_written(future, name)

    def wait(self) -> None:
        """Wait for this rank's save in flight. Its error is not raised here: DCP fails the save on
        every rank, and rank 0's write of the checkpoint file, which waits for the same save, raises
        it on every rank (the handler's next save or ``train_end``)."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            with contextlib.suppress(Exception, dcp_failure()):
                future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            dist.destroy_process_group(self.group)

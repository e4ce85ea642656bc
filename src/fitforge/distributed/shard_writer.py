"""One rank's sharded (FSDP) checkpoint saves in the background, through DCP's ``async_save``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future

import torch.distributed as dist

from fitforge.core.state import EstimatorLike
from fitforge.distributed.fsdp import Where, dcp_failure, save_sharded_async, shards_failed


class ShardWriter:
    """This rank's sharded saves, one in flight, over a gloo group of their own (made on every rank at once)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self._in_flight: Future | None = None

    def submit(
        self, estimator: EstimatorLike, folder: Where, grads: bool, name: str, storage_options: dict
    ) -> Callable[[], None]:
        """Stage this rank's shards (the only part that blocks training) and write them in DCP's
        background thread. Returns the wait for every rank's shards (its error: a CheckpointError)."""
        future = self._in_flight = save_sharded_async(estimator, folder, grads, storage_options, self.group)

        def written() -> None:
            try:
                future.result()
            except (Exception, dcp_failure()) as err:
                raise shards_failed(err, name) from err

        return written

    def wait(self) -> None:
        """Wait for this rank's save in flight. Its error is not raised here: DCP fails it on every rank,
        and rank 0's write of the checkpoint file, which waits for it too, raises it on every rank."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            with contextlib.suppress(Exception, dcp_failure()):
                future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            dist.destroy_process_group(self.group)

"""Saves that do not stall training: the state is copied to the host, then a background thread
serializes, writes, commits and rotates it while training goes on
(``CheckpointHandler(async_save=True)``).

The copy is needed on the CPU too: the optimizer step writes into the weights and the optimizer's
state in place, so the tensors a state dict references change under a writer that reads them
later. One write is in flight at most: the next one, and :meth:`BackgroundWriter.wait`, wait for
it first, so the host holds one copy of the state besides the training's own. The writer's error
is kept and raised by the next ``submit`` or ``wait`` (in the training thread), never lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("fitforge")


def host_copy(value: Any, buffers: dict[tuple, torch.Tensor] | None = None) -> Any:
    """``value`` (a checkpoint: nested dicts, lists and tuples of tensors and plain values) with
    every tensor copied to CPU memory of its own, and every container rebuilt (training appends to
    the history's lists in place too). A tensor met twice (tied weights) is copied once, as
    ``torch.save`` would store it once. CUDA tensors go to pinned memory without blocking, with one
    synchronization once every copy is queued.

    ``buffers`` (by place in ``value``) are the tensors of an earlier copy that nothing reads any
    more: a tensor of the same shape, dtype and strides is copied into its buffer rather than into
    new memory, which is several times faster (no page faults, no pinning); the dict is updated
    with the tensors of this copy."""
    copies: dict[int, torch.Tensor] = {}
    kept = {} if buffers is None else buffers
    on_cuda = False

    def copy_tensor(item: torch.Tensor, place: tuple) -> torch.Tensor:
        nonlocal on_cuda
        target = kept.get(place)
        if target is None or (target.dtype, target.shape, target.stride()) != (item.dtype, item.shape, item.stride()):
            # The layout of a dense tensor is kept (as torch.save would store it); others become contiguous.
            target = torch.empty_like(item, device="cpu", pin_memory=item.is_cuda)
        on_cuda = on_cuda or item.is_cuda
        target.copy_(item.detach(), non_blocking=item.is_cuda)
        kept[place] = target
        return target

    def copy(item: Any, place: tuple) -> Any:
        if isinstance(item, torch.Tensor):
            if id(item) not in copies:
                copies[id(item)] = copy_tensor(item, place)
            return copies[id(item)]
        if isinstance(item, dict):
            rebuilt = type(item)() if type(item) is not dict else {}
            for key, element in item.items():
                rebuilt[key] = copy(element, (*place, key))
            return rebuilt
        if isinstance(item, list):
            return [copy(element, (*place, i)) for i, element in enumerate(item)]
        if isinstance(item, tuple) and not hasattr(item, "_fields"):  # a namedtuple keeps its own fields
            return tuple(copy(element, (*place, i)) for i, element in enumerate(item))
        return item  # numbers, strings, None, dtypes, sizes: immutable

    copied = copy(value, ())
    if on_cuda:  # the non-blocking copies must land before the writer reads them
        torch.cuda.synchronize()
    return copied


class BackgroundWriter:
    """Runs one write at a time in a background thread; its error comes back at the next call."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._name = ""
        # The previous copy's tensors, reused by the next copy once its write ended: the host holds
        # one copy of the state between saves, and copying into memory already touched is fast.
        self._buffers: dict[tuple, torch.Tensor] = {}

    @property
    def busy(self) -> bool:
        """Whether a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the write in flight, if any; raise its error (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:  # the same error a synchronous save raises; the log says which save it was
            log.error("CheckpointHandler: the background save of %s failed: %s", self._name, error)
            raise error

    def close(self) -> None:
        """Wait for the write in flight (raising its error), then free the host copy."""
        self._buffers = {}
        self.wait()

    def submit(self, write: Callable[[dict], None], checkpoint: dict, name: str) -> None:
        """Wait for the previous write (raising its error), copy ``checkpoint`` to the host (the
        only part that blocks training), then run ``write(copy)`` in the background."""
        self.wait()
        copied = host_copy(checkpoint, self._buffers)
        self._name = name

        def run() -> None:
            try:
                write(copied)
            except BaseException as err:  # kept for the training thread: a thread's error is otherwise only printed
                self._error = err

        # Not a daemon: an interpreter that exits still finishes the write it started.
        self._thread = threading.Thread(target=run, name=f"fitforge-save-{name}")
        self._thread.start()

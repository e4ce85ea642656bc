"""Saves that do not stall training: a write copies the checkpoint to the host (on the CPU too: the
optimizer step writes into the tensors in place) and a background thread writes it."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from fitforge.checkpoint.format import with_checksum
from fitforge.checkpoint.storage import write_checked

log = logging.getLogger("fitforge")


def host_copy(value: Any, buffers: dict[tuple, torch.Tensor] | None = None) -> Any:
    """``value`` (a checkpoint) with every tensor copied to host memory of its own (pinned for CUDA, one sync
    at the end) and every container rebuilt; a tensor met twice (tied weights) is copied once. ``buffers`` (by
    place in ``value``): an earlier copy's tensors, reused where the layout matches (several times faster: no
    page faults), then updated with this copy's."""
    copies: dict[int, torch.Tensor] = {}
    kept = {} if buffers is None else buffers
    on_cuda = False

    def copy(item: Any, place: tuple) -> Any:
        nonlocal on_cuda
        if isinstance(item, torch.Tensor):
            if id(item) in copies:
                return copies[id(item)]
            target, layout = kept.get(place), (item.dtype, item.shape, item.stride())
            if target is None or (target.dtype, target.shape, target.stride()) != layout:
                # The layout of a dense tensor is kept (as torch.save would store it); others become contiguous.
                target = torch.empty_like(item, device="cpu", pin_memory=item.is_cuda)
            on_cuda = on_cuda or item.is_cuda
            target.copy_(item.detach(), non_blocking=item.is_cuda)
            kept[place] = copies[id(item)] = target
            return target
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


class AsyncCheckpointIO:
    """``io`` (any :class:`~fitforge.checkpoint.storage.CheckpointIO`) written in the background by one
    caller thread: :meth:`write` returns once the checkpoint is copied to the host (a write while the queue is
    busy makes a new host copy: wait before each save to hold one). A failed write's error is raised by the
    next :meth:`wait`, and what was queued after it is dropped. ``checksums``: where each checkpoint's
    checksum goes once written (by name), summed in the background."""

    # Found on the io when it has them (see CheckpointIO): ``getattr`` sees them here only then.
    _OPTIONAL = ("location", "folder_path", "storage_options", "root", "path")

    def __init__(self, io: Any, label: str | None = None, checksums: dict[str, str] | None = None) -> None:
        self.io, self.label = io, repr(io) if label is None else label
        self.checksums = {} if checksums is None else checksums
        self._queue: deque[tuple[Callable[[], None], str]] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # The last copy's tensors, reused by the next copy once its write ended: the host holds
        # one copy of the state between saves, and copying into memory already touched is fast.
        self._buffers: dict[tuple, torch.Tensor] = {}

    def __getattr__(self, name: str) -> Any:
        if name in AsyncCheckpointIO._OPTIONAL:
            return getattr(self.io, name)
        raise AttributeError(name)

    @property
    def busy(self) -> bool:
        """Whether something is queued or running."""
        return self._thread is not None

    def write(self, name: str, checkpoint: dict) -> None:
        if self._error is not None:  # an earlier task failed: its error first
            self.wait()
        copied = host_copy(checkpoint, None if self.busy else self._buffers)
        self.after(lambda: self._write(name, copied), name)

    def _write(self, name: str, checkpoint: dict) -> None:
        summed = with_checksum(checkpoint)
        write_checked(self.io, name, summed, self.label)
        self.checksums[name] = summed["checksum"]  # one key set by one thread: atomic under the GIL

    def delete(self, name: str) -> None:
        self.after(lambda: self.io.delete(name), name)

    def read(self, name: str) -> dict:
        self.wait()
        return self.io.read(name)

    def names(self) -> list[str]:
        self.wait()
        return self.io.names()

    def prepare(self, prefix: str) -> None:
        self.wait()
        prepare = getattr(self.io, "prepare", None)
        if callable(prepare):
            prepare(prefix)

    def after(self, task: Callable[[], None], name: str = "") -> None:
        """Run ``task`` in the background after what is queued (``name``: its save, for the log of its error)."""
        if self._error is not None:  # an earlier task failed: its error first
            self.wait()
        with self._lock:
            if self._error is not None:  # it failed just now: nothing runs until wait raised it
                return
            self._queue.append((task, name))
            if self._thread is None:
                # Not a daemon: an interpreter that exits still finishes the writes it started.
                self._thread = threading.Thread(target=self._run, name=f"fitforge-save-{name}")
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                task, name = self._queue.popleft()
            try:
                task()
            except BaseException as err:  # kept for the training thread: a thread's error is otherwise only printed
                log.error("CheckpointHandler: the background save of %s failed: %s", name, err)
                with self._lock:
                    self._error = err
                    self._queue.clear()  # nothing after a failed write: rotation would delete a good checkpoint
                    self._thread = None
                return

    def wait(self) -> None:
        """Wait for what is queued; raise the error of what failed (once)."""
        thread = self._thread
        if thread is not None:
            thread.join()
        failed, self._error = self._error, None
        if failed is not None:  # the same error a synchronous save raises (logged when it happened)
            raise failed

    def close(self) -> None:
        """Wait for what is queued (raising its error), then free the host copy."""
        self._buffers = {}
        self.wait()

    def __repr__(self) -> str:
        return f"AsyncCheckpointIO({self.io!r})"

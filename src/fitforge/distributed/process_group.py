"""The process group: made once (unless the script made it) and released at exit, so that a job that
finished exits with 0 on every rank."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fitforge.distributed.ranks import initialized, launched, local_rank, rank, world_size

log = logging.getLogger("fitforge")


def _warnings_and_up(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def quiet_other_ranks() -> None:
    """Off rank 0, fitforge's log keeps warnings and errors only: rank 0 reports for all."""
    if rank() != 0 and _warnings_and_up not in log.filters:
        log.addFilter(_warnings_and_up)


def several_processes() -> bool:
    """Whether this run has several processes: launched so, or a group of several already made."""
    return (initialized() and world_size() > 1) or (launched() and int(os.environ["WORLD_SIZE"]) > 1)


def init_process_group(device: torch.device) -> None:
    """The default group, unless the script made one: NCCL and gloo (for host values) on CUDA, else gloo."""
    if initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device if device.index is not None else local_rank())
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    release_at_exit(destroy=True)  # ours to release: NCCL warns of a group left at exit


_AT_EXIT = {"registered": False, "destroy": False}
_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


def release_at_exit(destroy: bool) -> None:
    """At interpreter exit, destroy the default group (``destroy``: fitforge made it), then wait for gloo's
    worker threads to go idle: one that frees a collective's tensors during shutdown asks for the GIL and
    is ended with ``pthread_exit``, a ``std::terminate`` through C++ (a SIGABRT of a finished rank), and
    ``destroy_process_group`` does not stop them while a DDP wrapper or an FSDP mesh holds the group."""
    _AT_EXIT["destroy"] = _AT_EXIT["destroy"] or destroy
    if not _AT_EXIT["registered"]:
        _AT_EXIT["registered"] = True
        atexit.register(_release)


def _release() -> None:
    if _AT_EXIT["destroy"] and initialized():
        dist.destroy_process_group()
    settle_gloo_workers()


def settle_gloo_workers(timeout: float = 2.0) -> bool:
    """Whether every gloo worker thread was blocked, and did not wake, through a pause twice the GIL's
    switch interval (one waiting for the GIL wakes each interval) within ``timeout`` seconds (True where
    the threads cannot be seen)."""
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        tasks = []
    workers = []
    for task in tasks:
        try:
            if (task / "comm").read_text().strip() == _GLOO_WORKER:
                workers.append(task)
        except OSError:
            continue  # the thread ended meanwhile
    pause = 2 * sys.getswitchinterval()
    deadline = time.monotonic() + timeout
    while workers:
        before = [_activity(task) for task in workers]
        time.sleep(pause)  # the GIL is free meanwhile: a worker that waits for it takes it
        after = [_activity(task) for task in workers]
        if all(old is None or (old == new and old[0] == "S") for old, new in zip(before, after)):
            return True
        if time.monotonic() > deadline:
            return False
    return True


def _activity(task: Path) -> tuple[str, list[int]] | None:
    """A thread's scheduler state (``S``: blocked) and its context switch counts; None once it ended."""
    try:
        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        status = (task / "status").read_text().splitlines()
    except (OSError, IndexError):
        return None
    return state, [int(line.split()[1]) for line in status if "ctxt_switches:" in line]


def local_store() -> tuple[dist.TCPStore, int]:
    """A TCPStore this process serves alone on 127.0.0.1, and its port (any free one): the store torchft's
    ``Manager`` of a one-process replica group connects to."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, store.port

"""Several processes under ``torchrun``: the process group, each rank's device, and the wrapped net.

``Estimator(strategy="auto")`` (the default) trains data-parallel when the script was launched
with several processes (``WORLD_SIZE > 1``): it initialises the default process group unless the
script did (NCCL for CUDA devices, with gloo beside it for host values; gloo on the CPU), gives each
rank the CUDA device of its ``LOCAL_RANK``, and wraps the net in ``DistributedDataParallel``.
``estimator.net`` stays the user's module, so weights, checkpoints and ``state_dict`` keys are
those of one process; ``estimator.train_net`` is the wrapper ``fit``'s forward goes through.
``strategy="none"`` leaves all of this to the script; ``strategy="ddp"`` asks for DDP explicitly
and ``strategy="fsdp"`` for sharded training (:mod:`fitforge.distributed.fsdp`), both an error without a
launcher. See docs/distributed.md.

At exit, fitforge destroys the group it made and waits for gloo's worker threads to go idle
(:func:`release_at_exit`), so that a job that finished exits with 0 on every rank.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fitforge.distributed.fsdp import shard
from fitforge.distributed.ranks import initialized, launched, local_rank, rank, world_size
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

STRATEGIES = ("auto", "ddp", "fsdp", "none")
log = logging.getLogger("fitforge")


def _warnings_and_up(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def quiet_other_ranks() -> None:
    """Off rank 0, fitforge's log keeps warnings and errors only: rank 0 reports for all."""
    if rank() != 0 and _warnings_and_up not in log.filters:
        log.addFilter(_warnings_and_up)


def check_strategy(strategy: Any, options: Any) -> str:
    """The strategy's name ("none" for None), checked with its options."""
    name = "none" if strategy is None else strategy
    if name not in STRATEGIES:
        raise FitforgeValueError(
            f"strategy must be one of {', '.join(map(repr, STRATEGIES))} or None, got {strategy!r}"
        )
    if options is not None and not isinstance(options, dict):
        raise FitforgeTypeError(
            f"strategy_options must be a dict of keyword arguments for {name}, got {describe(options)}"
        )
    return name


def _several() -> bool:
    """Whether this run has several processes: launched so, or a group of several already made."""
    return (initialized() and world_size() > 1) or (launched() and int(os.environ["WORLD_SIZE"]) > 1)


def rank_device(device: Any, strategy: str) -> Any:
    """Under a launcher (or a group of several processes), the device of this rank: ``None`` or
    ``"cuda"`` becomes ``cuda:<LOCAL_RANK>`` where CUDA exists (``None`` is the CPU otherwise)."""
    if strategy == "none" or not (launched() or _several()):
        return device
    if device is None:
        return f"cuda:{local_rank()}" if torch.cuda.is_available() else "cpu"
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda" and device.index is None):
        return f"cuda:{local_rank()}"
    if _several() and str(device).startswith("cuda:") and str(device) != f"cuda:{local_rank()}":
        warnings.warn(
            f"device={str(device)!r} under torchrun: every rank of this machine uses that one GPU; pass "
            f"device=None or 'cuda' for each rank's own (cuda:LOCAL_RANK)",
            UserWarning,
            stacklevel=3,
        )
    return device


def init_process_group(device: torch.device) -> None:
    """The default group, unless the script made one: NCCL for CUDA tensors and gloo for host ones
    on a CUDA device, gloo on the CPU. Rendezvous comes from torchrun's variables."""
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
    """At interpreter exit, destroy the default group (``destroy``: fitforge made it), then wait for
    gloo's worker threads to go idle. Registered once per process.

    A gloo worker frees a collective's tensors after the caller's ``wait`` returned. A tensor that
    Python already let go of needs the GIL for that, and Python ends a thread that asks for the GIL
    while the interpreter shuts down with ``pthread_exit``, whose unwinding through C++ is a
    ``std::terminate``: a SIGABRT ("terminate called without an active exception") of a rank that
    had finished. ``destroy_process_group`` does not stop the workers while a DDP wrapper or an FSDP
    mesh still holds the group, so the wait is what prevents it, and it is done for a group the
    script made too."""
    _AT_EXIT["destroy"] = _AT_EXIT["destroy"] or destroy
    if not _AT_EXIT["registered"]:
        _AT_EXIT["registered"] = True
        atexit.register(_release)


def _release() -> None:
    if _AT_EXIT["destroy"] and initialized():
        dist.destroy_process_group()
    settle_gloo_workers()


def settle_gloo_workers(timeout: float = 2.0) -> bool:
    """Wait until no gloo worker thread of this process is running or waiting for the GIL: each is
    blocked, and did not wake, through a pause twice the GIL's switch interval during which this
    thread left the GIL free. A thread waiting for the GIL wakes at least once per interval, so it
    cannot pass for idle. Whether they settled within ``timeout`` seconds; True where the threads
    cannot be seen (not Linux, or a torch that does not name them)."""
    workers = _threads_named(_GLOO_WORKER)
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


def _threads_named(name: str) -> list[Path]:
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return []
    named = []
    for task in tasks:
        try:
            if (task / "comm").read_text().strip() == name:
                named.append(task)
        except OSError:
            continue  # the thread ended meanwhile
    return named


def _activity(task: Path) -> tuple[str, list[int]] | None:
    """A thread's scheduler state (``S``: blocked) and its context switch counts; None once it ended."""
    try:
        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        status = (task / "status").read_text().splitlines()
    except (OSError, IndexError):
        return None
    return state, [int(line.split()[1]) for line in status if "ctxt_switches:" in line]


def parallelize(
    net: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    device: torch.device,
    strategy: str,
    options: dict | None,
    wrapper: DistributedDataParallel | None,
) -> nn.Module:
    """The module ``fit``'s forward goes through: ``wrapper`` (a DDP the user made), a new DDP
    wrapper around ``net``, ``net`` sharded in place (FSDP, see :mod:`fitforge.distributed.fsdp`), or ``net``
    itself (one process, or ``strategy="none"``)."""
    if initialized():  # a group the script made: fitforge's collectives run on its threads too
        release_at_exit(destroy=False)
    if wrapper is not None:
        _SYNCED[wrapper] = (_trainable_ids(net), None)  # as the user wrapped it, presumably
        return wrapper
    if strategy == "none":
        return net
    if strategy == "auto" and not _several():
        return net
    if not initialized() and not launched():
        raise FitforgeValueError(
            f"strategy={strategy!r} needs several processes started by a launcher: run the "
            "script with torchrun --nproc_per_node=N (see docs/distributed.md), or pass "
            "strategy='auto' to train in one process when not launched"
        )
    init_process_group(device)
    if strategy == "fsdp":
        quiet_other_ranks()
        return shard(net, optimizers, device, options)
    if world_size() == 1:
        return net
    quiet_other_ranks()
    if not any(p.requires_grad for p in net.parameters()):
        # Nothing to train (an estimator for evaluate and predict; a backbone frozen whole): DDP
        # refuses such a net. The first fit with something to train wraps it (follow_trainable).
        _SYNCED[net] = (frozenset(), options or {})
        return net
    return _ddp(net, device, options or {})


def _ddp(net: nn.Module, device: torch.device, options: dict) -> DistributedDataParallel:
    device_ids = [device.index] if device.type == "cuda" else None
    try:
        wrapper = DistributedDataParallel(net, device_ids=device_ids, **options)
    except TypeError as err:
        raise FitforgeTypeError(
            f"strategy_options {options!r} are not all arguments of DistributedDataParallel: {err}"
        ) from err
    _SYNCED[wrapper] = (_trainable_ids(net), options)
    return wrapper


# DDP synchronises the gradients of the parameters that required grad when it was made, and only
# those. Per wrapper: their ids, and the options fitforge made it with (None: the user's wrapper).
_SYNCED: weakref.WeakKeyDictionary[nn.Module, tuple[frozenset[int], dict | None]] = weakref.WeakKeyDictionary()


def _trainable_ids(net: nn.Module) -> frozenset[int]:
    return frozenset(id(p) for p in net.parameters() if p.requires_grad)


def follow_trainable(train_net: nn.Module, net: nn.Module, device: torch.device) -> nn.Module:
    """The module fit's forward goes through, for the parameters that train now (checked at each fit).

    A parameter unfrozen since the DDP wrapper was made would train apart on each rank (DDP never
    averages its gradient), and one frozen since makes DDP wait for a gradient that never comes
    ("Expected to have finished reduction"). A wrapper fitforge made is made anew with the same
    options, on every rank (each runs this fit); a comm hook registered on the old one is not carried
    over. A net left unwrapped because nothing in it trained is wrapped by the first fit that trains
    it. For a wrapper the user made, this is an error that says what to do.
    """
    made = _SYNCED.get(train_net)
    if made is None:
        return train_net  # one process, FSDP (which follows requires_grad itself), or no strategy
    synced, options = made
    trainable = _trainable_ids(net)
    if trainable == synced or not trainable:  # nothing to train: fit's own error follows
        return train_net
    changed = [name for name, p in net.named_parameters() if (id(p) in trainable) != (id(p) in synced)]
    if options is None:
        raise FitforgeValueError(
            f"the DistributedDataParallel wrapper given as net synchronises the gradients of the parameters that "
            f"required grad when it was made, and {len(changed)} changed since ({', '.join(changed[:5])}): wrap the "
            "net again after changing requires_grad and build a new Estimator with it, or give the Estimator the net "
            "itself: it wraps it again when they change"
        )
    log.info(
        "%d parameter(s) were frozen or unfrozen since the net was prepared for several processes (%s): "
        "wrapping it in DistributedDataParallel anew, so that their gradients are averaged over the ranks",
        len(changed),
        ", ".join(changed[:5]),
    )
    return _ddp(net, device, options)

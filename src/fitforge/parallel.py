"""Several processes under ``torchrun``: the process group, each rank's device, and the wrapped net.

``Estimator(strategy="auto")`` (the default) trains data-parallel when the script was launched
with several processes (``WORLD_SIZE > 1``): it initialises the default process group unless the
script did (NCCL for CUDA devices, with gloo beside it for host values; gloo on the CPU), gives each
rank the CUDA device of its ``LOCAL_RANK``, and wraps the net in ``DistributedDataParallel``.
``estimator.net`` stays the user's module, so weights, checkpoints and ``state_dict`` keys are
those of one process; ``estimator.train_net`` is the wrapper ``fit``'s forward goes through.
``strategy="none"`` leaves all of this to the script; ``strategy="ddp"`` asks for DDP explicitly
and ``strategy="fsdp"`` for sharded training (:mod:`fitforge.fsdp`), both an error without a
launcher. See docs/distributed.md.
"""

from __future__ import annotations

import atexit
import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .distributed import initialized, launched, local_rank, rank, world_size
from .exceptions import FitforgeTypeError, FitforgeValueError, describe
from .fsdp import shard

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
        raise FitforgeValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))} or None, got {strategy!r}")
    if options is not None and not isinstance(options, dict):
        raise FitforgeTypeError(f"strategy_options must be a dict of keyword arguments for {name}, "
                                f"got {describe(options)}")
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
        warnings.warn(f"device={str(device)!r} under torchrun: every rank of this machine uses that one GPU; pass "
                      f"device=None or 'cuda' for each rank's own (cuda:LOCAL_RANK)", UserWarning, stacklevel=3)
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
    atexit.register(_destroy_process_group)  # ours to release: NCCL warns of a group left at exit


def _destroy_process_group() -> None:
    if initialized():
        dist.destroy_process_group()


def parallelize(net: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device, strategy: str,
                options: dict | None, wrapper: DistributedDataParallel | None) -> nn.Module:
    """The module ``fit``'s forward goes through: ``wrapper`` (a DDP the user made), a new DDP
    wrapper around ``net``, ``net`` sharded in place (FSDP, see :mod:`fitforge.fsdp`), or ``net``
    itself (one process, or ``strategy="none"``)."""
    if wrapper is not None or strategy == "none":
        return net if wrapper is None else wrapper
    if strategy == "auto" and not _several():
        return net
    if not initialized() and not launched():
        raise FitforgeValueError(f"strategy={strategy!r} needs several processes started by a launcher: run the "
                                 "script with torchrun --nproc_per_node=N (see docs/distributed.md), or pass "
                                 "strategy='auto' to train in one process when not launched")
    init_process_group(device)
    if strategy == "fsdp":
        quiet_other_ranks()
        return shard(net, optimizers, device, options)
    if world_size() == 1:
        return net
    quiet_other_ranks()
    device_ids = [device.index] if device.type == "cuda" else None
    try:
        return DistributedDataParallel(net, device_ids=device_ids, **(options or {}))
    except TypeError as err:
        raise FitforgeTypeError(f"strategy_options {options!r} are not all arguments of DistributedDataParallel: "
                                f"{err}") from err

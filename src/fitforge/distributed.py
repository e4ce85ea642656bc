"""torch.distributed helpers: launch detection, rank and world size, agreement, metric sums reduced.

Under ``torchrun`` (see :mod:`fitforge.parallel`) every rank runs the same script. Collectives
(here: ``all_reduce``, ``broadcast_object_list``, ``gather_object``) must be reached by every rank
in the same order, so each is called from a place every rank passes: an epoch end, a checkpoint
save, the end of ``predict``. Reporting handlers (``main_rank_only``) run on rank 0 only and never
reach one.

Each rank accumulates its own share of the loss and metric sums. At epoch end MetricHandler reduces
them with one ``all_reduce``, so every rank logs, monitors and returns the values of the whole data.
Running (mid-epoch) values stay per rank, because rank-0 handlers such as a progress bar read them
alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .metrics.base import SumCountMetric

T = TypeVar("T")
_CPU_GROUPS: dict[int, Any] = {}  # id(default group) -> a gloo group for host values under NCCL


def initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group, 0 when none is initialised."""
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    """The number of processes in the default group, 1 when none is initialised."""
    return dist.get_world_size() if initialized() else 1


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher setting its variables)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def local_rank() -> int:
    """This process's index on its machine (``LOCAL_RANK``), 0 when not launched."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def cpu_group() -> Any:
    """A group whose backend reduces host tensors: the default one when it has gloo, else a gloo
    group made once (a collective: every rank calls this at the same point, at fit start)."""
    backend = str(dist.get_backend())
    if "gloo" in backend:
        return None  # the default group
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[key]


def agree(fn: Callable[[], T], error_type: type[Exception] = RuntimeError) -> T | None:
    """Run ``fn`` on rank 0 and tell every rank how it went: its result (picklable) is returned on
    every rank, and its exception is raised on every rank (the other ranks' as ``error_type`` with
    rank 0's message), so no rank waits forever in a later collective for one that failed."""
    if world_size() == 1:
        return fn()
    outcome: list[Any] = [None, None]
    error: BaseException | None = None
    if rank() == 0:
        try:
            outcome[0] = fn()
        except Exception as err:
            error, outcome[1] = err, f"{type(err).__name__}: {err}"
    dist.broadcast_object_list(outcome, src=0, group=cpu_group())
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise error_type(f"rank 0 failed ({outcome[1]})")
    return outcome[0]


def gather_to_main(value: Any) -> list[Any] | None:
    """Every rank's ``value`` (picklable) as a list on rank 0, in rank order; None on the others."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(value, gathered, dst=0, group=cpu_group())
    return gathered


@contextmanager
def reduced_sums(metrics: Sequence[SumCountMetric]) -> Iterator[None]:
    """Within the block each metric holds its sum and count totalled over all ranks (one
    ``all_reduce``); after it, this rank's own again (a checkpoint written later in the epoch's end
    keeps every rank's share, not totals it would count twice)."""
    if world_size() == 1 or not metrics:
        yield
        return
    own = [(metric._sum, metric._count) for metric in metrics]
    device = next((m._sum.device for m in metrics if m._sum is not None), _collective_device())
    packed = torch.zeros(2 * len(metrics), dtype=torch.float64, device=device)
    for i, metric in enumerate(metrics):  # int64 sums and counts are exact in float64 up to 2**53
        if metric._sum is not None:
            packed[2 * i] = metric._sum.to(device, torch.float64)
        packed[2 * i + 1] = (
            metric._count.to(device, torch.float64) if isinstance(metric._count, torch.Tensor) else float(metric._count)
        )
    dist.all_reduce(packed)
    for i, metric in enumerate(metrics):
        dtype = metric._sum.dtype if metric._sum is not None else torch.float64
        metric._sum = packed[2 * i].to(dtype)
        total = packed[2 * i + 1]
        metric._count = total if isinstance(metric._count, torch.Tensor) else int(total.item())
    try:
        yield
    finally:
        for metric, (own_sum, own_count) in zip(metrics, own):
            metric._sum, metric._count = own_sum, own_count


def _collective_device() -> torch.device:
    """Where this backend reduces: the current CUDA device under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_main(value: T) -> T:
    """Rank 0's ``value`` (picklable), on every rank."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=cpu_group())
    return box[0]


def reduce_ints(values: Sequence[int], op: str) -> list[int]:
    """``values`` reduced elementwise over all ranks with ``op`` ("max" or "min"), on the host over
    a gloo group (no GPU is synced); ``values`` itself in one process."""
    if world_size() == 1:
        return list(values)
    packed = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=cpu_group())
    return packed.tolist()


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on at least one rank (a collective: every rank must ask)."""
    return bool(reduce_ints([int(flag)], "max")[0])


def mean_over_ranks(value: float) -> float:
    """The mean of ``value`` over all ranks (a collective), ``value`` in one process."""
    if world_size() == 1:
        return value
    packed = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(packed, group=cpu_group())
    return float(packed[0]) / world_size()

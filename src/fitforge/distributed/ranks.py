"""torch.distributed helpers: launch detection, rank and world size, collectives of host values, each
called from a place every rank passes in the same order."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fitforge.core.events import EventHandler
from fitforge.core.processes import ONE_PROCESS

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
    """A group that reduces host tensors: the default one when it has gloo, else a gloo group made once
    (a collective: every rank calls this at the same point, at fit start)."""
    if "gloo" in str(dist.get_backend()):
        return None  # the default group
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[key]


def run_on_main_and_share(fn: Callable[[], T], error_type: type[Exception] = RuntimeError) -> T | None:
    """Run ``fn`` on rank 0; its result (picklable) on every rank, or its exception (the other ranks' as
    ``error_type`` with its message), so no rank waits forever in a later collective for one that failed."""
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


def collective_device() -> torch.device:
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
    """``values`` reduced elementwise over all ranks with ``op`` ("max" or "min"), on the host (no GPU sync)."""
    if world_size() == 1:
        return list(values)
    packed = torch.tensor(list(values), dtype=torch.int64)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=cpu_group())
    return packed.tolist()


def sum_over_ranks(tensor: torch.Tensor) -> None:
    """Replace ``tensor`` by its sum over all ranks, in place, on the default group (a collective)."""
    dist.all_reduce(tensor)


def flat_collective(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], Any]) -> None:
    """``collective`` in place on ``tensors``, one flat tensor per dtype and device (one latency)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        flat = torch.cat([tensor.reshape(-1) for tensor in group])
        collective(flat)
        for tensor, part in zip(group, flat.split([tensor.numel() for tensor in group])):
            tensor.copy_(part.view_as(tensor))


def mean_over_ranks(value: float) -> float:
    """The mean of ``value`` over all ranks (a collective), ``value`` in one process."""
    if world_size() == 1:
        return value
    packed = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(packed, group=cpu_group())
    return float(packed[0]) / world_size()


def on_this_rank(handlers: Sequence[EventHandler]) -> list[EventHandler]:
    """The handlers this rank runs: all on rank 0; on the others all but the ``main_rank_only`` ones."""
    main = rank() == 0
    return [h for h in handlers if main or not h.main_rank_only]


class Collective:
    """The processes of a fit (:class:`fitforge.core.processes.Processes`): every rank asks at the same point."""

    several = True

    def __init__(self) -> None:
        self.rank = rank()
        self.main = self.rank == 0
        self.size = world_size()

    def any(self, flag: bool) -> bool:
        return bool(reduce_ints([int(flag)], "max")[0])

    def min_int(self, value: int) -> int:
        return reduce_ints([value], "min")[0]

    def max_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)

    def sum_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def on_main(self, fn: Callable[[], T], error_type: type[Exception] = RuntimeError) -> T | None:
        return run_on_main_and_share(fn, error_type)


def processes() -> Any:
    """The processes of a run (``state.run.ranks``): a :class:`Collective` with several ranks, else ONE_PROCESS."""
    return Collective() if world_size() > 1 else ONE_PROCESS

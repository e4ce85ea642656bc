"""torch.distributed helpers: rank and world size, and metric sums reduced across ranks.

Reporting handlers (``main_rank_only``: logging, progress bar, CSV, TensorBoard) run on rank 0 only.

When a process group is initialised (``torchrun``; today the net is wrapped in
``DistributedDataParallel`` by the user), each rank accumulates its own share of the loss and metric
sums. At epoch end MetricHandler reduces them with one ``all_reduce``, so every rank logs, monitors
and returns the values of the whole data. It is a collective: every rank must reach it, which every
rank's MetricHandler does at each epoch end. Running (mid-epoch) values stay per rank, because rank-0
handlers such as a progress bar read them alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .metrics.base import SumCountMetric


def rank() -> int:
    """This process's rank in the default group, 0 when none is initialised."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes in the default group, 1 when none is initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def reduce_sums(metrics: Sequence[SumCountMetric]) -> None:
    """Replace each metric's sum and count by their totals over all ranks (one ``all_reduce``)."""
    if world_size() == 1 or not metrics:
        return
    device = next((m._sum.device for m in metrics if m._sum is not None), _collective_device())
    packed = torch.zeros(2 * len(metrics), dtype=torch.float64, device=device)
    for i, metric in enumerate(metrics):  # int64 sums and counts are exact in float64 up to 2**53
        if metric._sum is not None:
            packed[2 * i] = metric._sum.to(device, torch.float64)
        packed[2 * i + 1] = metric._count.to(device, torch.float64) if isinstance(metric._count, torch.Tensor) \
            else float(metric._count)
    dist.all_reduce(packed)
    for i, metric in enumerate(metrics):
        dtype = metric._sum.dtype if metric._sum is not None else torch.float64
        metric._sum = packed[2 * i].to(dtype)
        count = packed[2 * i + 1]
        metric._count = count if isinstance(metric._count, torch.Tensor) else int(count.item())


def _collective_device() -> torch.device:
    """Where this backend reduces: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

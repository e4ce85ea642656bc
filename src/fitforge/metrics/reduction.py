"""Loss and metric sums totalled over torch.distributed ranks at epoch end (one ``all_reduce``), and
their running state saved and resumed across ranks. Running (mid-epoch) values stay per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from fitforge.distributed.ranks import collective_device, gather_to_main, rank, sum_over_ranks, world_size
from fitforge.metrics.base import SumCountMetric


@contextmanager
def reduced_sums(metrics: Sequence[SumCountMetric]) -> Iterator[None]:
    """Within the block each metric holds its sum and count totalled over all ranks; after it, this
    rank's own again (a later checkpoint keeps each rank's share, not totals twice)."""
    if world_size() == 1 or not metrics:
        yield
        return
    own = [(metric._sum, metric._count) for metric in metrics]
    device = next((m._sum.device for m in metrics if m._sum is not None), collective_device())
    packed = torch.zeros(2 * len(metrics), dtype=torch.float64, device=device)
    for i, metric in enumerate(metrics):  # int64 sums and counts are exact in float64 up to 2**53
        if metric._sum is not None:
            packed[2 * i] = metric._sum.to(device, torch.float64)
        packed[2 * i + 1] = (
            metric._count.to(device, torch.float64) if isinstance(metric._count, torch.Tensor) else float(metric._count)
        )
    sum_over_ranks(packed)
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


def several_ranks() -> bool:
    """Whether the sums are shares of several ranks' (their running values then this rank's own)."""
    return world_size() > 1


def rank_states(own: dict, to_host: Callable[[Any], Any]) -> dict:
    """The running state a checkpoint keeps: ``own``, or every rank's on rank 0 (``{"ranks": [...]}``)."""
    return own if world_size() == 1 else {"ranks": gather_to_main(to_host(own))}


def own_share(saved: dict) -> list[dict] | None:
    """The saved states this rank resumes: its own, or with another number of ranks all of them on rank 0."""
    ranks = saved.get("ranks", [saved] if saved else [])
    if len(ranks) == world_size():
        return [ranks[rank()]] if ranks else None
    return ranks if rank() == 0 and ranks else None

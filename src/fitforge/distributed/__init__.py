"""torch.distributed: the engines of a fit (:class:`Strategy`: one process, DDP, FSDP2, or one of
your own, such as DiLoCo), ranks and collectives, launch and process group, data split across ranks, and the stop
agreement behind the loop's coordinator. Only this package imports ``torch.distributed``.

It may import :mod:`fitforge.core` and :mod:`fitforge.exceptions`.
"""

from fitforge.distributed.diloco import DiLoCoStrategy
from fitforge.distributed.ranks import initialized, launched, local_rank, rank, world_size
from fitforge.distributed.strategy import DDPStrategy, Distributed, FSDPStrategy, Strategy

__all__ = [
    "DDPStrategy",
    "DiLoCoStrategy",
    "Distributed",
    "FSDPStrategy",
    "Strategy",
    "initialized",
    "launched",
    "local_rank",
    "rank",
    "world_size",
]

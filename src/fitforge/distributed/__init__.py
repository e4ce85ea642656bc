"""torch.distributed: the engines of a fit (:class:`Strategy`: one process, DDP, FSDP2, DiLoCo or one of
your own), ranks and collectives, the process group, the data split and the stop agreement. Only this
package imports ``torch.distributed``.
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

"""torch.distributed: ranks and collectives, launch and process group, the net's data-parallel
wrapper (DDP, FSDP), data split across ranks, and the stop agreement behind the loop's coordinator.

It may import :mod:`fitforge.core` and :mod:`fitforge.exceptions`.
"""

from fitforge.distributed.ranks import initialized, launched, local_rank, rank, world_size

__all__ = ["initialized", "launched", "local_rank", "rank", "world_size"]

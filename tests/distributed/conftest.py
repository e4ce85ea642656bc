"""Fixtures shared by the distributed tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank, as torchrun --nproc_per_node=1 would make (torn down after)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()

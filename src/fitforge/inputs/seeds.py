"""Random augmentation that resumes: a sample's ``__getitem__`` runs with torch's CPU generator and
Python's ``random`` seeded from (the fit's seed, the epoch, the sample's index), so the same sample
gets the same random transform whatever process reads it (the main one or a worker, of any number),
on any rank, and after a resume from any point (docs/data-at-scale.md, "Augmentation").

:class:`SeededSamples` wraps the dataset; :class:`EpochKeys` wraps the loader's batch sampler so that
each index travels to the workers with its epoch (a persistent worker holds its dataset for every
epoch, so the epoch cannot be a field of the dataset's copy).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 63-bit seed of sample ``index``'s reading in ``epoch`` (unrelated to its neighbours')."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:sample {index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SeededSamples(Dataset):
    """``dataset``, read by ``(epoch, index)`` keys: ``dataset[index]`` with the generators seeded by
    :func:`sample_seed`. In the main process (``num_workers=0``) the generators are put back after
    each sample, so the fit's own draws (dropout, the next epoch's order) do not depend on the data."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        seed = sample_seed(self.seed, epoch, index)
        if get_worker_info() is not None:  # a worker's generators are its own
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            return self.dataset[index]
        # The CPU generator only (torch.manual_seed would reseed every CUDA device too).
        torch_state, python_state = torch.default_generator.get_state(), random.getstate()
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        try:
            return self.dataset[index]
        finally:
            torch.default_generator.set_state(torch_state)
            random.setstate(python_state)


class EpochKeys:
    """The indices ``sampler`` gives (single ones, or lists of a batch sampler's), as ``(epoch, index)``
    keys of :class:`SeededSamples`; ``epoch`` is set before each epoch's pass."""

    def __init__(self, sampler: Iterable, batched: bool, epoch: int = 0) -> None:
        self.sampler, self.batched, self.epoch = sampler, batched, epoch

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        if self.batched:
            return ([(epoch, index) for index in batch] for batch in self.sampler)
        return ((epoch, index) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]  # a sampler without a length has none here either

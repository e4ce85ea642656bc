"""Random augmentation that resumes: a sample's ``__getitem__`` runs with torch's CPU generator seeded
from (the fit's seed, the epoch, the sample's index, and how often the epoch drew it before), so the
same sample gets the same random transform whatever process reads it (the main one or a worker, of any
number), on any rank, and after a resume from any point (docs/data-at-scale.md, "Augmentation").
Other libraries' generators are seeded from ``torch.initial_seed()`` by the dataset itself.

:class:`SeededSamples` wraps the dataset; :class:`EpochKeys` wraps the loader's batch sampler so that
each index travels to the workers with its epoch (a persistent worker holds its dataset for every
epoch, so the epoch cannot be a field of the dataset's copy).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

Key = tuple[int, int, int]  # (epoch, index, the index's earlier draws in the epoch)


def sample_seed(seed: int, epoch: int, index: int, drawn: int = 0) -> int:
    """The 63-bit seed of sample ``index``'s reading in ``epoch``, its ``drawn``-th repeat there (a
    sampler drawing with replacement); unrelated to its neighbours'."""
    repeat = f" {drawn}" if drawn else ""
    digest = hashlib.blake2b(f"{seed}:{epoch}:sample {index}{repeat}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SeededSamples(Dataset):
    """``dataset``, read by :data:`Key` keys: ``dataset[index]`` with torch's CPU generator seeded by
    :func:`sample_seed` (not ``torch.manual_seed``, which would reseed every CUDA device too). In the main
    process (``num_workers=0``) the generator is put back after each batch, so the fit's own draws
    (dropout, the next epoch's order) do not depend on the data. Other attributes are the dataset's (a
    ``worker_init_fn`` opening its files through ``get_worker_info().dataset``)."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Key) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[Key]) -> list[Any]:
        """A batch's samples (the loader's fetcher asks for them so): the generator kept once a batch."""
        generator, dataset, seed = torch.default_generator, self.dataset, self.seed
        kept = None if get_worker_info() is not None else generator.get_state()  # a worker's is its own
        try:
            samples = []
            for epoch, index, drawn in keys:
                generator.manual_seed(sample_seed(seed, epoch, index, drawn))
                samples.append(dataset[index])
            return samples
        finally:
            if kept is not None:
                generator.set_state(kept)


class EpochKeys:
    """The indices ``sampler`` gives (single ones, or lists of a batch sampler's), as :data:`Key` keys of
    :class:`SeededSamples`; ``epoch`` is set before each epoch's pass. With ``repeats`` (a sampler drawing
    with replacement) each index's earlier draws in the epoch are counted, from ``drawn`` (those of the
    epoch's batches before a resumed position), so that a repeated sample is augmented anew."""

    def __init__(self, sampler: Iterable, batched: bool, repeats: bool, drawn: Iterable[Any] = ()) -> None:
        self.sampler, self.batched, self.repeats, self.epoch = sampler, batched, repeats, 0
        self.drawn = drawn

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        if not self.repeats:
            if self.batched:
                return ([(epoch, index, 0) for index in batch] for batch in self.sampler)
            return ((epoch, index, 0) for index in self.sampler)
        counts: Counter[int] = Counter(index for batch in self.drawn for index in _indices(batch, self.batched))
        return self._counted(epoch, counts)

    def _counted(self, epoch: int, counts: Counter[int]) -> Iterator[Any]:
        for batch in self.sampler:
            keys = []
            for index in _indices(batch, self.batched):
                keys.append((epoch, index, counts[index]))
                counts[index] += 1
            yield keys if self.batched else keys[0]

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]  # a sampler without a length has none here either


def _indices(batch: Any, batched: bool) -> Iterable[int]:
    return batch if batched else (batch,)

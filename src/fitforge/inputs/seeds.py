"""Random augmentation that resumes: a sample's ``__getitem__`` runs with torch's CPU generator seeded
from (the fit's seed, the epoch, the sample's index, and how often the epoch drew it before), so the
same sample gets the same random transform whatever process reads it (the main one or a worker, of any
number), on any rank, and after a resume from any point (docs/data-at-scale.md, "Augmentation").
Other libraries' generators are seeded from ``torch.initial_seed()`` by the dataset itself.

:class:`SeededSamples` wraps the dataset; :class:`EpochKeys` wraps the loader's batch sampler so that
each index travels to the workers with its epoch (a persistent worker holds its dataset for every
epoch, so the epoch cannot be a field of the dataset's copy). A torchdata ``StatefulDataLoader`` reading
the keys saves their position as it saves its sampler's (:class:`_Keys`), so a resume reads on from it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, get_worker_info

from fitforge.core.rng import derived_seed
from fitforge.inputs.stateful import is_stateful, is_stateful_loader

Key = tuple[int, int, int]  # (epoch, index, the index's earlier draws in the epoch)


def sample_seed(seed: int, epoch: int, index: int, drawn: int = 0) -> int:
    """The 63-bit seed of sample ``index``'s reading in ``epoch``, its ``drawn``-th repeat there (a
    sampler drawing with replacement); unrelated to its neighbours'."""
    repeat = f" {drawn}" if drawn else ""
    return derived_seed(f"{seed}:{epoch}:sample {index}{repeat}")


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
        drawn = (index for batch in self.drawn for index in _indices(batch, self.batched))
        return _Keys(self.sampler, self.batched, self.epoch, Counter(drawn) if self.repeats else None)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]  # a sampler without a length has none here either


class _Keys:
    """One pass of :class:`EpochKeys`. Its state is its position, so that a torchdata ``StatefulDataLoader``
    reading the keys saves it: the sampler iterator's own state where it has one (torchdata's samplers keep
    their generator's), else the number of indices given, which a load reads past again; and the repeats
    counted."""

    def __init__(self, sampler: Iterable, batched: bool, epoch: int, counts: Counter[int] | None) -> None:
        self.sampler, self.batched, self.epoch, self.counts = sampler, batched, epoch, counts
        self.indices: Any = iter(sampler)  # an iterator: Stateful or not
        self.given = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        indices, epoch, counts = next(self.indices), self.epoch, self.counts
        self.given += 1
        if counts is None:
            return [(epoch, index, 0) for index in indices] if self.batched else (epoch, indices, 0)
        keys = []
        for index in _indices(indices, self.batched):
            keys.append((epoch, index, counts[index]))
            counts[index] += 1
        return keys if self.batched else keys[0]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"given": self.given}
        if is_stateful(self.indices):
            state["indices"] = self.indices.state_dict()
        if self.counts is not None:
            state["counts"] = dict(self.counts)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.indices, self.given = iter(self.sampler), state["given"]
        if self.counts is not None:
            self.counts = Counter(state.get("counts", {}))
        if "indices" in state:
            self.indices.load_state_dict(state["indices"])  # a Stateful's, saved by state_dict
        else:
            next(itertools.islice(self.indices, self.given, self.given), None)  # reads past the indices given


def _indices(batch: Any, batched: bool) -> Iterable[int]:
    return batch if batched else (batch,)


def unseedable(data: Iterable, problem: str | None) -> str | None:
    """Why ``data``'s samples cannot be read with per-sample seeds (None: they can): a DataLoader (or
    torchdata's StatefulDataLoader over a dataset without a state of its own) over a map-style dataset
    whose positions are exact, read sample by sample, with transforms to seed."""
    if problem is not None:
        return problem
    if not isinstance(data, DataLoader) or (type(data) is not DataLoader and not is_stateful_loader(data)):
        return f"it is a {type(data).__name__}, not a DataLoader or torchdata's StatefulDataLoader"
    if is_stateful_loader(data) and is_stateful(data.dataset):
        return f"its {type(data.dataset).__name__} keeps a state of its own, which its loader saves"
    if isinstance(data.dataset, TensorDataset):
        return "its TensorDataset has no transform to seed"
    if isinstance(data.dataset, IterableDataset):
        return "its dataset is an IterableDataset, which has no indices"
    if callable(getattr(data.dataset, "__getitems__", None)):
        return f"its {type(data.dataset).__name__} reads whole batches (__getitems__), not sample by sample"
    return None


def keyed_loader(
    cls: type[DataLoader],
    samples: SeededSamples,
    indices: Iterable,
    loader: DataLoader,
    options: dict[str, Any],
    repeats: bool,
    drawn: Sequence = (),
) -> tuple[DataLoader, EpochKeys]:
    """A ``cls`` loader reading ``samples`` by the keys of ``indices`` (batches of them, or single ones, as
    ``loader``'s), after the epoch's ``drawn`` ones."""
    batched = loader.batch_sampler is not None
    keys = EpochKeys(indices, batched, repeats, drawn)
    if batched:
        return cls(samples, batch_sampler=keys, **options), keys
    return cls(samples, batch_size=None, sampler=keys, **options), keys

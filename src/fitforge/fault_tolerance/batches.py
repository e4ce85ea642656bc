"""Each committed step's global batch, split over the replica groups the quorum holds at that step
(docs/distributed.md#fault-tolerance): the position in the epoch is the committed step, so a step that
fails its commit is read again, split over the groups that retry it, and no sample is lost or repeated."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from fitforge.core.batches import sampler_of
from fitforge.exceptions import FitforgeValueError, describe
from fitforge.inputs.placement import epoch_permutation


class Quorum(Protocol):
    """What the batches ask of the engine (a :class:`~fitforge.fault_tolerance.FaultTolerantStrategy`)."""

    seed: int

    def committed_steps(self) -> int: ...

    def next_quorum(self) -> tuple[int, int]: ...


class Share(NamedTuple):
    """This group's part of one step's global batch.

    Attributes:
        step: the committed step it trains (the run's ``global_step`` once committed).
        indices: the dataset indices this group reads (one of the global batch, with weight 0, when the
            batch has fewer samples than groups).
        weight: its share of the global batch's samples; its gradient is scaled by it before the sum.
        groups: how many replica groups share the step.
        rank: this group's rank among them.
    """

    step: int
    indices: list[int]
    weight: float
    groups: int
    rank: int


def why_not_split(data: object) -> str | None:
    """Why ``data`` cannot be split by sample index over the groups (None when it can)."""
    if not isinstance(data, DataLoader) or type(data).__iter__ is not DataLoader.__iter__:
        return f"it is {describe(data)}, not a torch DataLoader"
    if isinstance(data.dataset, IterableDataset):
        return "its dataset is an IterableDataset, which has no indices"
    if type(data.batch_sampler) is not BatchSampler:
        return "it has no batch size of torch's BatchSampler (batch_size=None, or a batch_sampler of its own)"
    sampler = sampler_of(data)
    if type(sampler) not in (RandomSampler, SequentialSampler):
        return f"its sampler {type(sampler).__name__} is not shuffle=True or shuffle=False"
    if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler.num_samples != len(sampler.data_source)):
        return "its RandomSampler draws with replacement or another number of samples than the dataset's"
    return None


class QuorumBatches(IterableDataset):
    """``loader``'s epochs, each step's batch of ``batch_size`` samples split over the live groups.

    The epoch's order is the seeded order of :mod:`fitforge.inputs.placement` (the engine's seed, the
    same on every group); step ``k`` of the epoch reads samples ``[k * batch_size, (k + 1) * batch_size)``
    of it, and group ``r`` of ``P`` reads the ``r``-th of ``P`` contiguous slices. Samples are read in
    this process (the loader's workers are not used), collated by the loader's ``collate_fn``.
    """

    def __init__(self, loader: DataLoader, quorum: Quorum) -> None:
        problem = why_not_split(loader)
        if problem is not None:
            raise FitforgeValueError(
                f"FaultTolerantStrategy splits each step's batch over the live replica groups by sample index, and "
                f"train_data cannot be split so: {problem}. Pass a DataLoader over a map-style dataset with "
                "batch_size=... and shuffle=True or False"
            )
        batches: BatchSampler = loader.batch_sampler  # type: ignore[assignment]  # checked above
        self.dataset, self.collate = loader.dataset, loader.collate_fn
        self.size = len(loader.dataset)  # type: ignore[arg-type]
        self.batch_size, self.drop_last = batches.batch_size, batches.drop_last
        self.shuffled = isinstance(sampler_of(loader), RandomSampler)
        self.quorum = quorum
        self.epoch, self.start = 0, 0  # the epoch and the committed step it began at
        self._loaded: tuple[int, int] | None = None  # (epoch, start) a resume loaded, for its epoch
        self._order: tuple[int, list[int]] | None = None  # (epoch, its permutation)
        self.share: Share | None = None  # the share of the batch read last

    def __len__(self) -> int:
        """Steps in an epoch (committed ones; a failed commit reads its step again)."""
        return self.size // self.batch_size if self.drop_last else math.ceil(self.size / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Begin ``epoch`` at the current committed step (or where a resume left it)."""
        loaded, self._loaded = self._loaded, None
        self.epoch = epoch
        self.start = loaded[1] if loaded is not None and loaded[0] == epoch else self.quorum.committed_steps()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._loaded = (state["epoch"], state["start"])

    def order(self) -> list[int]:
        """The current epoch's order of the dataset's indices."""
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_permutation(self.size, self.shuffled, self.quorum.seed, self.epoch))
        return self._order[1]

    def split(self, step: int, groups: int, rank: int) -> Share:
        """Group ``rank`` of ``groups``'s share of committed step ``step``."""
        k = step - self.start
        whole = self.order()[k * self.batch_size : (k + 1) * self.batch_size]
        mine = whole[rank * len(whole) // groups : (rank + 1) * len(whole) // groups]
        if not mine:  # fewer samples than groups: one read, weighing nothing, so that the group still steps
            return Share(step, whole[:1], 0.0, groups, rank)
        return Share(step, mine, len(mine) / len(whole), groups, rank)

    def __iter__(self) -> Iterator[Any]:
        steps = len(self)
        while self.quorum.committed_steps() - self.start < steps:
            groups, rank = self.quorum.next_quorum()
            step = self.quorum.committed_steps()  # a group the quorum healed goes on from its peers' step
            if step - self.start >= steps:
                return
            self.share = self.split(step, groups, rank)
            yield self.collate([self.dataset[i] for i in self.share.indices])

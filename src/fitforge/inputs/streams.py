"""A Hugging Face stream that every rank and worker reads whole, each keeping its share, so that its
position is one state for all of them: a resume on any number of ranks, workers or batch size continues
the epoch with every example once (docs/data-at-scale.md, "Streams across ranks").

The stream, as the user built it (its shard order and shuffle buffer, seeded by ``set_epoch``), goes in
steps of ``ranks * batch_size`` examples. Worker ``g % workers`` of every rank reads step ``g`` and each rank
takes its slice, so every rank has as many batches (DDP's lockstep holds at the epoch's end), a loader's
in-order round robin over its workers gives the steps in order, and the stream's state after a step is the
same on every reader: the position of each shard and the content of the shuffle buffer, which a checkpoint
saves (:mod:`fitforge.inputs.shuffle_buffer`). The cost: every reader parses every example, its map
functions included.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fitforge.core.batches import loader_options
from fitforge.core.rng import derived_seed
from fitforge.distributed.data_split import unsplit_stream
from fitforge.distributed.ranks import rank, reduce_ints, world_size
from fitforge.exceptions import FitforgeValueError
from fitforge.inputs.stateful import datasets_internals
from fitforge.signals.worker_shield import shielded

log = logging.getLogger("fitforge")


def shared_stream(data: object, resumable: bool, split: bool = True) -> SharedStream | None:
    """``data`` read as a :class:`SharedStream` where it is a plain ``DataLoader`` (``fit(dataset, batch_size=)``
    makes one) batching a Hugging Face ``datasets.IterableDataset`` the user did not split (with
    ``split_dataset_by_node``), on several ranks (``split``: the strategy splits the data) or, on one, where a
    checkpoint may save its position; None otherwise (read as it is)."""
    ranks = world_size() if split else 1
    if not unsplit_stream(data) or (ranks == 1 and not resumable):
        return None
    if datasets_internals() is None:  # warned about already
        if ranks > 1:
            log.warning("train_data's stream is not split across the %d ranks: every rank trains on all of it", ranks)
        return None
    assert isinstance(data, DataLoader) and data.batch_size is not None  # for the type checker
    source = data.dataset
    if ranks > 1:
        _check_same_stream(source)
    reader = StreamShare(source, data.batch_size, data.drop_last, data.collate_fn, ranks, rank() if ranks > 1 else 0)
    options = loader_options(data, data.generator) | {"collate_fn": _as_read}
    options["persistent_workers"] = data.persistent_workers
    if "in_order" in options:  # the steps in their order: the state of the last one read is the position
        options["in_order"] = True
    return SharedStream(DataLoader(reader, batch_size=None, **options), source)


def _check_same_stream(source: Any) -> None:
    """Every rank's stream must be the same one, each keeping its share of it: a shuffle without a seed
    draws its own on every rank, and a stream a rank split itself (``.shard()``) holds other files."""
    digest = derived_seed(datasets_internals().stream_identity(source))
    highest, lowest = reduce_ints([digest, -digest], "max")
    if highest != -lowest:
        raise FitforgeValueError(
            "train_data's stream differs between the ranks, which each read it whole and keep their share of its "
            "order: give its shuffle a seed, dataset.shuffle(seed=42, buffer_size=...), the same on every rank, "
            "and give every rank all the files, unsplit (no .shard() or split_dataset_by_node: fitforge splits it)"
        )


class StreamShare(IterableDataset):
    """One rank's batches of ``source``'s stream, each with the stream's state after its step
    (a :class:`Snapshot`); in a loader's worker, the steps of that worker.

    Attributes:
        resumed: the epoch whose state the stream was given by a resume (None: none).
    """

    def __init__(
        self, source: Any, batch_size: int, drop_last: bool, collate_fn: Callable, ranks: int, rank: int
    ) -> None:
        self.source, self.batch_size, self.drop_last, self.collate_fn = source, batch_size, drop_last, collate_fn
        self.ranks, self.rank = ranks, rank
        self.resumed: int | None = None

    def __iter__(self) -> Iterator[tuple[Any, Snapshot]]:
        from fitforge.inputs.shuffle_buffer import whole_stream  # datasets' internals: imported with datasets

        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        step = self.batch_size * self.ranks
        # A step too small for every rank joins the one before: known only by reading ahead. Without that
        # (one rank, or drop_last), in this process the stream's state is its position when a batch is trained.
        ahead = self.ranks > 1 and not self.drop_last
        live = not ahead and info is None
        examples = whole_stream(self.source, in_worker=info is not None)
        batch, index = list(islice(examples, step)), 0
        while batch:
            mine = index % workers == worker
            state = None if live or not mine else self.source.state_dict()  # a copy: the buffer moves on
            following = list(islice(examples, step)) if ahead and len(batch) == step else []
            if 0 < len(following) < self.ranks:  # too few for a batch on every rank
                batch, following = batch + following, []
                state = self.source.state_dict() if mine else None
            if len(batch) < step and self.drop_last:
                return
            if len(batch) < self.ranks:
                self._too_few(len(batch), first=index == 0)
                return
            if mine:
                yield self.collate_fn(self._share(batch)), Snapshot(LIVE if live else state)
            batch, index = (following if ahead else list(islice(examples, step))), index + 1

    def _too_few(self, examples: int, first: bool) -> None:
        """An epoch (or the rest of a resumed one) of fewer examples than ranks, which cannot all have a batch."""
        if not first or self.resumed == self.source.epoch:
            log.warning(
                "the stream's epoch ends with %d example(s) for %d ranks, which cannot all have a batch: they are "
                "left out of this epoch",
                examples,
                self.ranks,
            )
            return
        raise FitforgeValueError(
            f"train_data's stream holds {examples} example(s) in epoch {self.source.epoch + 1}, fewer than the "
            f"{self.ranks} ranks that share it, each of which needs a batch: give it more data, or train on fewer ranks"
        )

    def _share(self, batch: list) -> list:
        """This rank's slice of a step: ``batch_size`` examples, or, in a last step, an even part of it."""
        each, more = divmod(len(batch), self.ranks)
        start = self.rank * each + min(self.rank, more)
        return batch[start : start + each + (self.rank < more)]


LIVE = "live"  # a Snapshot's state in this process without reading ahead: the stream's own, asked when saved


class Snapshot:
    """The stream's state after a batch's step, carried beside the batch (pinning leaves it alone)."""

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state


def _as_read(item: Any) -> Any:  # the loader's collate_fn: its reader collates the batches itself
    return item


class SharedStream:
    """The batches of a loader over a :class:`StreamShare`, and the stream's state after the last one read
    (the position :class:`~fitforge.inputs.order.DataOrder` saves and loads)."""

    def __init__(self, loader: DataLoader, source: Any) -> None:
        self.loader, self.source = loader, source
        self._state: Any = None

    def __iter__(self) -> Iterator[Any]:
        for batch, snapshot in shielded(self.loader):
            self._state = snapshot.state
            yield batch

    @property
    def generator(self) -> Any:  # its workers' seeds: given one by DataOrder, as any loader's
        return self.loader.generator

    @generator.setter
    def generator(self, generator: Any) -> None:
        self.loader.generator = generator

    def state_dict(self) -> Any:
        return self.source.state_dict() if self._state is LIVE else self._state

    def load_state_dict(self, state: Any) -> None:
        self.source.load_state_dict(state)  # applied by the stream in the epoch it was saved in
        self.loader.dataset.resumed = None if state is None else state.get("epoch")  # type: ignore[attr-defined]

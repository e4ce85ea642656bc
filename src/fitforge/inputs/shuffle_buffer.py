"""A Hugging Face ``datasets.IterableDataset``'s shuffle buffer whose state holds its content.

``ds.shuffle(seed=..., buffer_size=...)`` streams through a buffer: ``datasets`` saves where its source
is, but not the examples in the buffer, nor its generator ("examples from shuffle buffers are lost when
resuming", its ``state_dict`` docs say), so a resumed stream differs from the uninterrupted one. During a
fit that saves checkpoints, fitforge puts :class:`ResumableShuffleBuffer` in the buffer's place: the same
algorithm drawing the same numbers, filled example by example (its order may differ from ``datasets``'
own, which with a format such as "torch" fills its buffer with Arrow tables), whose state also holds the
buffered examples, those drawn but not yet yielded, and its generator. The data's state in a checkpoint
then continues the stream exactly, and no example consumed before it is read again (``datasets`` itself
may read a source's open chunk again, as its own resume does). The examples must be plain values or
tensors, as a checkpoint loads with ``weights_only=True``. A state is a copy of the buffer: taken at each
checkpoint, and in a ``StatefulDataLoader``'s workers at each of its snapshots (every batch by default).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from copy import copy, deepcopy
from typing import Any

import fsspec.asyn
from datasets.builder import Key
from datasets.formatting import get_formatter
from datasets.iterable_dataset import (
    BufferShuffledExamplesIterable,
    InterleavedShardsExamplesIterable,
    _BaseExamplesIterable,
)


class ResumableShuffleBuffer(BufferShuffledExamplesIterable):
    """``datasets``' shuffle buffer, example by example, its content in its state."""

    @property
    def iter_arrow(self) -> None:  # the buffer is one of examples: Arrow tables would not go in its state
        return None

    def _init_state_dict(self) -> dict:
        # None, not []: datasets loads a state into this one key by key, and an empty list would stay empty.
        self._state_dict = {"source": self.ex_iterable._init_state_dict(), "kept": None, "drawn": None, "rng": None}
        self._state_dict["yielded"] = 0  # of ``drawn``
        return self._state_dict

    def load_state_dict(self, state_dict: dict) -> dict:
        return _BaseExamplesIterable.load_state_dict(self, state_dict)  # without the parent's warning: nothing is lost

    def __iter__(self) -> Iterator[Any]:
        state = self._state_dict if self._state_dict is not None else self._init_state_dict()
        rng = deepcopy(self.generator)
        if state["rng"] is not None:  # resumed: the generator as it was after the last draw
            rng.bit_generator.state = state["rng"]
        kept: list = list(state["kept"] or ())
        drawn: list = list(state["drawn"] or ())
        state["kept"], state["drawn"] = kept, drawn
        for i in range(state["yielded"], len(drawn)):  # the rest of the draw a checkpoint interrupted
            state["yielded"] = i + 1
            yield _key(drawn[i][0]), drawn[i][1]
        half = self.buffer_size // 2
        for key, example in self.ex_iterable:
            kept.append((_plain(key), example))
            if len(kept) >= self.buffer_size:  # as datasets: shuffle the full buffer, yield all but half of it
                order = rng.permutation(len(kept))
                drawn = [kept[i] for i in order[: len(kept) - half]]
                kept = [kept[i] for i in order[len(kept) - half :]]
                state.update(kept=kept, drawn=drawn, yielded=0, rng=rng.bit_generator.state)
                for i, (key, example) in enumerate(drawn):
                    state["yielded"] = i + 1
                    yield _key(key), example
        if kept:
            order = rng.permutation(len(kept))
            drawn, kept = [kept[i] for i in order], []
            state.update(kept=kept, drawn=drawn, yielded=0, rng=rng.bit_generator.state)
            for i, (key, example) in enumerate(drawn):
                state["yielded"] = i + 1
                yield _key(key), example

    def shift_rngs(self, value: int) -> ResumableShuffleBuffer:
        return _resumable(super().shift_rngs(value))

    def shuffle_data_sources(self, generator: Any) -> ResumableShuffleBuffer:
        return _resumable(super().shuffle_data_sources(generator))

    def shard_data_sources(self, num_shards: int, index: int, contiguous: bool = True) -> ResumableShuffleBuffer:
        return _resumable(super().shard_data_sources(num_shards, index, contiguous=contiguous))

    def reshard_data_sources(self) -> ResumableShuffleBuffer:
        return _resumable(super().reshard_data_sources())


def _plain(key: Any) -> Any:
    """An example's key as a checkpoint holds it (loaded with ``weights_only=True``: no class of datasets')."""
    return {"shard": key.original_shard_id, "item": key.item_or_batch_id} if type(key) is Key else key


def _key(plain: Any) -> Any:
    return Key(plain["shard"], plain["item"]) if type(plain) is dict else plain


def _resumable(buffer: BufferShuffledExamplesIterable) -> ResumableShuffleBuffer:
    return ResumableShuffleBuffer(buffer.ex_iterable, buffer_size=buffer.buffer_size, generator=buffer.generator)


def make_buffers_resumable(dataset: Any) -> Callable[[], None] | None:
    """Put a :class:`ResumableShuffleBuffer` in the place of every shuffle buffer of ``dataset`` (a
    ``datasets.IterableDataset``); returns what puts its own back (None: it has none). The nodes on the
    way are copied: datasets derived from one another share them."""
    original, starting = dataset._ex_iterable, dataset._starting_state_dict
    replaced = _replace(original)
    if replaced is original:
        return None
    dataset._ex_iterable = replaced

    def put_back() -> None:
        # A state a resume loaded is the replacement's: datasets applies it again at each pass of its epoch.
        dataset._ex_iterable, dataset._starting_state_dict = original, starting

    return put_back


def _replace(node: Any) -> Any:
    """``node`` with its shuffle buffers (itself, or below it) made resumable; ``node`` itself when it has none."""
    if type(node) is BufferShuffledExamplesIterable:
        return _resumable(node)
    changed = copy(node)
    if hasattr(node, "ex_iterable"):
        changed.ex_iterable = _replace(node.ex_iterable)
        return changed if changed.ex_iterable is not node.ex_iterable else node
    if hasattr(node, "ex_iterables"):
        changed.ex_iterables = [_replace(child) for child in node.ex_iterables]
        return changed if any(a is not b for a, b in zip(changed.ex_iterables, node.ex_iterables)) else node
    return node


def stream_identity(dataset: Any) -> str:
    """What makes ``dataset``'s stream (a ``datasets.IterableDataset``) the one it is: its shard count, the
    files of its sources and the state of every generator of its shuffles. Equal in two processes that built it
    alike; a shuffle without a seed draws its own, and ``.shard()`` keeps some of the files."""
    parts: list = [dataset.num_shards]
    nodes = [dataset._ex_iterable]
    while nodes:
        node = nodes.pop()
        if getattr(node, "generator", None) is not None:
            parts.append(node.generator.bit_generator.state)
        for value in getattr(node, "kwargs", {}).values():  # a source's: its files, as paths
            if isinstance(value, list) and all(isinstance(item, str) for item in value):
                parts.append(value)
        nodes += [node.ex_iterable] if hasattr(node, "ex_iterable") else list(getattr(node, "ex_iterables", ()))
    return repr(parts)


def interleaves_shards(dataset: Any) -> bool:
    """Whether ``dataset``'s shuffle reads several shards at once (``max_buffer_input_shards`` > 1), whose
    state ``datasets`` (5.2) cannot load in a DataLoader worker: it loads a worker's state into the whole
    pipeline before splitting it between the workers (an IndexError)."""
    nodes = [dataset._ex_iterable]
    while nodes:
        node = nodes.pop()
        if type(node) is InterleavedShardsExamplesIterable:
            return True
        nodes += [node.ex_iterable] if hasattr(node, "ex_iterable") else list(getattr(node, "ex_iterables", ()))
    return False


def whole_stream(dataset: Any, in_worker: bool) -> Iterator[Any]:
    """Every example of ``dataset`` (a ``datasets.IterableDataset``), as it yields them in the main process,
    also in a DataLoader worker (``in_worker``), where its own iteration reads only that worker's shards."""
    if in_worker:  # as datasets does in a worker: fsspec's lock, inherited from the parent, may be held
        fsspec.asyn.reset_lock()
    ex_iterable = dataset._prepare_ex_iterable_for_iteration()  # loads a resumed state of this epoch
    formatting = dataset._formatting
    if formatting and (ex_iterable.iter_arrow or formatting.is_table):
        formatter = get_formatter(formatting.format_type, features=dataset.features)
        for _, table in ex_iterable.iter_arrow():
            yield formatter.format_row(table)
        return
    for _, example in ex_iterable:
        yield example

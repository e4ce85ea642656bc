"""Training data that keeps its own position: an object with ``state_dict()`` and ``load_state_dict()``
(torchdata's ``Stateful`` protocol), whose state a checkpoint saves and a resume loads instead of reading
and discarding the batches before the checkpoint (docs/data-at-scale.md, "Stateful loaders").

It is ``train_data`` itself (torchdata's ``StatefulDataLoader``, a Hugging Face ``datasets.IterableDataset``,
a packer), or the ``IterableDataset`` that a plain single-process ``DataLoader`` reads: such a loader reads
its dataset on demand, one batch at a time, so the dataset's state is the loader's position. In worker
processes the dataset's state stays in the workers, which a plain ``DataLoader`` does not report.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import DataLoader, IterableDataset

log = logging.getLogger("fitforge")


@runtime_checkable
class Stateful(Protocol):
    """torchdata's ``Stateful`` protocol (``torchdata.stateful_dataloader.Stateful``), without importing torchdata."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` follows torchdata's ``Stateful`` protocol (by its class: methods, as torchdata's)."""
    cls = type(obj)
    known = _STATEFUL_CLASSES.get(cls)
    if known is None:  # a protocol's check walks the class's attributes (~10 µs): once per class, not per fit
        known = _STATEFUL_CLASSES[cls] = issubclass(cls, Stateful)
    return known


_STATEFUL_CLASSES: dict[type, bool] = {}


def position_holder(data: object) -> tuple[Any, str | None]:
    """The object whose state is ``data``'s position in its epoch (None: none), and, when a dataset has a
    state that cannot be saved or loaded where the loader reads it, why (for the warning of a resume)."""
    if is_stateful(data):
        if isinstance(data, DataLoader) and data.num_workers > 0 and _interleaves_shards(data.dataset):
            return None, (
                f"its dataset's shuffle reads several shards at once, whose state datasets cannot load in "
                f"{type(data).__name__}'s worker processes: shuffle with max_buffer_input_shards=1 (or num_workers=0)"
            )
        return data, None
    if not isinstance(data, DataLoader) or not isinstance(data.dataset, IterableDataset):
        return None, None
    dataset = data.dataset
    if not is_stateful(dataset):
        return None, None
    if data.num_workers == 0:
        return dataset, None
    return None, (
        f"its {type(dataset).__name__} has a state, but a plain DataLoader reads it in {data.num_workers} worker "
        "process(es), whose states it does not report: pass torchdata's StatefulDataLoader (pip install "
        "'fitforge[data]'), which saves them, with the same arguments, or num_workers=0"
    )


def is_stateful_loader(data: object) -> bool:
    """Whether ``data`` is torchdata's ``StatefulDataLoader`` itself (a subclass may read otherwise); looked
    up, not imported: such data means torchdata is imported already."""
    library = sys.modules.get("torchdata.stateful_dataloader")
    return library is not None and type(data) is library.StatefulDataLoader


def epoch_setter(data: object) -> Any:
    """The dataset that ``set_epoch`` gives its epoch's order to (a Hugging Face ``IterableDataset``: its
    shuffle seed is the seed plus the epoch, and a loaded state applies to the epoch it was saved in)."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    return dataset if isinstance(dataset, IterableDataset) and callable(getattr(dataset, "set_epoch", None)) else None


def resumable_buffers(data: object) -> Callable[[], None] | None:
    """Make the shuffle buffers of a Hugging Face ``IterableDataset`` in ``data`` (itself, or a loader's
    dataset) resumable (:mod:`fitforge.inputs.shuffle_buffer`); returns what puts them back (None: none).
    ``datasets`` is looked up, not imported: data of it means it is imported already."""
    library = sys.modules.get("datasets")
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if library is None or not isinstance(dataset, library.IterableDataset):
        return None
    shuffle_buffer = datasets_internals()
    return None if shuffle_buffer is None else shuffle_buffer.make_buffers_resumable(dataset)


def _interleaves_shards(dataset: object) -> bool:
    library = sys.modules.get("datasets")
    if library is None or not isinstance(dataset, library.IterableDataset):
        return False
    shuffle_buffer = datasets_internals()
    return shuffle_buffer is not None and shuffle_buffer.interleaves_shards(dataset)


@functools.cache  # imported, or warned about, once a process
def datasets_internals() -> Any:
    """:mod:`fitforge.inputs.shuffle_buffer`, which builds on ``datasets``' private classes; None, with a
    warning, where this ``datasets`` has them no more (its own buffer, which a resume loses, stays, and a
    stream is not shared by the ranks, :mod:`fitforge.inputs.streams`)."""
    try:
        from fitforge.inputs import shuffle_buffer
    except ImportError as error:
        log.warning(
            "datasets %s moved the shuffle buffer's classes fitforge resumes (%s): a resumed stream loses the "
            "examples in its shuffle buffer, and under torchrun every rank reads all of it; use datasets 5.x",
            getattr(sys.modules.get("datasets"), "__version__", "?"),
            error,
        )
        return None
    return shuffle_buffer

"""Batches: unpacking, device transfer, batch-size inference, the nan/inf check, and what a DataLoader
is built from (its sampler, its loading options).

A training batch is a pair ``(data, label)``: ``data`` a tensor or a tuple of tensors (the net's
positional arguments), ``label`` a tensor, a tuple of tensors (one per loss, by position) or a dict
of tensors (one per output name, for a dict ``loss``); or a dict (any Mapping, e.g. a
``BatchEncoding``) of the net's keyword arguments with the label under ``"labels"`` or ``"label"``.
A batch of data alone is *label-less*: a tensor, ``(data,)`` (what a ``TensorDataset(X)`` gives), or
a dict without a label key; its label is None, for a net that computes its own loss
(``Estimator(loss=None)``). Other formats: override ``BatchProcessor.unpack``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils.data

from fitforge.exceptions import BatchFormatError, NonFiniteInputError, describe

_SEQUENCES = (tuple, list)
_PAIR_HELP = "return (data, label) from your Dataset/collate_fn, or override BatchProcessor.unpack"
_SEVERAL_HELP = (
    "several labels go in one label: (x, (y1, y2)), matched by position to the outputs and a list loss, or a "
    "dict (x, {'cls': y1, 'reg': y2}), matched by name to a dict loss (loss={'cls': ..., 'reg': ...}); several "
    "inputs in one data: ((x1, x2), y). Return that from your Dataset/collate_fn (a TensorDataset(x, y1, y2) "
    "gives (x, y1, y2)), or override BatchProcessor.unpack"
)
_LISTS_HELP = (
    "the batch holds Python lists, not tensors: whole arrays go to fit as NumPy arrays or tensors, "
    "fit((numpy.asarray(X, dtype=numpy.float32), numpy.asarray(y)), batch_size=...), and a Dataset or "
    "collate_fn returns tensors"
)
_ARRAY_HELP = (
    "the batch is a NumPy array, not a tensor: whole arrays go as fit((X, y)), evaluate((X, y)) or "
    "predict(X), which batch them, with every part an array (numpy.asarray(y) for a list); a tuple holding "
    "anything else is read as a list of batches"
)


def is_array(item: object) -> bool:
    """A tensor, or a NumPy array (anything NumPy-like: ``__array__`` and a ``shape``)."""
    return isinstance(item, torch.Tensor) or (
        hasattr(item, "__array__") and hasattr(item, "shape") and hasattr(item, "dtype")
    )


LABEL_KEYS = ("labels", "label")  # where a dict batch holds its label, in the order looked for
Inputs = tuple[torch.Tensor, ...] | dict[str, Any]  # positional inputs, or a dict batch's keyword inputs


def _tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)


# A list or tuple of more than _ALL_SHOWN items is described by its first _SHOWN_ITEMS: a list of rows
# (arrays given as Python lists) would fill pages of an error message.
_ALL_SHOWN, _SHOWN_ITEMS = 6, 3


def shape_of(value: Any) -> str:
    """A description of a batch part for error messages: "tensor of shape (4, 3)", "tuple of 2 [...]"
    (a long one by its first items)."""
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        shown = value if len(value) <= _ALL_SHOWN else value[:_SHOWN_ITEMS]
        items = [shape_of(v) for v in shown]
        if len(shown) < len(value):
            items.append(f"... {len(value) - len(shown)} more")
        return f"{type(value).__name__} of {len(value)} [" + ", ".join(items) + "]"
    if isinstance(value, Mapping) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        return "dict {" + ", ".join(f"{k!r}: {shape_of(v)}" for k, v in value.items()) + "}"
    return describe(value)


def unpack_batch(batch: Any, label_keys: tuple[str, ...] = LABEL_KEYS) -> tuple[Inputs, Any]:
    """Split a batch into ``(inputs as a tuple, label)``, or a dict batch into its keyword inputs and
    the label under the first of ``label_keys`` it has; a label-less batch (module docstring) gives
    the label None. Raise a clear error for anything else."""
    if type(batch) in _SEQUENCES and len(batch) == 2:  # the common (tensor, tensor) batch, checked cheaply
        data, label = batch
        if type(data) is torch.Tensor and type(label) is torch.Tensor:
            return (data,), label
    if isinstance(batch, Mapping):  # a dict batch: the net's keyword inputs, and the label if it has one
        key = next((key for key in label_keys if key in batch), None)
        return {k: v for k, v in batch.items() if k != key}, (None if key is None else batch[key])
    if isinstance(batch, torch.Tensor):
        return (batch,), None
    if isinstance(batch, _SEQUENCES) and len(batch) == 1 and _tensors(batch[0]):
        data = batch[0]
        return ((data,) if isinstance(data, torch.Tensor) else tuple(data)), None
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise BatchFormatError(
            f"a batch must be a (data, label) pair or data alone, got a {shape_of(batch)}: {_pair_help(batch)}"
        )
    data, label = batch
    if not _tensors(data) or not _tensors(list(label.values()) if isinstance(label, Mapping) else label):
        raise BatchFormatError(
            f"a batch must be a (data, label) pair of tensors or tuples of tensors (the label may be a dict of "
            f"tensors), got data: {shape_of(data)}, label: {shape_of(label)}: "
            f"{_LISTS_HELP if _holds_lists(data) else _PAIR_HELP}"
        )
    inputs = (data,) if isinstance(data, torch.Tensor) else tuple(data)
    return inputs, (label if isinstance(label, (torch.Tensor, Mapping)) else tuple(label))


def _pair_help(batch: Any) -> str:
    """What to do about a batch that is not a pair: what it most likely was meant to be."""
    if is_array(batch) and not isinstance(batch, torch.Tensor):  # a NumPy array: part of (X, y) arrays
        return _ARRAY_HELP
    if _holds_lists(batch):
        return _LISTS_HELP
    return _SEVERAL_HELP if isinstance(batch, (tuple, list)) and len(batch) > 2 else _PAIR_HELP


def _holds_lists(batch: Any) -> bool:
    """A list or tuple of plain numbers or of lists of them: rows of an array given as Python lists."""
    if not isinstance(batch, (tuple, list)) or not batch:
        return False
    first = batch[0]
    return isinstance(first, numbers.Number) or (
        isinstance(first, (tuple, list)) and bool(first) and isinstance(first[0], numbers.Number)
    )


def label_key_of(batch: Mapping, label_keys: tuple[str, ...] = LABEL_KEYS) -> str:
    """The first of ``label_keys`` in a dict batch; a clear error when it has none."""
    for key in label_keys:
        if key in batch:
            return key
    raise BatchFormatError(
        f"got a dict batch with keys {list(batch)} and no label: put the label under "
        f"{' or '.join(map(repr, label_keys))}, the net's inputs under its forward's argument names, or name "
        f"the label's key with BatchProcessor(label_key=...); or {_PAIR_HELP}"
    )


def unpack_inputs(
    batch: Any, unpack: Callable[[Any], tuple] | None = None, label_keys: tuple[str, ...] = LABEL_KEYS
) -> Inputs:
    """The inputs of a predict batch: a bare tensor, ``(data,)``, a dict batch without its label, or
    a ``(data, label)`` pair's data; ``unpack``, a processor's override, splits anything else."""
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, Mapping) and unpack is None:  # predict: the label, if any, is dropped
        return {k: v for k, v in batch.items() if k not in label_keys}
    if isinstance(batch, (tuple, list)) and len(batch) == 1 and _tensors(batch[0]):
        data = batch[0]
        return (data,) if isinstance(data, torch.Tensor) else tuple(data)
    return (unpack_batch(batch, label_keys) if unpack is None else unpack(batch))[0]


def to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move a tensor or a (nested) tuple/list of tensors to ``device``."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device, non_blocking=non_blocking)
    if isinstance(value, (tuple, list)):
        return tuple([to_device(v, device, non_blocking) for v in value])
    if isinstance(value, Mapping):  # a dict batch's features (a transformers BatchEncoding too)
        return {k: to_device(v, device, non_blocking) for k, v in value.items()}
    return value


def to_channels_last(value: Any) -> Any:
    """A 4-D tensor (N, C, H, W) in channels-last memory order; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() == 4:
        return value.contiguous(memory_format=torch.channels_last)
    return value


def batch_size_of(inputs: Inputs) -> int:
    """Samples in a batch: the first dimension of the first input (0-d inputs count as 1)."""
    try:  # runs every batch: no dim() call on the common path
        return inputs[0].shape[0]  # type: ignore[index]  # a dict raises KeyError, handled below
    except IndexError:  # a 0-d input
        return 1
    except KeyError:  # keyword inputs from a dict batch: the first tensor's
        first = next((v for v in inputs.values() if isinstance(v, torch.Tensor)), None)  # type: ignore[union-attr]
        return 1 if first is None or first.dim() == 0 else first.shape[0]


def check_finite(batch: Any, name: str) -> None:
    """Reject nan and inf in a batch's floating tensors, naming each part that holds some and how
    many. One host read per floating tensor: for a run's first batch only."""
    if type(batch) in _SEQUENCES and len(batch) == 2 and all(type(part) is torch.Tensor for part in batch):
        parts = [(path, t) for path, t in zip(("data", "label"), batch) if t.is_floating_point()]  # the usual pair
    else:
        parts = list(_floating_parts(batch))
    bad = [(path, t) for path, t in parts if not _all_finite(t)]
    if bad:
        found = "; ".join(
            f"{path}: {int(t.isnan().sum())} nan and {int(t.isinf().sum())} inf of {t.numel()} values ({shape_of(t)})"
            for path, t in bad
        )
        raise NonFiniteInputError(
            f"the first batch of {name} holds nan or inf values, {found}; they would make the loss, and after the "
            "first step the weights, nan: clean the data (drop those samples, or replace the values, e.g. "
            "torch.nan_to_num(x)), or, if the net handles them on purpose, pass "
            "batch_processor=BatchProcessor(allow_nonfinite=True)"
        )


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite: one reduction and one read when its sum is finite,
    the elementwise test only when it is not (the sum may have overflowed, in float16 above all)."""
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _floating_parts(value: Any, path: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every floating tensor in a batch: ``data``/``label`` (``data[1]``...) for
    a pair, else ``batch``, ``batch[0]``, ``batch['image']``..."""
    if path is None:
        pair = type(value) in _SEQUENCES and len(value) == 2
        for root, part in zip(("data", "label"), value) if pair else (("batch", value),):
            yield from _floating_parts(part, root)
    elif isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield path, value
    elif isinstance(value, _SEQUENCES):
        for i, part in enumerate(value):
            yield from _floating_parts(part, f"{path}[{i}]")
    elif isinstance(value, Mapping):
        for key, part in value.items():
            yield from _floating_parts(part, f"{path}[{key!r}]")


def rows_of(data: object) -> int | None:
    """The samples a pass over a DataLoader with a sized sampler yields (``drop_last`` counted), else None."""
    if not isinstance(data, torch.utils.data.DataLoader) or data.batch_size is None:
        return None
    try:
        samples = len(sampler_of(data))
    except TypeError:  # an iterable dataset's sampler, or one without a length
        return None
    return (samples // data.batch_size) * data.batch_size if data.drop_last else samples


def sampler_of(loader: torch.utils.data.DataLoader) -> Any:
    """The sampler a loader draws its order from: a ``batch_sampler=``'s own when one was given."""
    return loader.sampler if loader.batch_sampler is None else loader.batch_sampler.sampler  # type: ignore[attr-defined]


def loader_options(loader: torch.utils.data.DataLoader, generator: torch.Generator | None) -> dict[str, Any]:
    """The keyword arguments that rebuild ``loader``'s loading (workers, collation, pinning...) over
    another sampler; ``generator`` seeds its workers. Batching and the sampler are the caller's."""
    options: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": generator,
    }
    if loader.num_workers > 0:
        options.update(multiprocessing_context=loader.multiprocessing_context, prefetch_factor=loader.prefetch_factor)
    newer = ("pin_memory_device", "in_order")  # arguments of newer torch versions
    return options | {name: getattr(loader, name) for name in newer if hasattr(loader, name)}

"""Batches of a DataLoader over tensors in memory, read by indexing each tensor once per batch.

A ``DataLoader`` over a ``TensorDataset`` makes a batch by reading its samples one by one (a Python
call per sample) and stacking them with ``default_collate``: ~7 µs a sample on a CPU, the larger part
of a step on a small net. When nothing can tell the difference, fit, evaluate and predict index
each of the dataset's tensors once with the batch's indices instead: the same batches (the same
values, dtypes and contiguous layout, in a list as ``default_collate`` gives), in the same order,
with every random generator left where the loader's own iterator leaves it.

Only a plain ``DataLoader`` (not a subclass) reading in this process (``num_workers=0``), with
``default_collate``, no pinned memory and no timeout, over a ``TensorDataset`` whose tensors are
contiguous, strided and on the CPU, is read this way; any other data is iterated as it is. The
batches still come from the loader's own ``batch_sampler``, whatever its sampler: a batch of indices
that is not a list of integers is read sample by sample, as the loader reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeGuard

import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

_PROFILED = "enumerate(DataLoader)#fitforge.indexed_batches"  # the profiler's name for reading a batch


def indexed_batches(data: Iterable) -> Iterable:
    """``data``'s batches: read by indexing where :func:`readable` says so, else ``data`` itself."""
    return _IndexedBatches(data) if readable(data) else data


def readable(data: object) -> TypeGuard[DataLoader]:
    """Whether ``data`` is a DataLoader whose batches can be read by indexing (module docstring)."""
    return (
        type(data) is DataLoader
        and type(data.dataset) is TensorDataset
        and data.batch_sampler is not None
        and data.num_workers == 0
        and data.collate_fn is default_collate
        and not data.pin_memory
        and data.timeout == 0
        and all(
            tensor.layout is torch.strided and tensor.device.type == "cpu" and tensor.is_contiguous()
            for tensor in data.dataset.tensors
        )
    )


class _IndexedBatches:
    """One pass over a :func:`readable` loader, drawn as its iterator draws it: the batch sampler's
    iterator first, then the worker seed the iterator draws from the loader's generator (unused in
    this process; drawn so that the generator moves on as it does under the loader), then the
    indices batch by batch."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader
        dataset: TensorDataset = loader.dataset  # type: ignore[assignment]
        indices_of = iter(loader.batch_sampler)  # type: ignore[arg-type]
        torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        return _read(dataset, indices_of)


def _read(dataset: TensorDataset, indices_of: Iterator[Any]) -> Iterator[Any]:
    tensors = dataset.tensors
    for indices in indices_of:
        if _profiling():  # torch's profiler shows the reads, as it shows the loader's
            with torch.autograd.profiler.record_function(_PROFILED):
                batch = _batch(dataset, tensors, indices)
        else:
            batch = _batch(dataset, tensors, indices)
        yield batch


def _profiling() -> bool:
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)


def _batch(dataset: TensorDataset, tensors: tuple[torch.Tensor, ...], indices: Any) -> list[torch.Tensor]:
    index = torch.as_tensor(indices) if type(indices) is list else None
    if index is None or index.dtype is not torch.int64 or index.dim() != 1:
        return default_collate([dataset[i] for i in indices])  # as the loader reads them
    return [tensor[index] for tensor in tensors]

"""Batches of a DataLoader over tensors in memory, read by indexing each tensor once per batch.

A ``DataLoader`` over a ``TensorDataset`` reads a batch sample by sample (a Python call each) and
stacks it with ``default_collate``: ~5 µs a sample on a CPU, most of a step on a small net. Where
nothing can tell the difference (:func:`readable`; the conditions are listed in docs/performance.md),
fit, evaluate and predict index each tensor once with the batch's indices instead: the same batches
(values, dtypes, contiguous layout, in a list as ``default_collate`` gives), in the same order,
every random generator left where the loader's own iterator leaves it.

What can tell: torch's profiler names a read ``enumerate(DataLoader)#fitforge.indexed_batches``
(the loader's: ``...#_SingleProcessDataLoaderIter.__next__``), and the worker seed of each pass is
drawn but not read to the host (one ``.item()`` fewer per pass).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from typing import Any, TypeGuard

import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from fitforge.signals.worker_shield import shielded

_PROFILED = "enumerate(DataLoader)#fitforge.indexed_batches"  # the profiler's name for reading a batch


def indexed_batches(data: Iterable) -> Iterable:
    """``data``'s batches: read by indexing where :func:`readable` says so, else ``data`` itself
    (a loader's workers shielded from preemption signals within a fit, see :func:`shielded`)."""
    return _IndexedBatches(data) if readable(data) else shielded(data)


def readable(data: object) -> TypeGuard[DataLoader]:
    """Whether ``data`` is a DataLoader whose batches indexing reads as the loader itself would."""
    return (
        type(data) is DataLoader
        and type(data.dataset) is TensorDataset
        and data.batch_sampler is not None
        and data.num_workers == 0
        and data.collate_fn is default_collate
        and not data.pin_memory
        and data.timeout == 0
        and _indexable(data.dataset.tensors)
    )


def _indexable(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Tensors whose rows indexing copies as stacking does: plain (a subclass's ``__torch_function__``
    would see other calls), strided, on the CPU, with a fresh contiguous tensor's strides (indexing
    keeps the source's, which may differ on a dim of size 1), not requiring grad (another ``grad_fn``)."""
    return all(
        type(tensor) is torch.Tensor
        and tensor.layout is torch.strided
        and tensor.device.type == "cpu"
        and not tensor.requires_grad
        and tensor.stride() == _fresh_strides(tensor.shape)
        for tensor in tensors
    )


def _fresh_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _IndexedBatches:
    """A :func:`readable` loader's batches, each iteration a pass drawn as the loader's iterator draws
    it: the batch sampler's iterator, then the (unused) worker seed from the loader's generator, so
    that it moves on as under the loader, then the indices batch by batch."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        self._judged = loader.dataset.tensors  # type: ignore[attr-defined]  # judged indexable by readable()

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader
        indices_of = iter(loader.batch_sampler)  # type: ignore[arg-type]
        draw_worker_seed(loader)
        return _read(loader.dataset, indices_of, self._judged)  # type: ignore[arg-type]


def draw_worker_seed(loader: DataLoader) -> None:
    """Draw from ``loader.generator`` (torch's global one when None) what the loader's iterator
    draws as its workers' base seed when a pass starts, right after making its sampler iterator."""
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)


_END = object()


def _read(dataset: TensorDataset, indices_of: Iterator[Any], judged: tuple[torch.Tensor, ...]) -> Iterator[Any]:
    """The batches of ``indices_of``, each read (indices drawn too) in a profiler span while torch's
    profiler runs, as the loader's are. The tensors are looked up per batch (a handler may replace
    ``dataset.tensors`` in a pass) and judged when they are not the ``judged`` (indexable) ones."""
    indexable = True
    while True:
        with torch.autograd.profiler.record_function(_PROFILED) if _profiling() else nullcontext():
            indices = next(indices_of, _END)
            if indices is _END:
                return
            if dataset.tensors is not judged:
                judged = dataset.tensors
                indexable = _indexable(judged)
            batch = _batch(dataset, judged, indices, indexable)
        yield batch


def _profiling() -> bool:
    # A torch without the flag (it is not public) gets the span always: a few microseconds a batch.
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)


def _batch(dataset: TensorDataset, tensors: tuple[torch.Tensor, ...], indices: Any, indexable: bool) -> Any:
    """The batch of ``indices``: each of the dataset's ``tensors`` indexed once where the indices are a
    non-empty list of plain ints and ``indexable``, else read sample by sample as the loader reads it."""
    if indexable and type(indices) is list and indices and all(type(i) is int for i in indices):
        try:  # a CPU tensor whatever torch's default device, in a fifth of torch.as_tensor's time
            index = torch.frombuffer(array("q", indices), dtype=torch.int64)
        except OverflowError:  # an index beyond int64: the loader's own error below
            pass
        else:
            return [tensor[index] for tensor in tensors]
    return default_collate([dataset[i] for i in indices])

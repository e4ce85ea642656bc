"""Batches of a plain single-process DataLoader, read by fit itself, with the loader's own sampler draws.

A DataLoader's iterator reads a ``TensorDataset`` sample by sample and collates it (~5 µs a sample on a
CPU, most of a step on a small net); here each tensor is indexed once per batch instead, giving the same
batches in the same order, every random generator left where the loader's iterator leaves it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from typing import Any, TypeGuard

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, default_collate

from fitforge.signals.worker_shield import shielded

_PROFILED = "enumerate(DataLoader)#fitforge.indexed_batches"  # the profiler's name for reading a batch


def indexed_batches(data: Iterable) -> Iterable:
    """``data``'s batches: read by fit where :func:`direct` says so, else ``data`` itself (:func:`shielded`)."""
    return _IndexedBatches(data) if direct(data) else shielded(data)


def direct(data: object) -> TypeGuard[DataLoader]:
    """Whether ``data`` is a plain ``DataLoader`` batching a map-style dataset in this process, which fit reads."""
    return (
        type(data) is DataLoader
        and data.batch_sampler is not None
        and data.num_workers == 0
        and not data.pin_memory
        and data.timeout == 0
        and not isinstance(data.dataset, IterableDataset)
    )


def readable(data: object) -> TypeGuard[DataLoader]:
    """Whether ``data`` is a :func:`direct` loader whose batches indexing reads as the loader itself would."""
    return (
        direct(data)
        and type(data.dataset) is TensorDataset
        and data.collate_fn is default_collate
        and _indexable(data.dataset.tensors)
    )


def _indexable(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Tensors whose rows indexing copies as stacking does: plain (no ``__torch_function__``), strided, on
    the CPU, with a fresh tensor's strides (indexing keeps the source's), not requiring grad."""
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
    """A :func:`direct` loader's passes, drawn as its iterator draws: the batch sampler's, then the worker seed."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader
        # The tensors judged indexable (None: the dataset is read item by item, then collated).
        self._judged = loader.dataset.tensors if readable(loader) else None  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader
        indices_of = iter(loader.batch_sampler)  # type: ignore[arg-type]
        draw_worker_seed(loader)
        return _read(loader, indices_of, self._judged)


def draw_worker_seed(loader: DataLoader) -> None:
    """Draw from ``loader.generator`` the workers' base seed, as the loader's iterator does at a pass's start."""
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)


_END = object()


def _read(loader: DataLoader, indices_of: Iterator[Any], judged: tuple[torch.Tensor, ...] | None) -> Iterator[Any]:
    """The batches of ``indices_of``, each read in a profiler span while torch's profiler runs. The tensors
    are looked up per batch (a handler may replace ``dataset.tensors``) and judged again when replaced."""
    dataset = loader.dataset
    indexable = judged is not None
    while True:
        with torch.autograd.profiler.record_function(_PROFILED) if _profiling() else nullcontext():
            indices = next(indices_of, _END)
            if indices is _END:
                return
            if judged is not None and dataset.tensors is not judged:  # type: ignore[attr-defined]
                judged = dataset.tensors  # type: ignore[attr-defined]
                indexable = _indexable(judged)
            batch = _batch(loader, judged, indices, indexable)
        yield batch


def _profiling() -> bool:
    # A torch without the flag (it is not public) gets the span always: a few microseconds a batch.
    return getattr(torch.autograd.profiler, "_is_profiler_enabled", True)


def _batch(loader: DataLoader, tensors: Any, indices: Any, indexable: bool) -> Any:
    """The batch of ``indices``: each of ``tensors`` indexed once where it can be, else fetched and collated."""
    if indexable and type(indices) is list and indices and all(type(i) is int for i in indices):
        try:  # a CPU tensor whatever torch's default device, in a fifth of torch.as_tensor's time
            index = torch.frombuffer(array("q", indices), dtype=torch.int64)
        except OverflowError:  # an index beyond int64: the loader's own error below
            pass
        else:
            return [tensor[index] for tensor in tensors]
    dataset = loader.dataset
    many = getattr(dataset, "__getitems__", None)  # the loader's fetcher asks for it so
    return loader.collate_fn(many(indices) if many else [dataset[i] for i in indices])

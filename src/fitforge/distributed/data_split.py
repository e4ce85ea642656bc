"""Each rank's share of the data under torch.distributed, and ``predict``'s outputs put back in order
(docs/distributed.md#how-the-data-is-split)."""

from __future__ import annotations

import logging
import sys
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from fitforge.core.batches import loader_options, sampler_of
from fitforge.distributed.ranks import gather_to_main, rank, world_size

log = logging.getLogger("fitforge")
_EVAL_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loader -> {padded: its shard}


def _why_not(loader: Any) -> str | None:
    """Why ``loader`` cannot be sharded by index (None when it can)."""
    if not isinstance(loader, DataLoader):
        return f"it is a {type(loader).__name__}, not a DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return (
            "its dataset is an IterableDataset: shard it in the dataset (torch.distributed.get_rank()), "
            "giving every rank the same number of batches"
        )
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        return f"its batch_sampler {type(loader.batch_sampler).__name__} is not torch's BatchSampler"
    sampler = sampler_of(loader)
    if type(sampler) not in (RandomSampler, SequentialSampler, DistributedSampler):
        return f"its sampler {type(sampler).__name__} has no distributed counterpart"
    if isinstance(sampler, RandomSampler) and (sampler.replacement or sampler.num_samples != len(sampler.data_source)):
        return "its RandomSampler draws with replacement or another number of samples than the dataset's"
    return None


def _rebuild(loader: DataLoader, sampler: Sampler | range, drop_last: bool) -> DataLoader:
    options = loader_options(loader, loader.generator)
    options["persistent_workers"] = loader.persistent_workers
    if loader.batch_sampler is None:  # batch_size=None: the loader yields single samples
        return DataLoader(loader.dataset, batch_size=None, sampler=sampler, **options)
    batches: Any = loader.batch_sampler
    return DataLoader(loader.dataset, batch_size=batches.batch_size, drop_last=drop_last, sampler=sampler, **options)


def shard_train(data: Iterable, streams: bool = False) -> Iterable:
    """This rank's share of the training data (``data`` itself outside torch.distributed); ``streams``: a
    Hugging Face stream is shared by the ranks later (:mod:`fitforge.inputs.streams`), and is returned as it is."""
    if world_size() == 1 or (streams and unsplit_stream(data)):
        return data
    problem = _why_not(data)
    if problem is not None:
        log.warning(
            "train_data is not split across the %d ranks (%s): every rank trains on all of it; pass a DataLoader "
            "over a map-style dataset, or give each rank its share yourself",
            world_size(),
            problem,
        )
        return data
    loader: DataLoader = data  # type: ignore[assignment]
    if isinstance(sampler_of(loader), DistributedSampler):
        return loader
    sampler: DistributedSampler = DistributedSampler(
        loader.dataset, num_replicas=world_size(), rank=rank(), shuffle=isinstance(sampler_of(loader), RandomSampler)
    )
    sampler.fitforge_seeded = True  # type: ignore[attr-defined]  # DataOrder sets its seed from the fit's
    return _rebuild(loader, sampler, drop_last=getattr(loader.batch_sampler, "drop_last", False))


def unsplit_stream(data: object) -> bool:
    """Whether ``data`` is a plain DataLoader batching a ``datasets.IterableDataset`` the user did not split."""
    library = sys.modules.get("datasets")  # looked up, not imported: data of it means it is imported already
    if library is None or type(data) is not DataLoader or data.batch_size is None:
        return False
    return isinstance(data.dataset, library.IterableDataset) and getattr(data.dataset, "_distributed", None) is None


def shard_eval(data: Iterable, padded: bool) -> tuple[Iterable, bool]:
    """``(this rank's share of evaluation data, whether it is a share)``: samples ``r, r + world, ...``;
    ``padded`` gives every rank as many (for FSDP). The share of a loader is made once and reused."""
    if world_size() == 1 or _why_not(data) is not None:
        return data, False
    loader: DataLoader = data  # type: ignore[assignment]
    if isinstance(sampler_of(loader), DistributedSampler):
        return loader, False  # the user's own split: their outputs, their order
    shards = _EVAL_SHARDS.setdefault(loader, {})
    if padded not in shards:
        sampler: Sampler | range = (
            DistributedSampler(loader.dataset, world_size(), rank(), shuffle=False)
            if padded
            else range(rank(), len(loader.dataset), world_size())  # type: ignore[arg-type]
        )
        shards[padded] = _rebuild(loader, sampler, drop_last=False)  # every sample, as the metrics are exact
    return shards[padded], True


def in_dataset_order(data: Iterable) -> Iterable:
    """``data`` for ``predict`` in one process: a shuffling DataLoader is rebuilt over a SequentialSampler
    (with a warning), so that outputs line up with the dataset's samples."""
    if _why_not(data) is not None or not isinstance(sampler_of(data), RandomSampler):  # type: ignore[arg-type]
        return data
    loader: DataLoader = data  # type: ignore[assignment]
    warnings.warn(
        "predict: the DataLoader shuffles (a RandomSampler); predicting in dataset order instead, so that "
        "output i belongs to dataset[i]; build the loader with shuffle=False to silence this",
        UserWarning,
        stacklevel=3,
    )
    return _rebuild(loader, SequentialSampler(loader.dataset), drop_last=False)  # type: ignore[arg-type]


def gather_predictions(outputs: Any, size: int) -> Any:
    """Rank 0: every rank's outputs (rows ``r, r + world, ...``) interleaved back into dataset order, cut
    to ``size`` (dropping padding); None on the other ranks, and when no rank produced any."""
    parts = gather_to_main(outputs)
    if parts is None or all(part is None for part in parts):
        return None
    template = next(part for part in parts if part is not None)
    if isinstance(template, (tuple, dict)):
        keys = range(len(template)) if isinstance(template, tuple) else list(template)
        joined = [_interleave([None if part is None else part[key] for part in parts], size) for key in keys]
        return tuple(joined) if isinstance(template, tuple) else dict(zip(keys, joined))
    return _interleave(parts, size)


def _interleave(parts: list[torch.Tensor | None], size: int) -> torch.Tensor:
    template = next(part for part in parts if part is not None)
    total = sum(len(part) for part in parts if part is not None)
    merged = template.new_empty((total, *template.shape[1:]))
    for r, part in enumerate(parts):
        if part is not None:
            merged[r :: len(parts)] = part
    return merged[:size]

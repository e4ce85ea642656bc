"""The check of a fit's validation before training: a first batch of each validation source,
evaluated through the very handlers and step of the evaluation it stands for."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
)

from fitforge.checks.first_batch import check_handlers, check_output, explained_step
from fitforge.core.batches import check_finite, sampler_of
from fitforge.core.rng import torch_rng_kept
from fitforge.core.state import EstimatorLike, TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.signals.worker_shield import shielded

CHECKED_SAMPLES = 2  # enough for shapes, dtypes and the metrics' updates; BatchNorm in eval mode takes 1


def first_samples(data: Iterable) -> Any:
    """A batch of ``data``'s first samples, cheaply: a DataLoader over a map-style dataset (torch's
    batching, in-order or random sampler) collates ``CHECKED_SAMPLES`` here, starting no worker;
    other data gives its first batch (None: empty)."""
    if (
        isinstance(data, DataLoader)
        and not isinstance(data.dataset, IterableDataset)
        and type(data.batch_sampler) is BatchSampler
        and type(sampler_of(data)) in (SequentialSampler, RandomSampler)
    ):
        size = len(data.dataset)  # type: ignore[arg-type]
        if size == 0:
            return None
        if type(data.dataset) is TensorDataset and data.collate_fn is default_collate:
            # What collating gives (a list of stacked contiguous copies), by slicing: no per-sample calls.
            first = (tensor[:CHECKED_SAMPLES] for tensor in data.dataset.tensors)
            return [tensor.clone(memory_format=torch.contiguous_format) for tensor in first]
        return data.collate_fn([data.dataset[i] for i in range(min(CHECKED_SAMPLES, size))])
    return next(iter(shielded(data)), None)  # workers may start: they leave preemption signals to fit


def check_first_val_batch(
    estimator: EstimatorLike,
    val_data: Iterable,
    name: str,
    checks: Sequence[Callable[[TrainState], None]],
    step: Callable[[TrainState, Any], Any],
) -> bool:
    """Evaluate a first batch of ``val_data`` (:func:`first_samples`) once before training (eval mode,
    no grad, RNG state restored) with the checks of the first training batch
    (:mod:`fitforge.checks.first_batch`), through the evaluation's ``step`` and its handlers'
    ``checks``, so its metrics too. Returns whether it checked a batch."""
    if isinstance(val_data, Iterator):  # a one-shot iterator cannot be peeked without losing a batch
        return False
    with (
        torch_rng_kept(estimator.device),
        estimator.strategy.evaluating(estimator.val_net, estimator.weight_average),
    ):
        batch = first_samples(val_data)
        if batch is None:
            return False  # empty: reported by check_data or at the first validation
        if not estimator.batch_processor.allow_nonfinite:
            check_finite(batch, name)
        state = TrainState(estimator, "validate", batch_idx=0, batch=batch)
        try:
            state.output = explained_step(state, step, batch)
            check_output(estimator, state.output, "evaluate_batch")
            check_handlers(state, checks)
        except (FitforgeValueError, FitforgeTypeError) as error:
            raise type(error)(f"the first batch of {name} cannot be evaluated: {error}") from error
    return True

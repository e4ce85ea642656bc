"""What fit, evaluate and predict check before their first step, beyond the arguments themselves.

The Estimator calls these; they are here so that the Estimator reads as its entry points. Every
check raises before any optimizer step, naming the argument and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    default_collate,
)

from fitforge.core.data import check_data, check_finite, sampler_of
from fitforge.core.events import EventHandler
from fitforge.core.first_batch import check_devices, check_handlers, explained_step
from fitforge.core.loss import LossSet, ModelLoss
from fitforge.core.processor import bound_step
from fitforge.core.rng import torch_rng_kept
from fitforge.core.roles import Stopping, Validating, ValidationSetup, players
from fitforge.core.run import inference
from fitforge.core.state import EstimatorLike, TrainState
from fitforge.core.untrained import warn_untrained
from fitforge.distributed.fsdp import hold_shards
from fitforge.distributed.strategy import follow_trainable
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers.defaults import evaluate_handlers
from fitforge.handlers.stopping import tighter_limit


class Estimator(EstimatorLike, Protocol):
    """The part of :class:`fitforge.Estimator` the checks use (this layer is below it)."""

    _val_loss: LossSet | ModelLoss

    def evaluation(
        self,
        val_data: Iterable,
        event_handlers: Sequence[EventHandler] | None = None,
        checked: bool = False,
        placed: bool = False,
    ) -> Any: ...


def check_placement(estimator: Estimator, *nets: str) -> None:
    """The named nets (``"net"``, ``"val_net"``) must still be on the device the Estimator placed
    them on. Not under FSDP, which places (and may offload) the shards itself."""
    if estimator.strategy == "fsdp":
        return
    checked: list[nn.Module] = []
    for name in nets:
        net = getattr(estimator, name)
        if not any(net is other for other in checked):  # val_net is usually net itself
            check_devices(net, estimator.device, name)
            checked.append(net)


def preflight(
    estimator: Estimator, handlers: list[EventHandler], val_data: Any, epochs: int | None, batches: int | None
) -> tuple[int | None, int | None]:
    """Check the parameters that will train (:func:`check_trainable`) and every validation source
    before training, and fold StoppingHandler limits into the run's (the first limit reached ends
    training); returns the effective ``(epochs, batches)``."""
    check_trainable(estimator)  # first: the validation check's forward may gather FSDP's parameters
    for validator in players(handlers, Validating):
        setup = validator.validation_setup()
        if setup is None:
            continue  # it validates by its own means
        name = "val_data" if setup.val_data is val_data else f"{type(validator).__name__} val_data"
        if setup.val_data is not val_data or setup.mid_epoch:  # fit checked its val_data for epoch ends
            check_data(setup.val_data, name, 1 if epochs == 1 and not setup.mid_epoch else None)
        # Set up once per fit (data, placement, handlers, step), before training, so the check
        # below runs through the very handlers and step of the validations it stands for.
        evaluation = _built(estimator, setup)
        validator.use_evaluation(evaluation, setup.check_first and evaluation.check_first(name))
    for stopper in players(handlers, Stopping):
        limits = stopper.run_limits()
        epochs, batches = tighter_limit(epochs, limits[0]), tighter_limit(batches, limits[1])
    return epochs, batches


def _built(estimator: Estimator, setup: ValidationSetup) -> Any:
    """The validation's Evaluation, told that fit checked ``val_net``'s placement just before; an
    ``evaluation`` overridden with the signature it had before ``placed`` is called without it."""
    try:
        return estimator.evaluation(setup.val_data, setup.event_handlers, placed=True)
    except TypeError as error:
        if "placed" not in str(error):
            raise
        return estimator.evaluation(setup.val_data, setup.event_handlers)


def check_trainable(estimator: Estimator) -> None:
    """Once per fit, as ``requires_grad`` may have changed since the last (freeze, fit, unfreeze, fit):
    warn of trainable parameters that no optimizer holds (:mod:`fitforge.core.untrained`), comparing
    the parameters the optimizers hold (under FSDP the shards, held again by the units first), and
    make DDP's wrapper follow the parameters that train now (:func:`~fitforge.distributed.strategy.follow_trainable`).
    One pass over the parameters; no cost per batch."""
    if estimator.strategy == "fsdp":
        hold_shards(estimator.net)
    warn_untrained(estimator.net, estimator.optimizers)
    estimator.train_net = follow_trainable(estimator.train_net, estimator.net, estimator.device)


CHECKED_SAMPLES = 2  # enough for shapes, dtypes and the metrics' updates; BatchNorm in eval mode takes 1


def first_samples(data: Iterable) -> Any:
    """A batch of ``data``'s first samples, cheaply: a DataLoader over a map-style dataset, with
    torch's batching and an in-order or random sampler, collates ``CHECKED_SAMPLES`` samples here
    (no worker starts, whatever ``num_workers``); other data gives its first batch (None: empty)."""
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
            # What collating the first samples gives (a list of stacked, contiguous copies), as slices:
            # no per-sample calls. Contiguous as the batches are, whatever the dataset's layout.
            first = (tensor[:CHECKED_SAMPLES] for tensor in data.dataset.tensors)
            return [tensor.clone(memory_format=torch.contiguous_format) for tensor in first]
        return data.collate_fn([data.dataset[i] for i in range(min(CHECKED_SAMPLES, size))])
    return next(iter(data), None)


def check_first_val_batch(
    estimator: Estimator,
    val_data: Iterable,
    name: str,
    event_handlers: Sequence[EventHandler] | None = None,
    *,
    handlers: Sequence[EventHandler] | None = None,
    step: Callable[[TrainState, Any], Any] | None = None,
) -> bool:
    """Evaluate a first batch of ``val_data`` once before training (eval mode, no grad, RNG state
    restored): the checks of the first training batch (see :mod:`fitforge.core.first_batch`), with
    the metrics the evaluation will update (those of the MetricHandler in ``event_handlers``, else
    ``val_metrics``). From a DataLoader over a map-style dataset the batch is collated from its
    first :data:`CHECKED_SAMPLES` samples in this process: a forward on a few samples, and no
    worker process started (see :func:`first_samples`). Returns whether it checked a batch.

    ``handlers`` and ``step``: those of the evaluation the check stands for (an
    :class:`~fitforge.evaluation.Evaluation`'s), instead of new ones."""
    if isinstance(val_data, Iterator):  # a one-shot iterator cannot be peeked without losing a batch
        return False
    with torch_rng_kept(estimator.device), inference(estimator.val_net, estimator.strategy != "fsdp"):
        batch = first_samples(val_data)
        if batch is None:
            return False  # empty: reported by check_data or at the first validation
        if not getattr(estimator.batch_processor, "allow_nonfinite", False):
            check_finite(batch, name)
        estimator._val_loss.arm_checks()
        state = TrainState(estimator, "validate", batch_idx=0, batch=batch)
        try:
            step = step or bound_step(estimator.batch_processor, estimator, "evaluate_batch")
            state.output = explained_step(state, step, batch)
            estimator.check_first_batch(state.output, "evaluate_batch")
            check_handlers(state, evaluate_handlers(event_handlers) if handlers is None else handlers)
        except (FitforgeValueError, FitforgeTypeError) as error:
            raise type(error)(f"the first batch of {name} cannot be evaluated: {error}") from error
    return True

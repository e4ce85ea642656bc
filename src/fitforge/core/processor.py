"""BatchProcessor: one batch in, one :class:`~fitforge.BatchOutput` out.

``fit_batch`` does forward, loss and backward; the optimizer step belongs to
:class:`~fitforge.handlers.GradientUpdateHandler`, so handlers can act between the two. Subclass it
for other steps (teacher forcing, anchor matching, a GAN's turns); what a step written whole must
keep (``self.backward(loss)``, a forward through ``train_net``, declared ``logs``, a ``BatchOutput``
with ``batch_size``) is docs/custom-steps.md's contract, which the default keeps too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from fitforge.core.batches import (
    LABEL_KEYS,
    Inputs,
    batch_size_of,
    label_key_of,
    to_channels_last,
    to_device,
    unpack_batch,
    unpack_inputs,
)
from fitforge.core.state import BatchOutput, EstimatorLike, TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, LossInputError, check_flag, describe

_FULL_PRECISION = nullcontext()  # reusable: a float32 batch creates no context object
_MODEL_OUTPUT_KEY = "logits"  # what metrics and predict read of a model that computes its own loss


class BatchProcessor:
    """The default per-batch step; override any method to customise it, e.g. ``to_device`` (which
    ``fit_batch`` and ``evaluate_batch`` share) to match a detector's boxes to anchors on the device.

    Args:
        host_inputs: positions of inputs to leave on the host, e.g. ``(1,)`` for the lengths
            ``pack_padded_sequence`` reads on the CPU (a round trip would wait for the GPU).
        allow_nonfinite: accept nan and inf in the data and labels (by default the first batch of
            fit and of its validation data is checked), for a net or loss that handles them on purpose.
        label_key: the key of a dict batch's label; by default ``"labels"``, else ``"label"``.
        output_key: the item (a key or an attribute) of the net's output that metrics, ``predict``
            and a given loss receive; by default ``"logits"`` with ``Estimator(loss=None)``, else
            the whole output.

    Attributes:
        logs: the names the steps give ``state.log(name, value)``, known before training.
        record_loss: False leaves the steps' loss out of ``train_loss``/``val_loss`` (a GAN's turns).
    """

    host_inputs: tuple[int, ...] = ()
    allow_nonfinite: bool = False
    label_key: str | None = None
    output_key: str | None = None
    logs: tuple[str, ...] = ()
    record_loss: bool = True

    def __init__(
        self,
        host_inputs: tuple[int, ...] = (),
        allow_nonfinite: bool = False,
        label_key: str | None = None,
        output_key: str | None = None,
    ) -> None:
        self.allow_nonfinite = check_flag("BatchProcessor", "allow_nonfinite", allow_nonfinite)
        for name, key in (("label_key", label_key), ("output_key", output_key)):
            if key is not None and (not isinstance(key, str) or not key):
                raise FitforgeTypeError(f"BatchProcessor: {name} must be a non-empty str or None, got {describe(key)}")
        self.label_key, self.output_key = label_key, output_key
        if not isinstance(host_inputs, (tuple, list)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in host_inputs
        ):
            raise FitforgeTypeError(
                f"BatchProcessor: host_inputs must be a tuple of input positions (ints >= 0), "
                f"got {describe(host_inputs)}"
            )
        if any(i < 0 for i in host_inputs):
            raise FitforgeValueError(f"BatchProcessor: host_inputs positions must be >= 0, got {tuple(host_inputs)}")
        self.host_inputs = tuple(host_inputs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._own_autocast = cls.autocast is not BatchProcessor.autocast
        cls._unpack_overridden = cls.unpack is not BatchProcessor.unpack
        cls._custom_steps = frozenset(
            name
            for name in ("fit_batch", "evaluate_batch", "predict_batch")
            if getattr(cls, name) is not getattr(BatchProcessor, name)
        )

    _own_autocast = False  # a subclass that overrides autocast() always has its context entered
    _unpack_overridden = False  # without an override, to_device calls unpack_batch itself: one call less per batch
    _custom_steps: frozenset[str] = frozenset()  # steps a subclass wrote itself: the loop calls them under autocast
    _scaler: torch.amp.GradScaler | None = None  # the fp16 scaler of the estimator that runs the processor
    _autocast_device: str | None = None  # its device type under mixed precision, else None

    def bind(self, estimator: EstimatorLike) -> None:
        """Take the fp16 scaler and the autocast device of the estimator that runs this processor."""
        self._scaler = estimator.scaler
        self._autocast_device = None if estimator.autocast_dtype is None else estimator.device.type

    @property
    def label_keys(self) -> tuple[str, ...]:
        """The keys a dict batch's label may be under: ``label_key``, else ``"labels"`` or ``"label"``."""
        return LABEL_KEYS if self.label_key is None else (self.label_key,)

    def _inputs_to(self, inputs: Inputs, estimator: EstimatorLike) -> Inputs:
        device = estimator.device
        if not (self.host_inputs or estimator.channels_last) and type(inputs) is tuple:
            for x in inputs:  # the common case first: every input already on the device (CPU training)
                if type(x) is not torch.Tensor or x.device != device:
                    break
            else:
                return inputs
        non_blocking = estimator.non_blocking
        if not self.host_inputs:
            moved = to_device(inputs, device, non_blocking)
        else:
            moved = tuple(
                [x if i in self.host_inputs else to_device(x, device, non_blocking) for i, x in enumerate(inputs)]
            )
        if estimator.channels_last:
            moved = (
                {k: to_channels_last(x) for k, x in moved.items()}
                if isinstance(moved, dict)
                else tuple([to_channels_last(x) for x in moved])
            )
        return moved

    def unpack(self, batch: Any) -> tuple[Inputs, Any]:
        """Split a batch into ``(inputs, label)``: a tuple of inputs from a ``(data, label)`` pair, or
        a dict batch's keyword inputs and the label under ``label_keys``; data alone gives the label
        None (see :mod:`fitforge.core.batches`). Override for other batch formats."""
        return unpack_batch(batch, self.label_keys)

    def to_device(self, state: TrainState, batch: Any) -> tuple[Inputs, Any]:
        """``unpack`` the batch and move inputs (except ``host_inputs``) and label to the estimator's
        device (non-blocking on CUDA; 4-D inputs channels-last when the estimator asks for it)."""
        inputs, label = self.unpack(batch) if self._unpack_overridden else unpack_batch(batch, self.label_keys)
        estimator = state.estimator
        device = estimator.device
        if type(label) is not torch.Tensor or label.device != device:
            label = to_device(label, device, estimator.non_blocking)
        inputs = self._inputs_to(inputs, estimator)
        if estimator.loss is None and label is not None:  # the net computes its loss: it needs the label
            if isinstance(inputs, dict):  # among keyword inputs, under the batch's own key (else label_key)
                key = self.label_key or "labels"
                if isinstance(batch, Mapping) and not self._unpack_overridden:
                    key = label_key_of(batch, self.label_keys)
                inputs = {**inputs, key: label}
            else:  # last among positional inputs
                inputs = (*inputs, *(label if isinstance(label, tuple) else (label,)))
        return inputs, label

    def forward(self, net: torch.nn.Module, inputs: Inputs, label: Any) -> Any:
        """Run the net: ``net(*inputs)``, or ``net(**features)`` for a dict batch; ``label`` is passed
        for processors that need it (teacher forcing)."""
        return net(**inputs) if type(inputs) is dict else net(*inputs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` outside autocast, scaled by the estimator's GradScaler under
        ``precision="16-mixed"``; a clear error when the loss cannot carry a gradient."""
        scaler, device = self._scaler, self._autocast_device
        try:
            if device is not None and torch.is_autocast_enabled(device):  # a custom step: not its backward
                with torch.autocast(device, enabled=False):
                    (loss if scaler is None else scaler.scale(loss)).backward()
            else:
                (loss if scaler is None else scaler.scale(loss)).backward()
        except (RuntimeError, AttributeError) as err:  # explained here, so the common path pays for no check
            if not isinstance(loss, torch.Tensor):
                raise LossInputError(f"backward needs the loss as a tensor, got {describe(loss)}") from err
            if loss.dim() != 0:
                raise LossInputError(
                    f"the loss must be a scalar tensor, got shape {tuple(loss.shape)}; use reduction='mean'"
                ) from err
            if not loss.requires_grad:
                raise LossInputError(
                    "the loss does not require grad, so nothing can be trained: was it computed under "
                    "torch.no_grad(), from detached outputs, or for a net with all parameters frozen?"
                ) from err
            raise

    def autocast(self, state: TrainState) -> AbstractContextManager:
        """The mixed-precision context of the estimator's ``precision`` (a no-op in float32)."""
        dtype = state.estimator.autocast_dtype
        return _FULL_PRECISION if dtype is None else torch.autocast(state.estimator.device.type, dtype=dtype)

    def prediction(self, state: TrainState, output: Any) -> Any:
        """What metrics, ``predict`` and a given loss receive of the net's ``output``: the output
        itself, or its ``output_key`` item when it is a dict or an object such as a ``ModelOutput``."""
        if isinstance(output, (torch.Tensor, tuple, list)):
            return output
        key = self.output_key or (_MODEL_OUTPUT_KEY if state.estimator.loss is None else None)
        if key is None:
            return output  # the loss or the metric says what it cannot take
        value = output.get(key) if isinstance(output, Mapping) else getattr(output, key, None)
        if value is None:
            keys = f" (keys: {', '.join(map(str, output))})" if isinstance(output, Mapping) else ""
            raise FitforgeValueError(
                f"the net returned a {type(output).__name__}{keys} without {key!r}, the item metrics and "
                "predict read; name the item to read: batch_processor=BatchProcessor(output_key=...)"
            )
        return value

    def fit_batch(self, state: TrainState, batch: Any) -> BatchOutput:
        """Forward and loss (under the precision's autocast), then backward on one training batch.
        The forward goes through ``estimator.train_net`` (DDP's wrapper under torchrun): an override
        must too, or the ranks' gradients are not averaged."""
        inputs, label = self.to_device(state, batch)
        steps = state.services.steps  # the stepping counts items with accumulation, when it can
        counter: Any = None if steps is None else steps.count_items
        estimator, given = state.estimator, inputs
        # Accumulated batches weigh by their items (fitforge.optim.item_counts): backpropagate ``loss * items``, and
        # a model gets the count as ``num_items_in_batch``; a batch with nothing to count weighs as a plain mean.
        items = None if counter is None else counter.count(inputs, label)
        if items is not None and counter.to_model and type(inputs) is dict:
            given = {**inputs, "num_items_in_batch": items}
        pred, loss, losses = self._forward_loss(state, estimator.train_net, estimator.compute_loss, given, label)
        self.backward(loss if items is None else loss * items)
        return BatchOutput(inputs, label, pred, loss, losses, batch_size_of(inputs), items=items)

    def evaluate_batch(self, state: TrainState, batch: Any) -> BatchOutput:
        """Forward and loss with ``val_net``/``val_loss`` (called under ``torch.inference_mode``)."""
        inputs, label = self.to_device(state, batch)
        estimator = state.estimator
        pred, loss, losses = self._forward_loss(state, estimator.val_net, estimator.compute_val_loss, inputs, label)
        return BatchOutput(inputs, label, pred, loss, losses, batch_size_of(inputs))

    def _forward_loss(
        self, state: TrainState, net: torch.nn.Module, compute_loss: Any, inputs: Inputs, label: Any
    ) -> tuple[Any, torch.Tensor, tuple[torch.Tensor, ...]]:
        """``forward`` and the loss, under ``autocast`` unless there is none to enter (float32)."""
        if state.estimator.autocast_dtype is None and not self._own_autocast:
            return self._loss_of(state, self.forward(net, inputs, label), compute_loss, label)
        with self.autocast(state):
            return self._loss_of(state, self.forward(net, inputs, label), compute_loss, label)

    def _loss_of(
        self, state: TrainState, output: Any, compute_loss: Any, label: Any
    ) -> tuple[Any, torch.Tensor, tuple[torch.Tensor, ...]]:
        if type(output) is torch.Tensor:  # the common case first
            return (output, *compute_loss(output, label))
        if state.estimator.loss is None:  # the model's own loss, read from the whole output
            loss, losses = compute_loss(output, label)
            if self.output_key is None and not _has(output, _MODEL_OUTPUT_KEY):
                return None, loss, losses  # a net returning its loss alone trains; metrics ask for the logits
            return self.prediction(state, output), loss, losses
        pred = self.prediction(state, output)
        return (pred, *compute_loss(pred, label))

    def inputs_to_device(self, state: TrainState, batch: Any) -> Inputs:
        """The inputs of a predict batch on the device: from a bare tensor, ``(data,)``, or anything
        ``unpack`` splits into ``(inputs, label)`` (the label is dropped)."""
        unpack = self.unpack if self._unpack_overridden else None
        return self._inputs_to(unpack_inputs(batch, unpack, self.label_keys), state.estimator)

    def predict_batch(self, state: TrainState, batch: Any) -> Any:
        """The ``val_net`` outputs (their :meth:`prediction`) for a ``(data, label)`` pair or bare data."""
        inputs = self.inputs_to_device(state, batch)
        with self.autocast(state):
            return self.prediction(state, self.forward(state.estimator.val_net, inputs, None))


def _has(output: Any, key: str) -> bool:
    """Whether a net's dict or ``ModelOutput``-like output holds ``key`` (not None)."""
    return (output.get(key) if isinstance(output, Mapping) else getattr(output, key, None)) is not None


def bound_step(processor: Any, estimator: EstimatorLike, method: str) -> Callable[[TrainState, Any], Any]:
    """``processor.<method>`` (``fit_batch``, ``evaluate_batch`` or ``predict_batch``) as a run calls
    it, bound to the estimator; a step the processor's class wrote itself runs under the estimator's
    autocast (the default steps enter it themselves, around the forward and loss only)."""
    if isinstance(processor, BatchProcessor):
        processor.bind(estimator)
    step = getattr(processor, method)
    custom = processor._custom_steps if isinstance(processor, BatchProcessor) else frozenset()
    if estimator.autocast_dtype is None or method not in custom:
        return step

    def under_autocast(state: TrainState, batch: Any) -> Any:
        with processor.autocast(state):
            return step(state, batch)

    return under_autocast


def check_outputs(pred: Any, batch_idx: int) -> Any:
    """A net's output must be a tensor, a tuple/list of tensors (returned as a tuple) or a dict by
    output name (returned as a dict of its tensors only)."""
    if isinstance(pred, torch.Tensor):
        return pred
    if isinstance(pred, (tuple, list)) and pred and all(isinstance(p, torch.Tensor) for p in pred):
        return tuple(pred)
    if isinstance(pred, Mapping) and any(isinstance(p, torch.Tensor) for p in pred.values()):
        return {key: value for key, value in pred.items() if isinstance(value, torch.Tensor)}
    shown = (
        "a dict of " + ", ".join(f"{key!r}: {type(value).__name__}" for key, value in pred.items())
        if isinstance(pred, Mapping)
        else describe(pred)
    )
    raise FitforgeTypeError(
        f"the net returned {shown} for batch {batch_idx}; predict needs a tensor, a tuple of tensors "
        "or a dict holding tensors (override BatchProcessor.predict_batch for other outputs)"
    )


def check_batch_output(output: Any, method: str) -> None:
    """A processor's ``fit_batch``/``evaluate_batch`` must return a BatchOutput with a batch size
    (a missing one would silently turn the loss mean, weighted by batch size, into nan) and no 0-d
    label (a single sample, not a batch)."""
    if not isinstance(output, BatchOutput):
        raise FitforgeTypeError(f"BatchProcessor.{method} must return a fitforge.BatchOutput, got {describe(output)}")
    size = output.batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise FitforgeValueError(
            f"BatchProcessor.{method} returned BatchOutput(batch_size={size!r}); set it to the number of samples "
            "in the batch (fitforge.core.batches.batch_size_of(inputs)): it weights the loss and metric means"
        )
    label = output.label
    label = tuple(label.values()) if isinstance(label, Mapping) else label if isinstance(label, tuple) else (label,)
    if any(isinstance(y, torch.Tensor) and y.dim() == 0 for y in label):
        raise FitforgeValueError(
            "the label of the first batch is a 0-d tensor: this looks like a single sample, not a batch; "
            "batch your samples with DataLoader(dataset, batch_size=...), or, for a stream of samples (an "
            "IterableDataset), pass batch_size= to fit, evaluate or predict"
        )


_DECLARED = ("fit_batch", "evaluate_batch", "predict_batch", "allow_nonfinite", "logs", "record_loss", "label_keys")


def check_batch_processor(processor: Any) -> Any:
    """A BatchProcessor instance, or anything with what the loop reads of one (``StepProcessor``: its three
    steps and four attributes)."""
    if isinstance(processor, type):
        raise FitforgeTypeError(
            f"batch_processor must be a BatchProcessor instance, got {describe(processor)}; pass an instance: "
            f"{processor.__name__}()"
        )
    if not isinstance(processor, BatchProcessor):
        missing = [name for name in _DECLARED if name not in dir(processor)]
        if missing:
            raise FitforgeTypeError(
                f"batch_processor must be a BatchProcessor instance, got {describe(processor)}, which lacks "
                f"{', '.join(missing)}: subclass fitforge.BatchProcessor, which has them all"
            )
    return processor

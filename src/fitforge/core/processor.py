"""BatchProcessor: one batch in, one :class:`~fitforge.BatchOutput` out.

``fit_batch`` does forward, loss and backward — not the optimizer step, which belongs to
:class:`~fitforge.handlers.GradientUpdateHandler` so handlers can act between backward and step.
Subclass it for models whose step is not ``net(*data)`` then ``loss(pred, label)``: seq2seq with
teacher forcing, detection with anchor matching, GANs, several optimizers.

Example:
    >>> class TeacherForcing(BatchProcessor):
    ...     def forward(self, net, inputs, label):
    ...         return net(*inputs, label)        # the decoder sees the shifted target
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from fitforge.core.arguments import check_flag
from fitforge.core.data import Inputs, batch_size_of, to_channels_last, to_device, unpack_inputs, unpack_pair
from fitforge.core.state import BatchOutput, EstimatorLike, TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, LossInputError, describe

_FULL_PRECISION = nullcontext()  # reusable: a float32 batch creates no context object


class BatchProcessor:
    """The default per-batch step; override any method to customise it.

    ``to_device`` is the step ``fit_batch`` and ``evaluate_batch`` share after unpacking (``predict``
    uses ``inputs_to_device``): override it to turn labels into training targets on the device, e.g.
    to match boxes to anchors in a detector.

    Args:
        host_inputs: positions of inputs to leave on the host instead of moving them to the device,
            e.g. ``(1,)`` for the lengths ``pack_padded_sequence`` reads on the CPU (moving them to a
            GPU and back would wait for the device every batch).
        allow_nonfinite: accept nan and inf in the data and labels, for a net or loss that handles
            them on purpose (missing values, masked targets). By default the first batch of fit and
            of its validation data is checked for them before its forward.
    """

    host_inputs: tuple[int, ...] = ()
    allow_nonfinite: bool = False

    def __init__(self, host_inputs: tuple[int, ...] = (), allow_nonfinite: bool = False) -> None:
        self.allow_nonfinite = check_flag("BatchProcessor", "allow_nonfinite", allow_nonfinite)
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

    _own_autocast = False  # a subclass that overrides autocast() always has its context entered
    _unpack_overridden = False  # without an override, to_device calls unpack_pair itself: one call less per batch

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
        """Split a batch into ``(inputs, label)``: a ``(data, label)`` pair gives a tuple of inputs;
        a dict batch gives its keyword inputs (passed as ``net(**features)``) and the label under
        ``"labels"`` (else ``"label"``). Override for other batch formats."""
        return unpack_pair(batch)

    def to_device(self, state: TrainState, batch: Any) -> tuple[Inputs, Any]:
        """``unpack`` the batch and move inputs (except ``host_inputs``) and label to the estimator's
        device: non-blocking on CUDA, so batches from a ``DataLoader(pin_memory=True)`` copy while
        the GPU computes; 4-D inputs in channels-last order when the estimator asks for it."""
        inputs, label = self.unpack(batch) if self._unpack_overridden else unpack_pair(batch)
        estimator = state.estimator
        device = estimator.device
        if type(label) is not torch.Tensor or label.device != device:
            label = to_device(label, device, estimator.non_blocking)
        return self._inputs_to(inputs, estimator), label

    def forward(self, net: torch.nn.Module, inputs: Inputs, label: Any) -> Any:
        """Run the net: ``net(*inputs)``, or ``net(**features)`` for a dict batch; ``label`` is passed
        for processors that need it (teacher forcing)."""
        return net(**inputs) if type(inputs) is dict else net(*inputs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, with a clear error when it cannot carry a gradient."""
        try:
            loss.backward()
        except RuntimeError as err:  # explained here, so the common path pays for no check
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

    def fit_batch(self, state: TrainState, batch: Any) -> BatchOutput:
        """Forward and loss (under the precision's autocast), then backward on one training batch.

        The forward goes through ``estimator.train_net`` (the DistributedDataParallel wrapper under
        torchrun, else the net): an override must too, or the ranks' gradients are not averaged."""
        inputs, label = self.to_device(state, batch)
        estimator = state.estimator
        pred, loss, losses = self._forward_loss(state, estimator.train_net, estimator.compute_loss, inputs, label)
        scaler = estimator.scaler
        self.backward(loss if scaler is None else scaler.scale(loss))  # fp16: scaled against underflow
        return BatchOutput(inputs, label, pred, loss, losses, batch_size_of(inputs))

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
            pred = self.forward(net, inputs, label)
            loss, losses = compute_loss(pred, label)
            return pred, loss, losses
        with self.autocast(state):
            pred = self.forward(net, inputs, label)
            loss, losses = compute_loss(pred, label)
            return pred, loss, losses

    def inputs_to_device(self, state: TrainState, batch: Any) -> Inputs:
        """The inputs of a predict batch on the device: from a bare tensor, ``(data,)``, or anything
        ``unpack`` splits into ``(inputs, label)`` (the label is dropped)."""
        return self._inputs_to(unpack_inputs(batch, self.unpack), state.estimator)

    def predict_batch(self, state: TrainState, batch: Any) -> Any:
        """The ``val_net`` outputs for a batch of inputs (a ``(data, label)`` pair or bare data)."""
        inputs = self.inputs_to_device(state, batch)
        with self.autocast(state):
            return self.forward(state.estimator.val_net, inputs, None)


def check_outputs(pred: Any, batch_idx: int) -> Any:
    """A net's output must be a tensor or a tuple/list of tensors (returned as a tuple)."""
    if isinstance(pred, torch.Tensor):
        return pred
    if isinstance(pred, (tuple, list)) and pred and all(isinstance(p, torch.Tensor) for p in pred):
        return tuple(pred)
    raise FitforgeTypeError(
        f"the net returned {describe(pred)} for batch {batch_idx}; predict needs a tensor "
        "or a tuple of tensors (override BatchProcessor.predict_batch for other outputs)"
    )


def check_batch_output(output: Any, method: str) -> None:
    """A processor's ``fit_batch``/``evaluate_batch`` must return a BatchOutput with a batch size:
    a missing one would silently turn the loss mean (weighted by batch size) into nan."""
    if not isinstance(output, BatchOutput):
        raise FitforgeTypeError(f"BatchProcessor.{method} must return a fitforge.BatchOutput, got {describe(output)}")
    size = output.batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise FitforgeValueError(
            f"BatchProcessor.{method} returned BatchOutput(batch_size={size!r}); set it to the number of samples "
            "in the batch (fitforge.core.data.batch_size_of(inputs)): it weights the loss and metric means"
        )


def check_batch_processor(processor: Any) -> Any:
    """A BatchProcessor instance, or anything with its three step methods."""
    steps = ("fit_batch", "evaluate_batch", "predict_batch")
    if isinstance(processor, type) or not all(callable(getattr(processor, m, None)) for m in steps):
        hint = f"; pass an instance: {processor.__name__}()" if isinstance(processor, type) else ""
        raise FitforgeTypeError(f"batch_processor must be a BatchProcessor instance, got {describe(processor)}{hint}")
    return processor

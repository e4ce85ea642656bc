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

from .data import batch_size_of, to_device, unpack_inputs, unpack_pair
from .exceptions import FitforgeTypeError, FitforgeValueError, LossInputError, describe
from .state import BatchOutput, TrainState


class BatchProcessor:
    """The default per-batch step; override any method to customise it.

    ``to_device`` is the step ``fit_batch`` and ``evaluate_batch`` share after unpacking (``predict``
    uses ``inputs_to_device``): override it to turn labels into training targets on the device, e.g.
    to match boxes to anchors in a detector.

    Args:
        host_inputs: positions of inputs to leave on the host instead of moving them to the device,
            e.g. ``(1,)`` for the lengths ``pack_padded_sequence`` reads on the CPU (moving them to a
            GPU and back would wait for the device every batch).
    """

    host_inputs: tuple[int, ...] = ()

    def __init__(self, host_inputs: tuple[int, ...] = ()) -> None:
        if not isinstance(host_inputs, (tuple, list)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in host_inputs):
            raise FitforgeTypeError(f"BatchProcessor: host_inputs must be a tuple of input positions (ints >= 0), "
                                    f"got {describe(host_inputs)}")
        if any(i < 0 for i in host_inputs):
            raise FitforgeValueError(f"BatchProcessor: host_inputs positions must be >= 0, got {tuple(host_inputs)}")
        self.host_inputs = tuple(host_inputs)

    def _inputs_to(self, inputs: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
        if not self.host_inputs:
            return to_device(inputs, device)
        return tuple(x if i in self.host_inputs else to_device(x, device) for i, x in enumerate(inputs))

    def unpack(self, batch: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Split a batch into ``(inputs tuple, label)``. Override to accept dict batches."""
        return unpack_pair(batch)

    def to_device(self, state: TrainState, batch: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """``unpack`` the batch and move inputs (except ``host_inputs``) and label to the estimator's device."""
        inputs, label = self.unpack(batch)
        device = state.estimator.device
        return self._inputs_to(inputs, device), to_device(label, device)

    def forward(self, net: torch.nn.Module, inputs: tuple[torch.Tensor, ...], label: Any) -> Any:
        """Run the net; ``label`` is passed for processors that need it (teacher forcing)."""
        return net(*inputs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``, with a clear error when it cannot carry a gradient."""
        if loss.dim() != 0:
            raise LossInputError(
                f"the loss must be a scalar tensor, got shape {tuple(loss.shape)}; use reduction='mean'"
            )
        if not loss.requires_grad:
            raise LossInputError(
                "the loss does not require grad, so nothing can be trained: was it computed under "
                "torch.no_grad(), from detached outputs, or for a net with all parameters frozen?"
            )
        loss.backward()

    def autocast(self, state: TrainState) -> AbstractContextManager:
        """The mixed-precision context of the estimator's ``precision`` (a no-op in float32)."""
        dtype = state.estimator.autocast_dtype
        return nullcontext() if dtype is None else torch.autocast(state.estimator.device.type, dtype=dtype)

    def fit_batch(self, state: TrainState, batch: Any) -> BatchOutput:
        """Forward and loss (under the precision's autocast), then backward on one training batch."""
        inputs, label = self.to_device(state, batch)
        with self.autocast(state):
            pred = self.forward(state.estimator.net, inputs, label)
            loss, losses = state.estimator.compute_loss(pred, label)
        scaler = state.estimator.scaler
        self.backward(loss if scaler is None else scaler.scale(loss))  # fp16: scaled against underflow
        return BatchOutput(inputs, label, pred, loss, losses, batch_size_of(inputs))

    def evaluate_batch(self, state: TrainState, batch: Any) -> BatchOutput:
        """Forward and loss with ``val_net``/``val_loss`` (called under ``torch.inference_mode``)."""
        inputs, label = self.to_device(state, batch)
        with self.autocast(state):
            pred = self.forward(state.estimator.val_net, inputs, label)
            loss, losses = state.estimator.compute_val_loss(pred, label)
        return BatchOutput(inputs, label, pred, loss, losses, batch_size_of(inputs))

    def inputs_to_device(self, state: TrainState, batch: Any) -> tuple[torch.Tensor, ...]:
        """The inputs of a predict batch on the device: from a bare tensor, ``(data,)``, or anything
        ``unpack`` splits into ``(inputs, label)`` (the label is dropped)."""
        return self._inputs_to(unpack_inputs(batch, self.unpack), state.estimator.device)

    def predict_batch(self, state: TrainState, batch: Any) -> Any:
        """The ``val_net`` outputs for a batch of inputs (a ``(data, label)`` pair or bare data)."""
        inputs = self.inputs_to_device(state, batch)
        with self.autocast(state):
            return self.forward(state.estimator.val_net, inputs, None)

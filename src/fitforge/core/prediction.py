"""predict's outputs, moved to the host batch by batch and joined at the end: a tensor, a tuple of
tensors for several outputs, or a dict of tensors for a net returning named outputs."""

from __future__ import annotations

from typing import Any

import torch

from fitforge.core.batches import batch_size_of, to_device
from fitforge.core.processor import check_outputs
from fitforge.core.run import Step
from fitforge.core.state import BatchOutput, TrainState


class Predictions:
    """Wraps a ``predict_batch`` step: each batch's outputs go to the CPU (asynchronously from CUDA,
    so a large prediction never fills the device), and :meth:`joined` concatenates them."""

    def __init__(self, predict_batch: Step, asynchronous: bool) -> None:
        self.predict_batch, self.asynchronous = predict_batch, asynchronous
        self.outputs: list[Any] = []

    def step(self, state: TrainState, batch: Any) -> BatchOutput:
        pred = check_outputs(self.predict_batch(state, batch), state.batch_idx)
        self.outputs.append(to_device(pred, torch.device("cpu"), non_blocking=self.asynchronous))
        return BatchOutput(
            (), None, pred, None, (), batch_size_of(pred if isinstance(pred, (tuple, dict)) else (pred,))
        )

    def joined(self, device: torch.device) -> Any:
        """Every batch's outputs concatenated (a tuple for several outputs, a dict for named ones);
        None for no batch."""
        if self.asynchronous:  # the one sync of a prediction: the copies must have landed
            torch.cuda.synchronize(device)
        if not self.outputs:
            return None
        if isinstance(self.outputs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*self.outputs))
        if isinstance(self.outputs[0], dict):
            return {key: torch.cat([batch[key] for batch in self.outputs]) for key in self.outputs[0]}
        return torch.cat(self.outputs)

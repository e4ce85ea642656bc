"""predict's outputs (a tensor, a tuple or a dict of tensors), moved to the host batch by batch. Where the
number of rows is known in advance, each batch is copied into tensors of the whole size as it comes, so a
prediction needs its output's memory once, not twice; otherwise the batches are concatenated at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fitforge.core.batches import batch_size_of, to_device
from fitforge.core.processor import check_outputs
from fitforge.core.run import Step
from fitforge.core.state import BatchOutput, TrainState


class Predictions:
    """Wraps a ``predict_batch`` step: each batch's outputs go to the CPU (asynchronously from CUDA);
    :meth:`joined` gives them all, :meth:`take` the ones not taken yet."""

    def __init__(self, predict_batch: Step, asynchronous: bool, device: torch.device | None = None) -> None:
        self.predict_batch, self.asynchronous, self.device = predict_batch, asynchronous, device
        self.outputs: list[Any] = []
        self._rows: int | None = None
        self._buffer: _Buffer | None = None

    def expect_rows(self, rows: int | None) -> None:
        """Keep the outputs in tensors of ``rows`` rows (a wrong guess falls back to concatenating)."""
        self._rows = None if self.asynchronous or not rows else rows

    def step(self, state: TrainState, batch: Any) -> BatchOutput:
        pred = check_outputs(self.predict_batch(state, batch), state.batch_idx)
        host = to_device(pred, torch.device("cpu"), non_blocking=self.asynchronous)
        if self._rows is None or not self._keep(host):  # kept: copied, the batch's own tensors go
            self.outputs.append(host)
        return BatchOutput(
            (), None, pred, None, (), batch_size_of(pred if isinstance(pred, (tuple, dict)) else (pred,))
        )

    def _keep(self, host: Any) -> bool:
        """Copy ``host`` into the buffer; False (and back to a list) when it does not fit there."""
        if self._buffer is None:
            self._buffer = _Buffer.of(host, self._rows)  # type: ignore[arg-type]
        if self._buffer is not None and self._buffer.add(host):
            return True
        if self._buffer is not None:  # what it holds so far becomes the list's first item
            self.outputs.append(self._buffer.joined())
        self._rows, self._buffer = None, None
        return False

    def take(self) -> list[Any]:
        """The outputs of the batches since the last call, as ordinary tensors (call outside inference mode)."""
        if self.asynchronous and self.outputs:  # the copies went on the estimator's device's stream
            torch.cuda.current_stream(self.device).synchronize()
        taken, self.outputs = self.outputs, []
        return [_ordinary(output) for output in taken]

    def joined(self, device: torch.device) -> Any:
        """Every batch's outputs concatenated (a tuple or dict for several outputs); None for no batch."""
        if self.asynchronous:  # the one sync of a prediction: the copies must have landed
            torch.cuda.synchronize(device)
        if self._buffer is not None:
            return self._buffer.joined()
        if not self.outputs:
            return None
        if isinstance(self.outputs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*self.outputs))
        if isinstance(self.outputs[0], dict):
            return {key: torch.cat([batch[key] for batch in self.outputs]) for key in self.outputs[0]}
        return torch.cat(self.outputs)


class _Buffer:
    """Tensors of the whole prediction's rows, filled batch by batch."""

    def __init__(
        self, tensors: list[torch.Tensor], rebuild: Callable[[Sequence[torch.Tensor]], Any], keys: list | None
    ) -> None:
        self.tensors, self.rebuild, self.keys, self.filled = tensors, rebuild, keys, 0

    @classmethod
    def of(cls, first: Any, rows: int) -> _Buffer | None:
        """A buffer shaped after the first batch's outputs (None for a structure it cannot hold)."""
        parts, rebuild = _flat(first)
        if not parts or any(part.dim() == 0 for part in parts):
            return None
        keys = list(first) if isinstance(first, dict) else None
        # Ordinary tensors, as joined batches are: autograd and in-place edits take them.
        with torch.inference_mode(False):
            return cls([torch.empty((rows, *part.shape[1:]), dtype=part.dtype) for part in parts], rebuild, keys)

    def add(self, host: Any) -> bool:
        if (list(host) if isinstance(host, dict) else None) != self.keys:  # named outputs go by name
            return False
        parts, _ = _flat(host)
        if len(parts) != len(self.tensors):
            return False
        start, rows = self.filled, parts[0].shape[0] if parts and parts[0].dim() else -1
        for part, tensor in zip(parts, self.tensors):
            if part.dim() == 0 or part.shape[0] != rows or part.shape[1:] != tensor.shape[1:]:
                return False
            if part.dtype != tensor.dtype or start + rows > len(tensor):
                return False
        for part, tensor in zip(parts, self.tensors):
            tensor[start : start + rows].copy_(part)
        self.filled += rows
        return True

    def joined(self) -> Any:
        """The rows filled so far, in the outputs' structure (copied out when fewer than allocated)."""
        whole = all(len(tensor) == self.filled for tensor in self.tensors)
        return self.rebuild([tensor if whole else tensor[: self.filled].clone() for tensor in self.tensors])


def _ordinary(output: Any) -> Any:
    """``output`` with its inference tensors copied into ordinary ones, which autograd takes."""
    parts, rebuild = _flat(output)
    return rebuild([part.clone() if part.is_inference() else part for part in parts])


def _flat(output: Any) -> tuple[list[torch.Tensor], Callable[[Sequence[torch.Tensor]], Any]]:
    """An output's tensors in a list, and the function that puts such a list back in its structure."""
    if isinstance(output, torch.Tensor):
        return [output], lambda parts: parts[0]
    if isinstance(output, tuple):
        return list(output), tuple
    keys = list(output)
    return [output[key] for key in keys], lambda parts: dict(zip(keys, parts))

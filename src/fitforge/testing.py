"""Tiny problems and recording handlers for tests — public, because users test their handlers too."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode  # the public way to observe aten calls
from torch.utils.data import DataLoader, TensorDataset

from fitforge.core.events import BatchBegin, BatchEnd, EpochBegin, EpochEnd, TrainBegin, TrainEnd
from fitforge.estimator import Estimator


def linear_data(
    n: int = 256, batch_size: int = 32, noise: float = 0.0, seed: int = 0, shuffle: bool = False
) -> DataLoader:
    """A DataLoader of ``y = 2x + 3 (+ noise)`` with x ~ U(-1, 1), both of shape (N, 1)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=generator) * 2 - 1
    y = 2 * x + 3 + noise * torch.randn(n, 1, generator=generator)
    return DataLoader(
        TensorDataset(x, y),
        batch_size=batch_size,
        shuffle=shuffle,
        generator=torch.Generator().manual_seed(seed) if shuffle else None,
    )


def linear_splits(n: int = 256, batch_size: int = 32, seed: int = 0) -> dict[str, DataLoader]:
    """``{"train_data": ..., "val_data": ...}`` of y = 2x + 3: what a data function of ``fitforge fit`` returns."""
    return {
        "train_data": linear_data(n, batch_size, seed=seed, shuffle=True),
        "val_data": linear_data(n // 4, batch_size, seed=seed + 1),
    }


def linear_problem(lr: float = 0.1, seed: int = 0, **estimator_kwargs: Any):
    """``(estimator, train_loader, val_loader)`` for y = 2x + 3: a Linear(1, 1) net, MSE loss, SGD;
    it converges to weight ≈ 2, bias ≈ 3 in a few epochs, well under a second."""
    torch.manual_seed(seed)
    net = nn.Linear(1, 1)
    estimator_kwargs.setdefault("device", "cpu")
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=lr), **estimator_kwargs)
    return estimator, linear_data(seed=seed), linear_data(n=64, seed=seed + 1)


class RecordingHandler(TrainBegin, EpochBegin, BatchBegin, BatchEnd, EpochEnd, TrainEnd):
    """Records every event it sees as ``(event, phase, epoch, batch_idx, global_step)`` in ``calls``
    (``events``: the names alone). ``RecordingHandler(stop_on=("batch_end", 3))`` returns True from
    ``batch_end`` when ``global_step == 3``."""

    def __init__(self, priority: int = 0, stop_on: tuple[str, int] | None = None) -> None:
        self.priority = priority
        self.stop_on = stop_on
        self.calls: list[tuple[str, str, int, int, int]] = []

    @property
    def events(self) -> list[str]:
        return [call[0] for call in self.calls]

    def _record(self, event: str, state) -> bool:
        self.calls.append((event, state.phase, state.epoch, state.batch_idx, state.global_step))
        return self.stop_on is not None and self.stop_on == (event, state.global_step)

    def train_begin(self, state) -> None:
        self._record("train_begin", state)

    def epoch_begin(self, state) -> None:
        self._record("epoch_begin", state)

    def batch_begin(self, state) -> None:
        self._record("batch_begin", state)

    def batch_end(self, state) -> bool:
        return self._record("batch_end", state)

    def epoch_end(self, state) -> bool:
        return self._record("epoch_end", state)

    def train_end(self, state) -> None:
        self._record("train_end", state)


class HostReadCounter(TorchDispatchMode):
    """Count reads of tensor values to the host inside a ``with`` block (``with HostReadCounter() as reads``):
    ``.item()``, ``float()``, ``int()``, ``bool()`` and formatting dispatch ``aten._local_scalar_dense``,
    which waits for a GPU (``.tolist()``/``.numpy()`` of CPU memory are not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))

"""A tiny model, data function and handler for the CLI's tests, importable by name (the tests put
this folder on sys.path, and on PYTHONPATH for the processes they start)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge.events import EpochEnd, Stage


class TinyNet(nn.Module):
    """y = w2 relu(w1 x): built only when a run is, which ``BUILT_MARKER`` records."""

    def __init__(self, hidden: int = 4, in_features: int = 1) -> None:
        super().__init__()
        marker = os.environ.get("FITFORGE_TEST_BUILT_MARKER")
        if marker:
            Path(marker).write_text("built")
        self.layers = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def line_data(n: int = 64, batch_size: int = 16, shuffle: bool = True) -> dict:
    """y = 2x + 3 on x in [-1, 1]: shuffled training batches, validation and test batches."""
    generator = torch.Generator().manual_seed(1)
    x = torch.rand(n, 1, generator=generator) * 2 - 1
    y = 2 * x + 3
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)
    val = DataLoader(TensorDataset(x[: n // 2], y[: n // 2]), batch_size=batch_size)
    return {"train_data": train, "val_data": val, "test_data": val}


def array_data(n: int = 64) -> dict:
    """The same line as NumPy arrays, ``(X, y)`` per split (fit batches them by ``fit.batch_size``)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.rand(n, 1, generator=generator) * 2 - 1
    x, y = x.numpy(), (2 * x + 3).numpy()
    return {"train_data": (x, y), "val_data": (x[: n // 2], y[: n // 2])}


class CrashAfter(EpochEnd):
    """Ends the process (as a kill would) after epoch ``epochs`` when ``FITFORGE_TEST_CRASH`` is
    set: after the checkpoint of that epoch is written (it runs after CheckpointHandler)."""

    priority = Stage.PERSIST + 50  # after the checkpoint of the epoch, before the reports

    def __init__(self, epochs: int = 2) -> None:
        self.epochs = epochs

    def epoch_end(self, state) -> None:
        if os.environ.get("FITFORGE_TEST_CRASH") and state.epoch + 1 == self.epochs:
            os._exit(3)


def misnamed_data() -> dict:
    """A data function with a misspelt key, ``val_dat``."""
    data = line_data()
    return {"train_data": data["train_data"], "val_dat": data["val_data"]}


def line_data_with_transform(n: int = 64, transform=lambda x: x) -> dict:
    """line_data with a default no config can hold (a lambda): the run takes it, the record leaves it out."""
    data = line_data(n)
    assert callable(transform)
    return data

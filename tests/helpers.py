"""Shared helpers for the tests (importable as ``helpers``)."""

import importlib.util
import math
import sys
from pathlib import Path

import torch
from torch import nn

from fitforge import Estimator
from fitforge.events import BatchEnd


def regression_batches(n_batches=3, batch_size=4, seed=0):
    """A list of (x, y) batches for y = 2x + 3."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        x = torch.rand(batch_size, 1, generator=g)
        batches.append((x, 2 * x + 3))
    return batches


def make_estimator(**kwargs):
    net = kwargs.pop("net", None) or nn.Linear(1, 1)
    kwargs.setdefault("optimizer", torch.optim.SGD(net.parameters(), lr=0.1))
    kwargs.setdefault("device", "cpu")
    return Estimator(net, kwargs.pop("loss", nn.MSELoss()), **kwargs)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    """Import ``examples/<name>.py`` as a module (the examples folder goes on sys.path, as when the
    script runs, so it can import its neighbours ``data`` and ``common``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` as a module, to call its measuring functions on tiny inputs."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Losses(BatchEnd):
    """Every batch's loss, by global step (a host read per batch: fine in a test)."""

    def __init__(self):
        self.seen = {}

    def batch_end(self, state):
        self.seen[state.global_step] = state.output.loss.item()


class Crash(BatchEnd):
    """Fail right after the checkpoint of batch number ``at`` (1-based) was written."""

    priority = 950  # after CheckpointHandler (900)

    def __init__(self, at):
        self.at = at

    def batch_end(self, state):
        if state.global_step + 1 == self.at:
            raise RuntimeError("crash")


class NanGradient(torch.autograd.Function):
    """The identity forward; a nan gradient backward: the loss stays finite, the gradients do not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan

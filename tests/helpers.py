"""Shared helpers for the tests (importable as ``helpers``)."""

import torch
from torch import nn

from fitforge import Estimator


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

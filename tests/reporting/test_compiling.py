"""A compiled fit reports torch.compile's graphs and graph breaks (Dynamo's eager backend here: no compiler
run): a forced recompile (batches of six shapes) and a graph break each get one warning; an uncompiled fit and
one with one shape get none."""

import logging

import torch
from torch import nn

from fitforge import Estimator


class Printing(nn.Linear):
    def forward(self, x):
        print("shape", tuple(x.shape))  # a graph break: Dynamo does not trace print
        return super().forward(x)


def fit(net, sizes, compile, caplog):
    torch.manual_seed(0)
    batches = [(torch.randn(n, 4), torch.randn(n, 2)) for n in sizes]
    estimator = Estimator(net, nn.MSELoss(), optimizer="sgd", compile=compile)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="fitforge"):
        estimator.fit(batches, epochs=1, default_handlers=False)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch.compile")]


def test_a_forced_recompile_and_a_graph_break_are_reported_once(caplog):
    eager = {"backend": "eager", "dynamic": False}
    recompiled = fit(nn.Linear(4, 2), [2, 3, 4, 5, 6, 7], eager, caplog)
    assert len(recompiled) == 2 and "graphs compiled in this fit: the net was compiled again" in recompiled[1]
    caplog.clear()
    broken = fit(Printing(4, 2), [3, 3], eager, caplog)
    assert "graph break(s) in this fit: the net runs partly eagerly" in broken[1] and "print" in broken[1]
    caplog.clear()
    assert fit(nn.Linear(4, 2), [3, 3], eager, caplog) == [
        "torch.compile: 1 graph(s) compiled in this fit, 0 graph break(s)"
    ]
    caplog.clear()
    assert fit(nn.Linear(4, 2), [3, 3], False, caplog) == []

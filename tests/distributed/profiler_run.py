"""Run under torchrun: two fits of 2 epochs of 4 batches per rank, each step marked with its global step; the
first with a ProfilerHandler tracing rank 0 only (the default) into OUT/main, the second every rank into OUT/all
(torch runs one profiler at a time in a process).

Usage: profiler_run.py OUT
"""

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.handlers import LambdaHandler, ProfilerHandler

out = Path(sys.argv[1])
torch.manual_seed(0)
x = torch.rand(64, 1)
net = nn.Linear(1, 1)
estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")


def mark(state):
    with torch.profiler.record_function(f"batch{state.global_step}"):
        pass


data = DataLoader(TensorDataset(x, 2 * x + 3), batch_size=8)
for tracer in (
    ProfilerHandler(wait=1, warmup=1, active=1, log_dir=out / "main"),
    ProfilerHandler(wait=1, warmup=1, active=1, log_dir=out / "all", ranks=None),
):
    estimator.fit(data, epochs=2, event_handlers=[tracer, LambdaHandler(batch_begin=mark)])

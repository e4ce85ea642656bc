"""Run under torchrun: each rank trains its own 200 batches (a list, by RANK); rank 1 alone gets a
spiked batch (inputs x1e3, labels scrambled) at position 100. Writes OUT/result-rank<r>.json with
SpikeGuardHandler's recoveries, the optimizer steps and the final weights."""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from fitforge import Estimator
from fitforge.handlers import SpikeGuardHandler

out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
generator = torch.Generator().manual_seed(rank)
x = torch.randn(200 * 64, 8, generator=generator)
y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
batches = [(x[i * 64 : (i + 1) * 64], y[i * 64 : (i + 1) * 64]) for i in range(200)]
if rank == 1:
    bad_x, bad_y = batches[100]
    batches[100] = (bad_x * 1e3, bad_y.flip(0))
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
estimator = Estimator(
    net, nn.CrossEntropyLoss(), device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
)
guard = SpikeGuardHandler(snapshot_every=8)
estimator.fit(batches, epochs=1, event_handlers=[guard], default_handlers=False)
result = {
    "recoveries": guard.recoveries,
    "steps": estimator.history["spike_recoveries"],
    "params": {name: value.tolist() for name, value in net.state_dict().items()},
}
(out / f"result-rank{rank}.json").write_text(json.dumps(result))

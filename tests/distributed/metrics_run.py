"""Run under ``torchrun --nproc_per_node=N``: train a DDP-wrapped net one epoch on this rank's share
of the data (DistributedSampler, no shuffle), evaluate, and write rank's history and evaluate
result to OUT/rank<r>.json."""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fitforge import Estimator
from fitforge.handlers import CSVLoggerHandler

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
dataset = TensorDataset(x, y)
net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
model = DistributedDataParallel(net)
estimator = Estimator(model, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      device="cpu")
train = DataLoader(dataset, batch_size=16 // world, sampler=DistributedSampler(dataset, shuffle=False))
val = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, shuffle=False))
history = estimator.fit(train, epochs=2, event_handlers=[CSVLoggerHandler(f"{sys.argv[1]}/log-rank{rank}.csv")])
result = {"history": {key: history[key] for key in history if key.startswith("train_")},
          "evaluate": estimator.evaluate(val)}
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as file:
    json.dump(result, file)
dist.destroy_process_group()

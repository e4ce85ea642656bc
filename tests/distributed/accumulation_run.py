"""Run under torchrun (or plain python for one process): several fits of a small classifier with
gradient accumulation, each with a fresh Estimator (so a fresh DDP wrapper), one after the other,
and write this rank's results to OUT/result-rank<r>.json, one entry per fit.

Usage: accumulation_run.py OUT CONFIG_JSON, where CONFIG_JSON maps each fit's name to its
settings: accumulate (3), sync_each_batch (False), unsized (batches without len, each rank its
DistributedSampler share), epochs (2) or batches, optimizers (1 or 2), stop_at (rank 1 alone
requests a stop after that batch), sigterm_at (rank 1 sends itself SIGTERM after that batch;
this fit must come last, as the process exits), model_dir, batch_period, resume.

Each entry holds the final weights, the optimizer steps, the gradient all-reduces DDP ran (a comm
hook counts its buckets), the step and open group a resumed fit started from, and whether DDP's
``require_backward_grad_sync`` was given back after the fit.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.distributed.ranks import rank
from fitforge.distributed.stop_agreement import StopAgreement
from fitforge.handlers import CheckpointHandler, GradientUpdateHandler, LambdaHandler

GLOBAL_BATCH = 8
SAMPLES = 56  # 7 batches per epoch, on any number of ranks: not a multiple of accumulate=3

out, config = Path(sys.argv[1]), json.loads(sys.argv[2])
StopAgreement.max_interval = 1  # a stop one rank asks for falls at its batch: the mid-group cases stay mid-group
world = int(os.environ.get("WORLD_SIZE", "1"))
generator = torch.Generator().manual_seed(0)
x, y = torch.randn(SAMPLES, 6, generator=generator), torch.randint(0, 3, (SAMPLES,), generator=generator)


class Unsized:
    """This rank's batches (its DistributedSampler share, unshuffled), without ``len``."""

    def __iter__(self):
        mine = torch.arange(SAMPLES)[rank() :: world]
        size = GLOBAL_BATCH // world
        return iter([(x[mine[i : i + size]], y[mine[i : i + size]]) for i in range(0, len(mine), size)])


def count_allreduces(estimator: Estimator) -> list:
    calls: list = []
    if isinstance(estimator.train_net, DistributedDataParallel):

        def counting(state, bucket):
            calls.append(1)
            return allreduce_hook(state, bucket)

        estimator.train_net.register_comm_hook(None, counting)
    return calls


def fit(settings: dict, result: dict) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    if settings.get("optimizers", 1) == 1:
        optimizers = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)]
    else:
        optimizers = [torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9) for layer in (net[0], net[2])]
    estimator = Estimator(net, nn.CrossEntropyLoss(), device="cpu", optimizer=optimizers)
    allreduces = count_allreduces(estimator)
    handlers: list = [
        GradientUpdateHandler(settings.get("accumulate", 3), sync_each_batch=settings.get("sync_each_batch", False))
    ]
    if settings.get("model_dir"):
        handlers.append(
            CheckpointHandler(
                settings["model_dir"],
                batch_period=settings.get("batch_period"),
                resume_from_checkpoint=settings.get("resume", False),
            )
        )
    if rank() == 1 and settings.get("stop_at") is not None:
        stop_at = settings["stop_at"]
        handlers.append(LambdaHandler(batch_end=lambda state: state.global_step == stop_at))
    if rank() == 1 and settings.get("sigterm_at") is not None:
        sigterm_at = settings["sigterm_at"]

        def terminate(state):
            if state.global_step == sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)  # this rank only: the others learn of it by the agreement

        handlers.append(LambdaHandler(batch_end=terminate))
    handlers.append(
        LambdaHandler(
            epoch_begin=lambda state: result.setdefault("started", [state.global_step, state.accumulated_batches]),
            train_end=lambda state: result.update(optimizer_steps=state.optimizer_steps),
        )
    )
    data = Unsized() if settings.get("unsized") else DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // world)
    try:
        estimator.fit(data, epochs=settings.get("epochs", 2), batches=settings.get("batches"), event_handlers=handlers)
    finally:
        result["allreduces"] = len(allreduces)
        result["params"] = {name: value.tolist() for name, value in net.state_dict().items()}
        result["sync_given_back"] = getattr(estimator.train_net, "require_backward_grad_sync", True)


results: dict = {}
try:
    for name, settings in config.items():
        results[name] = {}
        fit({"epochs": None, **settings} if "batches" in settings else settings, results[name])
except SystemExit as stop:
    results[name]["exit"] = stop.code
    raise
finally:
    (out / f"result-rank{rank()}.json").write_text(json.dumps(results))

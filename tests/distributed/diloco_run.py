"""Run under torchrun: a small MLP regression trained with DiLoCoStrategy(sync_every=3) and a
per-rank AdamW for BATCHES steps, checkpointing every 2 batches into MODEL_DIR; writes
OUT/result-rank<r>.json with the initial and final weights and the global steps this run trained.

Usage: diloco_run.py OUT CONFIG_JSON, where CONFIG_JSON holds model_dir, and optionally resume and
kill_at (rank 1 SIGKILLs itself before training the batch of that global step).
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.distributed.diloco import DiLoCoStrategy
from fitforge.distributed.ranks import rank, world_size
from fitforge.handlers import CheckpointHandler, LambdaHandler

SAMPLES, FEATURES, RANK_BATCH, BATCHES, SYNC_EVERY, LR = 24, 3, 2, 9, 3, 0.02


def build_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))


def inner_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return x, x.sum(1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)


def as_lists(net: nn.Module) -> dict:
    return {name: value.tolist() for name, value in net.state_dict().items()}


def main() -> None:
    out, config = Path(sys.argv[1]), json.loads(sys.argv[2])
    net = build_net()
    initial = as_lists(net)
    estimator = Estimator(
        net, nn.MSELoss(), optimizer=inner_optimizer(net), device="cpu", strategy=DiLoCoStrategy(sync_every=SYNC_EVERY)
    )
    trained: list[int] = []

    def batch_begin(state) -> None:
        if state.global_step == config.get("kill_at") and rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # no save, no train_end: as a lost machine
        trained.append(state.global_step)

    saver = CheckpointHandler(config["model_dir"], batch_period=2, resume_from_checkpoint=config.get("resume", False))
    loader = DataLoader(TensorDataset(*data()), batch_size=RANK_BATCH, shuffle=False)
    estimator.fit(
        loader, batches=BATCHES, event_handlers=[LambdaHandler(batch_begin=batch_begin), saver], default_handlers=False
    )
    result = {"initial": initial, "final": as_lists(net), "trained": trained, "world": world_size()}
    (out / f"result-rank{rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

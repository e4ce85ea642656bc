"""Run under torchrun (or plain python for one process): train a small classifier on shuffled data
with 4 samples per rank's batch, checkpointing into MODEL_DIR, and write OUT/result-rank<r>.json:
the initial and final weights and, for every batch this rank trained, (epoch, global step, the
indices of its samples).

Usage: world_change_run.py OUT CONFIG_JSON, where CONFIG_JSON holds model_dir, epochs or batches,
and optionally resume and strategy. The first input column is the sample's index, which the net
drops: the record comes from the batches themselves.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.distributed.ranks import rank
from fitforge.handlers import CheckpointHandler, LambdaHandler

SAMPLES, FEATURES, CLASSES, RANK_BATCH, LR, MOMENTUM = 48, 6, 3, 4, 0.1, 0.9


class DropIndex(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1:]


def build_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(DropIndex(), nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    return torch.cat([torch.arange(SAMPLES, dtype=torch.float32).unsqueeze(1), x], 1), y


def full_weights(net: nn.Module, strategy: str) -> dict:
    weights = net.state_dict()
    if strategy == "fsdp":  # each rank holds shards: gather the full tensors (a collective)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    return {name: value.tolist() for name, value in weights.items()}


def main() -> None:
    out, config = Path(sys.argv[1]), json.loads(sys.argv[2])
    strategy = config.get("strategy", "auto")
    net = build_net()
    initial = {name: value.tolist() for name, value in net.state_dict().items()}
    estimator = Estimator(
        net,
        nn.CrossEntropyLoss(),
        device="cpu",
        optimizer=torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM),
        strategy=strategy,
    )
    record: list = []
    recorder = LambdaHandler(
        batch_end=lambda state: record.append([state.epoch, state.global_step, state.batch[0][:, 0].int().tolist()])
    )
    saver = CheckpointHandler(config["model_dir"], resume_from_checkpoint=config.get("resume", False))
    x, y = data()
    torch.manual_seed(0)  # the fit's seed, and so the data order
    loader = DataLoader(TensorDataset(x, y), batch_size=RANK_BATCH, shuffle=True)
    estimator.fit(
        loader,
        epochs=config.get("epochs"),
        batches=config.get("batches"),
        event_handlers=[recorder, saver],
        default_handlers=False,
    )
    result = {"initial": initial, "final": full_weights(net, strategy), "record": record}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    (out / f"result-rank{rank()}.json").write_text(json.dumps({**result, "world": world}))


if __name__ == "__main__":
    main()

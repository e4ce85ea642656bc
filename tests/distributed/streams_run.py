"""Run under torchrun (or plain python for one process): train a small classifier on a Hugging Face json
stream (8 shard files, shuffled through a buffer, in a plain DataLoader of WORKERS workers, 4 samples per
rank's batch), checkpointing into MODEL_DIR, and write OUT/result-rank<r>.json: the final weights and, for
every batch this rank trained, (epoch, global step, the ids of its samples).

Usage: streams_run.py OUT CONFIG_JSON, where CONFIG_JSON holds shards, model_dir, workers, epochs or
batches, and optionally resume, keep (persistent workers), unseeded (the shuffle without a seed), user_shard
(each rank's own files) and strategy.
"""

import json
import os
import sys
from pathlib import Path

import datasets
import torch
from torch import nn
from torch.utils.data import DataLoader

from fitforge import Estimator
from fitforge.distributed.ranks import rank
from fitforge.handlers import CheckpointHandler, LambdaHandler

RANK_BATCH = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x, i=None):  # the batch also holds the sample's id, not a feature
        return self.layers(x)


def main() -> None:
    out, config = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)
    paths = sorted(str(path) for path in Path(config["shards"]).glob("*.jsonl"))
    stream = datasets.load_dataset("json", data_files=paths, streaming=True, split="train")
    seed = None if config.get("unseeded") else 7  # None: each rank draws its own
    stream = stream.shuffle(seed=seed, buffer_size=16).with_format("torch")
    if config.get("user_shard"):  # the rank's own files: a split of the user's, which fitforge refuses
        stream = stream.shard(num_shards=int(os.environ["WORLD_SIZE"]), index=int(os.environ["RANK"]))
    net = Net()
    strategy = config.get("strategy", "auto")
    if strategy == "none":  # the script's own group: fitforge neither wraps the net nor splits the data
        import torch.distributed as dist

        dist.init_process_group("gloo")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    estimator = Estimator(net, nn.CrossEntropyLoss(), device="cpu", optimizer=optimizer, strategy=strategy)
    record: list = []
    recorder = LambdaHandler(
        batch_end=lambda state: record.append([state.epoch, state.global_step, state.batch["i"].tolist()])
    )
    saver = CheckpointHandler(config["model_dir"], resume_from_checkpoint=config.get("resume", False))
    estimator.fit(
        DataLoader(
            stream, batch_size=RANK_BATCH, num_workers=config["workers"], persistent_workers=config.get("keep", False)
        ),
        epochs=config.get("epochs"),
        batches=config.get("batches"),
        event_handlers=[recorder, saver],
        default_handlers=False,
    )
    final = {name: value.tolist() for name, value in net.state_dict().items()}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    (out / f"result-rank{rank()}.json").write_text(json.dumps({"final": final, "record": record, "world": world}))


if __name__ == "__main__":
    main()

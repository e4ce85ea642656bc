"""A run of test_stateful_kill9.py, in its own process: trains on data that keeps its own position, resuming
from the newest checkpoint in DIR as a re-run of a crashed job would, and SIGKILLs itself at a batch.

    python stateful_run.py --dir DIR --kind KIND --reads LOG [--shards FOLDER] [--kill-after N] [--out OUT]
                           [--no-sample-seeds]

KIND: ``loader`` (a StatefulDataLoader, 2 workers, over a shuffled map-style dataset whose __getitem__
draws a random transform from torch's generator and Python's ``random``; ``--no-sample-seeds`` reads it
with fit(sample_seeds=False), the workers' own generators), ``stream`` (a Hugging Face json
stream shuffled through a buffer, given to fit with batch_size=) or ``stream-workers`` (that stream, its
buffer filled from one shard at a time, in a StatefulDataLoader with 2 workers). LOG gets a line per sample
the transform sees, ``<kind> <id>`` (``read`` before the shuffle, ``seen`` after it), each one os.write,
which a SIGKILL does not lose.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from fitforge import Estimator
from fitforge.events import BatchEnd
from fitforge.handlers import CheckpointHandler

SAMPLES = 48  # the map-style dataset: 6 batches of 8


class Log:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None

    def __call__(self, kind: str, sample: int) -> None:
        if self.fd is None:  # opened in the process that writes (a worker)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self.fd, f"{kind} {sample}\n".encode())

    def __getstate__(self) -> dict:
        return {"path": self.path, "fd": None}


class Transformed(Dataset):
    """Samples through a random transform drawn from torch's generator and Python's ``random``: the process's
    own, which fit seeds per sample (a worker's otherwise, which depends on the batches it loaded before)."""

    def __init__(self, log: Log) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x, self.y = (
            torch.randn(SAMPLES, 6, generator=generator),
            torch.randint(0, 3, (SAMPLES,), generator=generator),
        )
        self.log = log

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        self.log("seen", index)
        return self.x[index] + 0.1 * torch.randn(6) + random.Random(torch.initial_seed()).uniform(-0.1, 0.1), self.y[
            index
        ]


class Logged:
    """A ``datasets`` map function that logs each example's id."""

    def __init__(self, log: Log, kind: str) -> None:
        self.log, self.kind = log, kind

    def __call__(self, example: dict) -> dict:
        self.log(self.kind, example["i"])
        return example


class Net(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x, i=None):  # a stream's dict batch also holds the sample id, not a feature
        return self.layers(x)


class Kill(BatchEnd):
    priority = 950  # after CheckpointHandler (900): the checkpoint of this batch, if any, is on disk

    def __init__(self, after: int) -> None:
        self.after = after

    def batch_end(self, state) -> None:
        if state.global_step + 1 == self.after:
            os.kill(os.getpid(), signal.SIGKILL)


def stream(shards: str, log: Log, one_shard_at_a_time: bool = False):
    """The json shards shuffled through a buffer of 16 (in workers, filled from one shard at a time: datasets
    cannot load the state of interleaved shards there, see fitforge.inputs.stateful)."""
    import datasets

    paths = sorted(str(path) for path in Path(shards).glob("*.jsonl"))
    ds = datasets.load_dataset("json", data_files=paths, streaming=True, split="train").map(Logged(log, "read"))
    ds = ds.shuffle(seed=7, buffer_size=16, **({"max_buffer_input_shards": 1} if one_shard_at_a_time else {}))
    return ds.map(Logged(log, "seen")).with_format("torch")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--kind", required=True, choices=["loader", "stream", "stream-workers"])
    parser.add_argument("--reads", required=True)
    parser.add_argument("--shards")
    parser.add_argument("--kill-after", type=int, default=0)
    parser.add_argument("--out")
    parser.add_argument("--no-sample-seeds", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from torchdata.stateful_dataloader import StatefulDataLoader

    log, batch_size = Log(args.reads), None
    if args.kind == "loader":
        data = StatefulDataLoader(Transformed(log), batch_size=8, shuffle=True, num_workers=2)
        net = Net(6)
    elif args.kind == "stream":
        data, batch_size, net = stream(args.shards, log), 8, Net(2)
    else:
        data, net = StatefulDataLoader(stream(args.shards, log, True), batch_size=8, num_workers=2), Net(2)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01))
    saver = CheckpointHandler(args.dir, batch_period=4, max_checkpoints=2, resume_from_checkpoint=True)
    handlers = [saver] + ([Kill(args.kill_after)] if args.kill_after else [])
    seeds = False if args.no_sample_seeds else None  # None: on, as a handler saves checkpoints
    estimator.fit(data, epochs=3, batch_size=batch_size, event_handlers=handlers, sample_seeds=seeds)
    if args.out:
        torch.save(net.state_dict(), args.out)


if __name__ == "__main__":
    main()

"""A run of test_goodput_kill9.py, in its own process: a small regression whose loader sleeps 20 ms per
batch and whose checkpoint writes sleep 300 ms each, resuming from DIR's newest checkpoint; it SIGKILLs
itself right after the checkpoint of batch KILL, and writes the run's seconds by cause (state.run.clock's
totals, across resumes) to OUT at its end. LOG gets a line per sleep as long as it really took, ``data
<seconds>`` or ``write <seconds>`` (on a busy machine a sleep overruns), each one os.write, which a SIGKILL
does not lose.

    python goodput_run.py DIR OUT LOG [KILL]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

from fitforge import Estimator
from fitforge.checkpoint import LocalCheckpointIO
from fitforge.events import BatchEnd, TrainEnd
from fitforge.handlers import CheckpointHandler

DATA_SLEEP, WRITE_SLEEP = 0.02, 0.3
LOG = -1  # the sleeps' log, opened by main
EPOCHS, BATCHES, PERIOD = 3, 20, 30  # 60 batches; checkpoints at each epoch's end and after batch 30


def sleep(kind: str, seconds: float) -> None:
    started = time.perf_counter()
    time.sleep(seconds)
    os.write(LOG, f"{kind} {time.perf_counter() - started}\n".encode())


def slow_collate(samples):
    sleep("data", DATA_SLEEP)  # waiting for data, 20 ms a batch
    return default_collate(samples)


class SlowIO(LocalCheckpointIO):
    def write(self, name: str, checkpoint: dict) -> None:
        sleep("write", WRITE_SLEEP)  # a slow disk
        super().write(name, checkpoint)


class Kill(BatchEnd):
    priority = 950  # after CheckpointHandler: the checkpoint of this batch is on disk

    def __init__(self, after: int) -> None:
        self.after = after

    def batch_end(self, state) -> None:
        if state.global_step + 1 == self.after:
            os.kill(os.getpid(), signal.SIGKILL)


class Totals(TrainEnd):
    reads = ("run",)

    def __init__(self, path: str) -> None:
        self.path = path

    def train_end(self, state) -> None:
        with open(self.path, "w") as file:
            json.dump(state.run.clock.totals(), file)


def main() -> None:
    global LOG
    folder, out, kill = sys.argv[1], sys.argv[2], int(sys.argv[4]) if len(sys.argv) > 4 else 0
    LOG = os.open(sys.argv[3], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(BATCHES * 4, 3), torch.randn(BATCHES * 4, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, collate_fn=slow_collate)
    net = nn.Linear(3, 1)
    estimator = Estimator(net, nn.MSELoss(), optimizer="sgd", device="cpu")
    saver = CheckpointHandler(io=SlowIO(folder), batch_period=PERIOD, resume_from_checkpoint=True)
    handlers = [saver, Totals(out)] + ([Kill(kill)] if kill else [])
    estimator.fit(loader, epochs=EPOCHS, event_handlers=handlers)


if __name__ == "__main__":
    main()

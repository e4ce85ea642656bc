"""The validation of trainer.py's ``--val SECONDS`` runs: a validation set as slow as asked, a fault
injected while it is read, and a journal line per validation that completed.

The set has VAL_SAMPLES samples (VAL_BATCHES batches of 8, split between the ranks under torchrun).
Once armed for a fault, each batch sleeps SECONDS, so the validation the fault hits would take
VAL_BATCHES * SECONDS (or its share per rank); the others take no time. Each sample draws from
torch's global generator, as a random augmentation would, so that a resume that got the
generators wrong shows in the weights. Validations come every VAL_PERIOD batches and at every
epoch end.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from fitforge.core.events import Stage
from fitforge.events import BatchEnd, EpochBegin, EpochEnd
from fitforge.handlers import ValidationHandler

VAL_BATCHES, VAL_PERIOD = 80, 5  # validations after 5, [8], 10, 15, [16], 20, [24], 25, 30, [32] batches
VAL_SAMPLES = VAL_BATCHES * 8
_READ_IN_FAULT = 10  # the fault comes with this read of the validation it hits: in its second batch


class SlowValSet(Dataset):
    """The validation samples; ``inject`` runs at the ``READ_IN_FAULT``-th read once :meth:`arm` ed."""

    def __init__(self, seconds_per_batch: float, inject: Callable[[int], None]) -> None:
        generator = torch.Generator().manual_seed(99)
        self.x, self.y = torch.randn(VAL_SAMPLES, 10, generator=generator), torch.randint(0, 4, (VAL_SAMPLES,))
        self.pause, self.inject = seconds_per_batch / 8, inject
        self.slow = False  # from the validation the fault hits on
        self.countdown: int | None = None
        self.completed = 0  # training batches completed before the validation under way

    def arm(self, reads: int = _READ_IN_FAULT) -> None:
        self.countdown, self.slow = reads, True

    def __len__(self) -> int:
        return VAL_SAMPLES

    def __getitem__(self, i: int):
        if self.slow:
            time.sleep(self.pause)
        torch.rand(())
        if self.countdown is not None:
            self.countdown -= 1
            if self.countdown == 0:
                self.countdown = None
                worker = get_worker_info()  # under workers, each counts its own reads: worker 0 injects
                if worker is None or worker.id == 0:
                    self.inject(self.completed)
        return self.x[i], self.y[i]


class Clock(EpochBegin, BatchEnd, EpochEnd):
    """Right before ValidationHandler: tells the set how many batches are completed, and arms it
    for a fault in the validation after ``at`` completed batches."""

    priority = Stage.METRICS - 1

    def __init__(self, val: SlowValSet, at: int | None) -> None:
        self.val, self.at = val, at

    def _now(self, completed: int) -> None:
        self.val.completed = completed
        if completed == self.at:
            self.val.arm()
            self.at = None

    def epoch_begin(self, state) -> None:  # a resumed run's owed validation comes here
        self._now(state.global_step)

    def batch_end(self, state) -> None:
        self._now(state.global_step + 1)

    def epoch_end(self, state) -> None:
        self._now(state.global_step)


class Reported(EpochEnd):
    """In the validation's own run, after its metrics: one journal line per completed validation."""

    priority = Stage.REPORT

    def __init__(self, val: SlowValSet, write: Callable[..., None]) -> None:
        self.val, self.write = val, write

    def epoch_end(self, state) -> None:
        self.write(val=self.val.completed, loss=state.metrics["val_loss"].hex())


def validation(
    seconds_per_batch: float, fault_at: int | None, inject: Callable[[int], None], write, workers: int = 0
) -> list:
    """The handlers of a validating run: [ValidationHandler, Clock]."""
    val = SlowValSet(seconds_per_batch, inject)
    if fault_at == 0:  # the check before training reads the set's first samples
        val.arm(1)
    loader = DataLoader(val, batch_size=8, num_workers=workers)
    handler = ValidationHandler(loader, batch_period=VAL_PERIOD, event_handlers=[Reported(val, write)])
    return [handler, Clock(val, fault_at or None)]


def rank_suffix() -> str:
    """``.rank<r>`` under torchrun (each rank its own journal), else ``""``."""
    return f".rank{os.environ['RANK']}" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""

"""Training that goes non-finite, injected 4 ways under 5 guard settings: no checkpoint ever written
holds nan/inf weights or optimizer state, a finite checkpoint is always left to resume from, and a
guarded run never steps on a non-finite gradient (issue 14, point 2). In process: nothing here
needs a crash. Its figures: poisoned checkpoints written, finite checkpoint kept after a NaN."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from figures import FIGURES
from fitforge import Estimator
from fitforge.checkpoint.files import CheckpointError, load_checkpoint
from fitforge.checkpoint.finite import non_finite_checkpoint, non_finite_state
from fitforge.events import BatchEnd, EpochEnd
from fitforge.handlers import CheckpointHandler, NaNGuardHandler
from fitforge.handlers.nan_guard import NonFiniteLossError
from fitforge.testing import linear_data
from helpers import NanGradient

AT = 11  # the 0-based global step the fault comes at (epoch 2, batch 4 of 8)
FAULTS = ("nan loss", "inf loss", "nan gradient", "nan parameter")
GUARDS = {
    "no guard": None,
    "stop": ("stop", True),
    "stop, not fused": ("stop", False),
    "skip": ("skip", True),
    "raise": ("raise", True),
}


class Faulty(nn.Module):
    """A 1-8-1 MLP that goes wrong at training forward call ``at``: its output times nan or inf (the
    loss is not finite), or a nan gradient under a finite loss."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
        self.fault, self.calls = fault, 0

    def forward(self, x):
        y = self.body(x)
        if self.training:
            if self.calls >= AT and self.fault in ("nan loss", "inf loss"):
                y = y * (math.nan if self.fault == "nan loss" else math.inf)
            elif self.calls == AT and self.fault == "nan gradient":
                y = NanGradient.apply(y)
            self.calls += 1
        return y


class Injector(BatchEnd):
    """ "nan parameter": a nan written into a weight after the step of global step ``AT``."""

    priority = -1500  # after the optimizer step, before the checkpoint's save

    def batch_end(self, state) -> None:
        if state.global_step == AT:
            with torch.no_grad():
                state.estimator.net.body[0].weight[0, 0] = math.nan


class Audit(BatchEnd, EpochEnd):
    """Loads every checkpoint file the run writes, right after it is written (priority 950: after
    CheckpointHandler's hooks), and counts those holding non-finite values."""

    priority = 950

    def __init__(self, folder) -> None:
        self.folder, self.seen, self.poisoned = folder, set(), []

    def batch_end(self, state) -> None:
        self._inspect()

    def epoch_end(self, state) -> None:
        self._inspect()

    def _inspect(self) -> None:
        for path in self.folder.glob("model-*.pt"):
            stamp = (path.name, path.stat().st_mtime_ns, path.stat().st_size)
            if stamp not in self.seen:
                self.seen.add(stamp)
                if non_finite_checkpoint(load_checkpoint(path)):
                    self.poisoned.append(path.name)


def run(fault: str, guard: str, folder) -> dict:
    torch.manual_seed(0)
    net = Faulty(fault)
    policy = GUARDS[guard]
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01, fused=True if policy and policy[1] else None)
    estimator = Estimator(net, nn.MSELoss(), optimizer=optimizer, device="cpu")
    audit = Audit(folder)
    handlers = [CheckpointHandler(folder, batch_period=1, max_checkpoints=2), audit]
    handlers += [Injector()] if fault == "nan parameter" else []
    handlers += [NaNGuardHandler(policy[0])] if policy else []
    raised = None
    try:
        estimator.fit(linear_data(n=64, batch_size=8), epochs=4, event_handlers=handlers)
    except NonFiniteLossError as error:
        raised = error
    audit._inspect()
    finite_left = []
    for path in folder.glob("model-epoch*.pt"):
        try:
            if not non_finite_checkpoint(load_checkpoint(path)):
                finite_left.append(path.name)
        except CheckpointError:
            pass
    return {
        "poisoned": audit.poisoned,
        "finite_left": finite_left,
        "raised": raised,
        "weights_finite": not non_finite_state(estimator),
    }


CASES = [(fault, guard) for fault in FAULTS for guard in GUARDS]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    results = {case: run(*case, tmp_path_factory.mktemp("nonfinite")) for case in CASES}
    FIGURES["poisoned"] = sum(len(outcome["poisoned"]) for outcome in results.values())
    FIGURES["finite_kept"] = all(outcome["finite_left"] for outcome in results.values())
    return results


@pytest.mark.parametrize("fault, guard", CASES)
def test_no_poisoned_checkpoint_and_a_finite_one_is_kept(outcomes, fault, guard):
    outcome = outcomes[(fault, guard)]
    assert outcome["poisoned"] == []
    assert outcome["finite_left"]  # something to resume from
    assert (outcome["raised"] is not None) == (guard == "raise")
    if guard != "no guard" and fault != "nan parameter":
        # A guarded run never steps on a non-finite gradient: the weights stay finite.
        assert outcome["weights_finite"]

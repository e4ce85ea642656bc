"""CheckpointHandler when training goes non-finite: no checkpoint holds nan/inf weights or optimizer
state, the newest finite one is never rotated away, save_non_finite keeps the bad state apart, and
resume passes over a non-finite file (issue 14, point 2)."""

import logging
import math

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.checkpoint.files import load_checkpoint, save_checkpoint
from fitforge.checkpoint.finite import non_finite_checkpoint, non_finite_state
from fitforge.events import BatchEnd
from fitforge.handlers import CheckpointHandler
from fitforge.testing import linear_problem
from helpers import checkpoint_files


class Poison(BatchEnd):
    """After the optimizer step of global step ``at`` (0-based), put a nan in the weight (or, with
    ``optimizer=True``, in the optimizer's momentum buffer): from then on the state is not finite."""

    priority = -1500  # after GradientUpdateHandler's step, before CheckpointHandler's save

    def __init__(self, at: int, optimizer: bool = False) -> None:
        self.at, self.optimizer = at, optimizer

    def batch_end(self, state) -> None:
        if state.global_step == self.at:
            estimator = state.estimator
            with torch.no_grad():
                if self.optimizer:
                    next(iter(estimator.optimizer.state.values()))["momentum_buffer"][0] = math.nan
                else:
                    estimator.net.weight[0, 0] = math.nan


def names(folder):
    return checkpoint_files(folder)


def poisoned_files(folder):
    return [p.name for p in folder.glob("*.pt") if non_finite_checkpoint(load_checkpoint(p))]


@pytest.mark.parametrize("optimizer", [False, True], ids=["weights", "optimizer state"])
def test_no_checkpoint_holds_a_non_finite_state_and_the_newest_finite_one_stays(tmp_path, optimizer, caplog):
    estimator, train, _ = linear_problem()
    estimator.optimizers = [torch.optim.SGD(estimator.net.parameters(), lr=0.1, momentum=0.9)]
    saver = CheckpointHandler(tmp_path, batch_period=1, max_checkpoints=2)
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        estimator.fit(train, epochs=2, event_handlers=[saver, Poison(at=4, optimizer=optimizer)])
    # Before: 12 more saves of the nan state rotated batches 3 and 4 away (and wrote epoch2batch16).
    assert names(tmp_path) == ["model-epoch0batch3.pt", "model-epoch0batch4.pt"] and poisoned_files(tmp_path) == []
    warnings = [r.getMessage() for r in caplog.records if "not saving" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(
        "CheckpointHandler: not saving model-epoch0batch5.pt: nan/inf in "
    )
    assert ("optimizer 0: weight momentum_buffer" if optimizer else "weight") in warnings[0]
    assert "training diverged" in warnings[0] and "The newest checkpoint stays model-epoch0batch4.pt" in warnings[0]
    assert "12 saves were not written" in caplog.text  # the rest: one line when training ends, not one per save


def test_save_non_finite_keeps_the_bad_state_apart_and_resume_never_picks_it(tmp_path):
    estimator, train, _ = linear_problem()
    saver = CheckpointHandler(tmp_path, batch_period=1, max_checkpoints=2, save_non_finite=True)
    estimator.fit(train, batches=8, event_handlers=[saver, Poison(at=4)])
    assert names(tmp_path) == ["model-epoch0batch3.pt", "model-epoch0batch4.pt", "model-nonfinite.pt"]
    kept = load_checkpoint(tmp_path / "model-nonfinite.pt")
    assert kept["global_step"] == 5 and "weight" in kept["non_finite"] and math.isnan(kept["model"]["weight"][0, 0])
    estimator, train, _ = linear_problem()
    resumer = CheckpointHandler(tmp_path, batch_period=1, max_checkpoints=2, resume_from_checkpoint=True)
    history = estimator.fit(train, batches=6, event_handlers=[resumer])
    assert history.stop_reason == "reached batches=6" and non_finite_state(estimator) == []


def test_the_best_checkpoint_is_never_a_non_finite_state(tmp_path):
    from fitforge.handlers import ValidationHandler

    estimator, train, val = linear_problem()
    scores = iter([3.0, 2.0, 1.0])  # a monitored value that improves every epoch while the weights go nan
    validator = ValidationHandler(val, eval_fn=lambda data, event_handlers: {"val_loss": next(scores)})
    saver = CheckpointHandler(tmp_path, monitor="val_loss", save_best=True, epoch_period=None)
    estimator.fit(train, epochs=3, event_handlers=[validator, saver, Poison(at=9)])
    assert names(tmp_path) == ["model-best.pt"] and poisoned_files(tmp_path) == []
    assert load_checkpoint(tmp_path / "model-best.pt")["best"]["epoch"] == 0 and saver.best == 3.0


def test_resume_passes_over_a_non_finite_checkpoint(tmp_path, caplog):
    estimator, train, _ = linear_problem()
    estimator.fit(train, batches=4, event_handlers=[CheckpointHandler(tmp_path, batch_period=2)])
    bad = load_checkpoint(tmp_path / "model-epoch0batch4.pt")  # as an older fitforge could have written
    bad["model"]["weight"].fill_(math.inf)
    save_checkpoint(bad, tmp_path / "model-epoch0batch6.pt")
    estimator, train, _ = linear_problem()
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        estimator.fit(
            train, batches=5, event_handlers=[CheckpointHandler(tmp_path, batch_period=2, resume_from_checkpoint=True)]
        )
    assert (
        "skipping checkpoint model-epoch0batch6.pt: its weights or optimizer state hold nan/inf (weight)" in caplog.text
    )
    assert non_finite_state(estimator) == []


class CausalMask(nn.Module):
    """A linear layer with a buffer that holds -inf on purpose, as an attention mask does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1)
        self.register_buffer("mask", torch.full((2, 2), -math.inf).triu(1))

    def forward(self, x):
        return self.linear(x)


def test_an_inf_buffer_is_meant_and_saved_a_nan_in_one_is_not(tmp_path, caplog):
    torch.manual_seed(0)
    net = CausalMask()
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    _, train, _ = linear_problem()
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    assert names(tmp_path) == ["model-epoch1batch8.pt"]  # the -inf mask is no reason to refuse
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True)])
    with torch.no_grad():
        net.mask[0, 0] = math.nan  # as a nan batch leaves BatchNorm's statistics
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path / "other")])
    assert (
        names(tmp_path / "other") == [] and "nan/inf in mask; a batch with nan/inf reached the forward" in caplog.text
    )

"""Declared state access: the guard (fit(check_access=True)), writers before readers, write/write
conflicts, cycles, describe_loop, and every built-in handler's declaration holding in a real fit."""

import pytest
import torch

from fitforge.events import BatchEnd, EpochEnd, TrainBegin
from fitforge.exceptions import FitforgeTypeError, HandlerOrderError, StateAccessError
from fitforge.handlers import (
    CheckpointHandler,
    EarlyStoppingHandler,
    ProgressBarHandler,
    ValidationHandler,
)
from fitforge.testing import linear_problem
from helpers import make_estimator, regression_batches


class Probe(BatchEnd):
    """Runs ``action(state)`` at batch_end with the given declarations."""

    def __init__(self, action, reads=None, writes=None, priority=0):
        self.action, self.priority = action, priority
        if reads is not None:
            self.reads = reads
        if writes is not None:
            self.writes = writes

    def batch_end(self, state):
        self.action(state)
        return True  # one batch is enough

    def __repr__(self):
        return "Probe"


def fit_with(*handlers, check_access=True):
    return make_estimator().fit(
        regression_batches(), epochs=1, event_handlers=list(handlers), check_access=check_access
    )


@pytest.mark.parametrize(
    "action, message",
    [
        (
            lambda s: s.epoch,
            "Probe tried to read state.epoch, which its reads does not declare; add 'epoch' to Probe.reads",
        ),
        (
            lambda s: setattr(s, "global_step", 3),
            "Probe tried to write state.global_step, which its writes does not declare",
        ),
        (lambda s: s.history.record("x", 1.0), "Probe tried to write state.history"),
        (lambda s: s.metrics.update(x=1.0), "Probe tried to write state.metrics"),
        (lambda s: setattr(s.history, "stop_reason", "x"), "Probe tried to write state.history"),
        (lambda s: s.run.stop("why"), "Probe tried to write state.run"),
        (lambda s: setattr(s.run, "stop_requested", True), "Probe tried to write state.run"),
        (lambda s: s.shared.get("other"), "Probe tried to read state.shared.other"),
        (lambda s: s.shared.__setitem__("mine", 2), "Probe tried to write state.shared.mine"),
    ],
)
def test_an_undeclared_read_or_write_raises_naming_the_handler_and_the_field(action, message):
    probe = Probe(action, reads=("history", "metrics", "shared.mine", "run"))
    with pytest.raises((StateAccessError, AttributeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        fit_with(probe)


def test_declared_access_is_allowed_and_undeclared_handlers_keep_full_access():
    seen = {}

    def declared(state):
        state.shared["mine"] = state.epoch
        state.history.record("probe", 1.0)
        seen["declared"] = state.shared["mine"]

    def undeclared(state):
        seen["undeclared"] = (state.epoch, state.global_step, state.shared.get("mine"))

    history = fit_with(
        Probe(declared, reads=("epoch",), writes=("shared.mine", "history")), Probe(undeclared, priority=5)
    )
    assert seen == {"declared": 0, "undeclared": (0, 0, 0)} and history["probe"] == [1.0]


def test_without_check_access_the_declarations_only_order_the_handlers():
    probe = Probe(lambda s: s.epoch, reads=("history",))
    fit_with(probe, check_access=False)  # no guard: the read is not checked


class Writer(TrainBegin, BatchEnd):
    writes = ("shared.lr",)

    def __init__(self, log):
        self.log = log

    def train_begin(self, state):
        pass

    def batch_end(self, state):
        self.log.append("writer")
        state.shared["lr"] = 0.1


class Reader(BatchEnd):
    reads = ("shared.lr",)  # listed first below, so it would run first: reading a value not yet written

    def __init__(self, log):
        self.log = log

    def batch_end(self, state):
        self.log.append(("reader", state.shared.get("lr")))


def test_a_writer_runs_before_the_readers_of_its_field_at_one_priority():
    log = []
    fit_with(Reader(log), Writer(log), StopAfterOne())
    assert log == ["writer", ("reader", 0.1)]
    text = make_estimator().describe_loop([Reader(log), Writer(log)], default_handlers=False)
    assert "Writer(user) -> Reader(user)" in text
    assert "  Writer: reads -; writes shared.lr" in text and "  Reader: reads shared.lr; writes -" in text


class StopAfterOne(BatchEnd):
    def batch_end(self, state):
        return True


def test_two_writers_of_a_field_without_an_order_are_an_error_naming_both_and_the_fix():
    class Other(Writer):
        pass

    with pytest.raises(HandlerOrderError) as error:
        fit_with(Writer([]), Other([]))
    assert str(error.value) == (
        "Writer and Other both write 'shared.lr' at the same priority (0) with no order between them, so which value "
        "wins is left to the order you listed them in; give one a different priority, or set run_after=(Writer,) on "
        "Other"
    )
    Other.run_after = (Writer,)
    fit_with(Writer([]), Other([]), StopAfterOne())  # ordered: fine


def test_a_reader_that_must_run_before_its_writer_is_a_cycle_naming_them():
    class EarlyReader(Reader):
        pass

    class LateWriter(Writer):
        run_after = (EarlyReader,)

    with pytest.raises(HandlerOrderError, match="cycle through run_after: .*LateWriter.* runs after .*EarlyReader"):
        fit_with(EarlyReader([]), LateWriter([]))


@pytest.mark.parametrize(
    "reads, message",
    [
        ("epoch", r"Probe.reads must be a tuple of TrainState field names, e.g. \('epoch', 'shared.lr'\), got 'epoch'"),
        (("epochs",), r"Probe.reads names 'epochs', which is no TrainState field; use one of \["),
    ],
)
def test_a_bad_declaration_is_a_clear_error(reads, message):
    with pytest.raises(FitforgeTypeError, match=message):
        fit_with(Probe(lambda s: None, reads=reads))


def test_check_access_must_be_a_bool():
    with pytest.raises(FitforgeTypeError, match="fit: check_access must be True or False, got"):
        fit_with(check_access=1)


class NoiseReader(EpochEnd):
    reads = ("epoch", "metrics", "history")

    def epoch_end(self, state):
        assert state.metrics["train_loss"] == state.history["train_loss"][state.epoch]


def test_every_built_in_handler_keeps_to_its_declaration_in_a_real_fit(tmp_path):
    torch.manual_seed(0)
    estimator, train, val = linear_problem()
    handlers = [
        CheckpointHandler(tmp_path, batch_period=3, monitor="val_loss", save_best=True),
        EarlyStoppingHandler("val_loss", restore_best=True, patience=1),
        ValidationHandler(val, batch_period=5),
        ProgressBarHandler(refresh_seconds=0),
        NoiseReader(),
    ]
    estimator.fit(train, epochs=2, event_handlers=handlers, check_access=True)
    estimator, train, val = linear_problem()
    resumed = CheckpointHandler(tmp_path, batch_period=3, resume_from_checkpoint=True)
    history = estimator.fit(train, val_data=val, epochs=3, event_handlers=[resumed], check_access=True)
    assert len(history["train_loss"]) == 3
    described = estimator.describe_loop([resumed])
    checkpoint_line = next(line for line in described.splitlines() if line.startswith("  CheckpointHandler: reads "))
    # The resume happens after train_begin, not through the state; a guard asked before a save
    # (SpikeGuardHandler) may drop an open accumulation group.
    assert checkpoint_line.endswith("; writes accumulated_batches")
    assert all(": full access" not in line for line in described.splitlines())  # all built-ins declare


def test_the_docs_example_orders_and_guards_as_described():
    class ScaleLR(EpochEnd):
        writes = ("shared.lr_factor",)

        def epoch_end(self, state):
            state.shared["lr_factor"] = 0.5 if state.epoch >= 2 else 1.0

    class ApplyLR(EpochEnd):
        reads = ("shared.lr_factor", "estimator")

        def epoch_end(self, state):
            state.shared.get("lr_factor", 1.0)

    text = make_estimator().describe_loop([ApplyLR(), ScaleLR()], default_handlers=False)
    assert "ScaleLR(user) -> ApplyLR(user)" in text
    with pytest.raises(
        StateAccessError,
        match="ScaleLR tried to read state.epoch, which its reads does not declare; add 'epoch' to ScaleLR.reads",
    ):
        make_estimator().fit(regression_batches(), epochs=1, event_handlers=[ScaleLR()], check_access=True)


def test_a_priority_you_set_is_kept_and_commuting_or_same_class_writers_need_no_order():
    import torch

    from fitforge.handlers import EarlyStoppingHandler, LRSchedulerHandler, MetricHandler, throttle

    class ClipFirst(BatchEnd, EpochEnd):  # must run before the optimizer step; reads history at epoch end
        priority = -3000
        reads = ("estimator", "history")

        def batch_end(self, state):
            pass

        def epoch_end(self, state):
            pass

    class MyStop(EpochEnd):  # writes stop_requested at EarlyStopping's priority: the first reason wins
        writes = ("run",)

        def epoch_end(self, state):
            pass

    estimator = make_estimator()
    steps = [
        LRSchedulerHandler(torch.optim.lr_scheduler.StepLR(estimator.optimizer, 2)),
        LRSchedulerHandler(torch.optim.lr_scheduler.ExponentialLR(estimator.optimizer, 0.9)),
    ]
    text = estimator.describe_loop(
        [
            ClipFirst(),
            MyStop(),
            EarlyStoppingHandler("train_loss"),
            *steps,
            throttle(MetricHandler(), every_n_epochs=1),
        ],
        val_data=regression_batches(),
    )
    assert text.splitlines()[4].startswith("batch_end    ClipFirst(guard) -> GradientUpdateHandler(step)")


def test_the_guard_shows_a_handler_only_the_shared_keys_it_declares():
    seen = {}

    def look(state):
        seen["keys"], seen["len"] = sorted(state.shared), len(state.shared)

    fit_with(Probe(lambda s: s.shared.update(mine=1, other=2)), Probe(look, reads=("shared.mine",), priority=5))
    assert seen == {"keys": ["mine"], "len": 1}

"""The event-order contract of fit / evaluate / predict, stopping, cancelling and counting."""

import logging
import re
from typing import ClassVar

import pytest
import torch
from torch import nn

from fitforge import BatchProcessor
from fitforge.events import BatchBegin, BatchEnd, Ending, EpochBegin, TrainBegin
from fitforge.exceptions import CancelBatch, CancelEpoch, CancelFit, FitforgeValueError, RetryBatch
from fitforge.handlers import ValidationHandler
from fitforge.testing import RecordingHandler
from helpers import make_estimator, regression_batches


def batch_events(n, phase="train"):
    return ["batch_begin", "batch_end"] * n


def test_fit_with_validation_event_order():
    rec, val_rec = RecordingHandler(), RecordingHandler()
    val_rec.calls = rec.calls  # one timeline for fit and the validation it triggers
    est = make_estimator()
    est.fit(
        regression_batches(2),
        epochs=2,
        event_handlers=[rec, ValidationHandler(regression_batches(1), event_handlers=[val_rec])],
    )
    validation = [
        ("epoch_begin", "validate"),
        ("batch_begin", "validate"),
        ("batch_end", "validate"),
        ("epoch_end", "validate"),
    ]
    epoch = [("epoch_begin", "train")] + [(e, "train") for e in batch_events(2)] + validation + [("epoch_end", "train")]
    expected = [("train_begin", "train")] + epoch * 2 + [("train_end", "train")]
    assert [(c[0], c[1]) for c in rec.calls] == expected


def test_fit_counters_at_each_event():
    rec = RecordingHandler()
    make_estimator().fit(regression_batches(2), epochs=2, event_handlers=[rec])
    # (event, phase, epoch, batch_idx, global_step)
    assert rec.calls[0] == ("train_begin", "train", 0, -1, 0)
    assert rec.calls[1:7] == [
        ("epoch_begin", "train", 0, -1, 0),
        ("batch_begin", "train", 0, 0, 0),
        ("batch_end", "train", 0, 0, 0),
        ("batch_begin", "train", 0, 1, 1),
        ("batch_end", "train", 0, 1, 1),
        ("epoch_end", "train", 0, 1, 2),
    ]
    assert rec.calls[7][:3] == ("epoch_begin", "train", 1)
    assert rec.calls[-1] == ("train_end", "train", 1, 1, 4)


def test_evaluate_event_order():
    rec = RecordingHandler()
    result = make_estimator().evaluate(regression_batches(2), event_handlers=[rec])
    assert rec.events == ["epoch_begin", *batch_events(2), "epoch_end"]
    assert {c[1] for c in rec.calls} == {"validate"}
    assert set(result) == {"val_loss", "val_mae"}


def test_predict_event_order():
    rec = RecordingHandler()
    out = make_estimator().predict(regression_batches(3), event_handlers=[rec])
    assert rec.events == ["epoch_begin", *batch_events(3), "epoch_end"]
    assert {c[1] for c in rec.calls} == {"predict"}
    assert out.shape == (12, 1)


def test_stop_by_returning_true_finishes_the_batch_then_epoch_end_and_train_end():
    stopper = RecordingHandler(stop_on=("batch_end", 5))
    later = RecordingHandler(priority=500)
    est = make_estimator()
    history = est.fit(regression_batches(4), epochs=5, event_handlers=[stopper, later])
    # global_step 5 is epoch 1, batch 1: the later handler still sees that batch_end.
    assert later.calls[-3:] == [
        ("batch_end", "train", 1, 1, 5),
        ("epoch_end", "train", 1, 1, 6),
        ("train_end", "train", 1, 1, 6),
    ]
    assert history.epochs == 2
    assert "RecordingHandler.batch_end returned True" in history.stop_reason


def test_stop_by_returning_true_from_epoch_end():
    rec = RecordingHandler(stop_on=("epoch_end", 2))
    history = make_estimator().fit(regression_batches(2), epochs=5, event_handlers=[rec])
    assert rec.events[-2:] == ["epoch_end", "train_end"] and history.epochs == 1


class StopAt(BatchBegin):
    def __init__(self, step):
        self.step = step

    def batch_begin(self, state):
        if state.global_step == self.step:
            state.run.stop("enough")


def test_request_stop_at_batch_begin_still_completes_that_batch():
    rec = RecordingHandler()
    history = make_estimator().fit(regression_batches(4), epochs=5, event_handlers=[StopAt(5), rec])
    assert rec.calls[-4:] == [
        ("batch_begin", "train", 1, 1, 5),
        ("batch_end", "train", 1, 1, 5),
        ("epoch_end", "train", 1, 1, 6),
        ("train_end", "train", 1, 1, 6),
    ]
    assert history.stop_reason == "enough"


class Outcome(Exception):
    """How the run ended, raised by fit after a stop with an ending."""


class EndAt(BatchEnd):
    def __init__(self, step, *stops):
        self.step, self.stops = step, stops  # (reason, ending or None), requested in turn

    def batch_end(self, state):
        if state.global_step == self.step:
            for reason, ending in self.stops:
                state.run.stop(reason, ending=ending)


def test_a_stop_with_an_ending_ends_training_cleanly_then_raises_its_error(caplog):
    caplog.set_level(logging.INFO, logger="fitforge")
    rec, est, first = RecordingHandler(priority=500), make_estimator(), Outcome("first")
    ender = EndAt(5, ("plain", None), ("ended", Ending("Ended", first)), ("later", Ending("Later", Outcome())))
    with pytest.raises(Outcome) as raised:
        est.fit(regression_batches(4), epochs=5, event_handlers=[ender, rec])
    assert raised.value is first  # the first ending holds, and its reason replaced the plain stop's
    assert rec.calls[-3:] == [
        ("batch_end", "train", 1, 1, 5),
        ("epoch_end", "train", 1, 1, 6),
        ("train_end", "train", 1, 1, 6),
    ]
    assert est.history.epochs == 2 and est.history.stop_reason == "ended"
    assert caplog.messages[-1].startswith("Ended in epoch 2/5 at batch 2 of 4 (2 epochs, 6 batches in ")
    assert re.match(
        r"ended\. Goodput \d+%( \(most lost: [a-z ]+, \d+%\))?\. Final: train_loss=",
        caplog.messages[-1].split("): ", 1)[1],
    )


def test_request_stop_in_train_begin_or_epoch_begin_runs_no_batch():
    class StopIn(TrainBegin, EpochBegin):
        def __init__(self, where):
            self.where = where

        def train_begin(self, state):
            if self.where == "train_begin":
                state.run.stop("no")

        def epoch_begin(self, state):
            if self.where == "epoch_begin":
                state.run.stop("no")

    rec = RecordingHandler()
    make_estimator().fit(regression_batches(2), epochs=3, event_handlers=[StopIn("train_begin"), rec])
    assert rec.events == ["train_begin", "train_end"]
    rec = RecordingHandler()
    make_estimator().fit(regression_batches(2), epochs=3, event_handlers=[StopIn("epoch_begin"), rec])
    assert rec.events == ["train_begin", "epoch_begin", "epoch_end", "train_end"]


class Raise(BatchBegin, BatchEnd):
    """Raises ``exc`` at ``event`` of the batch at position ``at`` = (epoch, batch_idx)."""

    def __init__(self, exc, at, event="batch_begin", priority=0):
        self.exc, self.at, self.event, self.priority = exc, at, event, priority

    def _maybe(self, state, event):
        if event == self.event and (state.epoch, state.batch_idx) == self.at:
            raise self.exc

    def batch_begin(self, state):
        self._maybe(state, "batch_begin")

    def batch_end(self, state):
        self._maybe(state, "batch_end")


def test_cancel_batch_skips_rest_of_batch_without_step_and_does_not_count():
    rec = RecordingHandler()
    est = make_estimator()
    history = est.fit(regression_batches(3), batches=3, event_handlers=[Raise(CancelBatch(), (0, 1), priority=1), rec])
    # The cancelled batch (epoch 0, batch 1) has a batch_begin but no batch_end; batches=3 needs a 2nd epoch.
    assert rec.calls[1:8] == [
        ("epoch_begin", "train", 0, -1, 0),
        ("batch_begin", "train", 0, 0, 0),
        ("batch_end", "train", 0, 0, 0),
        ("batch_begin", "train", 0, 1, 1),
        ("batch_begin", "train", 0, 2, 1),
        ("batch_end", "train", 0, 2, 1),
        ("epoch_end", "train", 0, 2, 2),
    ]
    assert rec.calls[-1] == ("train_end", "train", 1, 0, 3) and history.epochs == 2


def test_a_retried_batch_leaves_the_epoch_s_position_where_it_was():
    class Again:
        """Data that yields its second batch again after a retry (as a fault-tolerant step's)."""

        def __init__(self, batches):
            self.batches, self.retried = batches, False

        def __iter__(self):
            position = 0
            while position < len(self.batches):
                read, self.retried = position, False
                yield self.batches[read]
                position = read if self.retried else read + 1

    class RetryOnce(BatchEnd):
        priority = -3000  # before the step
        done = False

        def batch_end(self, state):
            if state.batch_idx == 1 and not self.done:
                self.done = data.retried = True
                raise RetryBatch

    rec = RecordingHandler()
    data = Again(regression_batches(3))
    est = make_estimator()
    before = [p.detach().clone() for p in est.net.parameters()]
    est.fit(data, epochs=1, event_handlers=[RetryOnce(), rec])
    begins = [(batch, step) for event, _, _, batch, step in rec.calls if event == "batch_begin"]
    assert begins == [(0, 0), (1, 1), (1, 1), (2, 2)]  # the retry reads position 1 again
    assert rec.calls[-2] == ("epoch_end", "train", 0, 2, 3)
    assert not all(p.equal(b) for p, b in zip(est.net.parameters(), before))


def test_cancel_batch_before_step_leaves_weights_unchanged():
    class CancelAll(BatchEnd):
        priority = -3000  # before GradientUpdateHandler, after backward

        def batch_end(self, state):
            assert state.estimator.net.weight.grad is not None
            raise CancelBatch

    est = make_estimator()
    before = [p.detach().clone() for p in est.net.parameters()]
    est.fit(regression_batches(3), epochs=1, event_handlers=[CancelAll()])
    assert all(p.equal(b) for p, b in zip(est.net.parameters(), before))
    assert all(p.grad is None for p in est.net.parameters())  # gradients it made are cleared


def test_cancel_batch_from_batch_processor_after_backward_clears_gradients():
    class Skip(BatchProcessor):
        def fit_batch(self, state, batch):
            super().fit_batch(state, batch)
            raise CancelBatch

    est = make_estimator(batch_processor=Skip())
    before = est.net.weight.detach().clone()
    est.fit(regression_batches(2), epochs=1)
    assert est.net.weight.grad is None and est.net.weight.detach().equal(before)


def test_cancel_epoch_ends_epoch_and_runs_its_epoch_end():
    rec = RecordingHandler()
    history = make_estimator().fit(
        regression_batches(3), epochs=2, event_handlers=[Raise(CancelEpoch(), (0, 1), priority=1), rec]
    )
    assert rec.events == [
        "train_begin",
        "epoch_begin",
        "batch_begin",
        "batch_end",
        "batch_begin",
        "epoch_end",
        "epoch_begin",
        *batch_events(3),
        "epoch_end",
        "train_end",
    ]
    assert history.epochs == 2


def test_cancel_fit_ends_training_with_train_end_but_no_epoch_end():
    rec = RecordingHandler()
    history = make_estimator().fit(
        regression_batches(3), epochs=3, event_handlers=[Raise(CancelFit(), (1, 1), event="batch_end", priority=5), rec]
    )
    assert rec.events[-3:] == ["batch_begin", "batch_end", "train_end"]
    assert history.epochs == 2


@pytest.mark.parametrize("hook", ["train_begin", "epoch_begin", "epoch_end", "train_end"])
@pytest.mark.parametrize("signal", [CancelBatch, CancelEpoch, CancelFit])
def test_no_cancel_escapes_fit_whatever_the_event(hook, signal):
    handler, witness = RecordingHandler(), RecordingHandler(priority=100)
    setattr(handler, hook, lambda state: (_ for _ in ()).throw(signal()))
    make_estimator().fit(regression_batches(2), epochs=2, event_handlers=[handler, witness])
    assert witness.events[0] == "train_begin" and witness.events[-1] == "train_end"
    if hook == "train_begin":  # every train_begin ran, then training ended
        assert witness.events == ["train_begin", "train_end"]


def test_exception_mid_epoch_runs_train_end_and_propagates_unchanged():
    error = ValueError("boom")
    rec = RecordingHandler(priority=-5000)
    with pytest.raises(ValueError) as caught:
        make_estimator().fit(regression_batches(3), epochs=2, event_handlers=[Raise(error, (0, 1)), rec])
    assert caught.value is error
    assert rec.events[-2:] == ["batch_begin", "train_end"]


def test_failing_train_end_during_an_exception_is_logged_and_original_propagates(caplog):
    class BadEnd(RecordingHandler):
        def train_end(self, state):
            raise RuntimeError("train_end broke")

    later = RecordingHandler(priority=100)
    with caplog.at_level(logging.ERROR, logger="fitforge"), pytest.raises(ValueError, match="boom"):
        make_estimator().fit(
            regression_batches(2), epochs=1, event_handlers=[Raise(ValueError("boom"), (0, 0)), BadEnd(), later]
        )
    assert "BadEnd.train_end failed while training was ending" in caplog.text
    assert later.events[-1] == "train_end"  # the hooks after the failing one still ran


def test_failing_train_end_after_normal_training_raises_after_every_train_end_ran(caplog):
    class BadEnd(RecordingHandler):
        def __init__(self, message, priority):
            super().__init__(priority=priority)
            self.message = message

        def train_end(self, state):
            raise RuntimeError(self.message)

    later = RecordingHandler(priority=100)
    with caplog.at_level(logging.ERROR, logger="fitforge"), pytest.raises(RuntimeError, match="first broke"):
        make_estimator().fit(
            regression_batches(2),
            epochs=1,
            event_handlers=[BadEnd("first broke", 0), BadEnd("second broke", 50), later],
        )
    assert later.events[-1] == "train_end"
    assert "second broke" in caplog.text  # the first failure is raised, later ones logged


def test_batches_counts_across_epochs_with_partial_last_epoch():
    rec = RecordingHandler()
    history = make_estimator().fit(regression_batches(2), batches=5, event_handlers=[rec])
    assert rec.events.count("batch_end") == 5
    assert history.epochs == 3 and rec.calls[-1] == ("train_end", "train", 2, 0, 5)
    assert history.stop_reason == "reached batches=5"


def test_cancelling_every_batch_with_batches_n_stops_instead_of_looping(caplog):
    class CancelAll(BatchBegin):
        def batch_begin(self, state):
            raise CancelBatch

    history = make_estimator().fit(regression_batches(2), batches=3, event_handlers=[CancelAll()])
    assert history.stop_reason == "epoch 0 completed no batch"
    assert "epoch 0 completed no batch (every batch, or the epoch, was cancelled)" in caplog.text


def test_one_shot_iterator_with_batches_is_refused_before_training():
    with pytest.raises(FitforgeValueError, match=r"one-shot iterator \(list_iterator\).*read more than once"):
        make_estimator().fit(iter(regression_batches(2)), batches=5)


def test_iterable_yielding_no_batch_is_a_clear_error():
    class Empty:
        def __iter__(self):
            return iter(())

    with pytest.raises(FitforgeValueError, match=r"^train_data yielded no batch \(train, epoch 0\): it is empty"):
        make_estimator().fit(Empty(), epochs=2)
    with pytest.raises(FitforgeValueError, match=r"^val_data yielded no batch \(validate, epoch 0\)"):
        make_estimator().evaluate(Empty())


def test_one_shot_iterator_is_fine_for_one_epoch():
    history = make_estimator().fit((b for b in regression_batches(3)), epochs=1)
    assert history.epochs == 1


def test_epoch_time_and_lr_recorded_every_epoch():
    history = make_estimator().fit(regression_batches(2), epochs=3)
    assert len(history["epoch_time"]) == 3 and all(t >= 0 for t in history["epoch_time"])
    assert history["lr"] == [0.1, 0.1, 0.1]


def test_metrics_reach_the_host_only_at_epoch_end():
    """Built-in handlers make no host read per batch: count .item()/float()/bool() on tensors."""
    reads = []
    original = torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.tolist

    def counting(fn):
        def wrapper(self, *args):
            reads.append(fn.__name__)
            return fn(self, *args)

        return wrapper

    est = make_estimator()
    for n_batches in (4, 16):
        reads.clear()
        torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.tolist = map(counting, original)
        try:
            est.fit(regression_batches(n_batches), val_data=regression_batches(n_batches), epochs=2)
        finally:
            torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.tolist = original
        if n_batches == 4:
            few = len(reads)
    assert len(reads) == few > 0  # independent of the number of batches


def test_host_reads_do_not_grow_with_batches_by_the_profiler_count():
    """The same invariant counted where every host read ends: aten::_local_scalar_dense (item, float, bool),
    with default handlers, validation and a progress bar."""
    from torch.profiler import ProfilerActivity, profile

    from fitforge.handlers import ProgressBarHandler

    counts = []
    for n_batches in (4, 24):
        est = make_estimator()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            est.fit(
                regression_batches(n_batches),
                val_data=regression_batches(n_batches),
                epochs=2,
                event_handlers=[ProgressBarHandler(refresh_seconds=3600)],
            )
        counts.append(sum(event.name == "aten::_local_scalar_dense" for event in prof.events()))
    assert counts[0] == counts[1] > 0


def test_cancel_epoch_before_the_step_leaves_no_gradient_for_the_next_epoch():
    class CancelFirstEpoch(BatchEnd):
        priority = -3000  # after backward, before the optimizer step

        def batch_end(self, state):
            if state.epoch == 0:
                raise CancelEpoch

    class GradAtStep(BatchEnd):
        priority = -2500
        grads: ClassVar[list] = []

        def batch_end(self, state):
            GradAtStep.grads.append(state.estimator.net.weight.grad.clone())

    est = make_estimator()
    x, y = regression_batches(1)[0]
    nn.MSELoss()(est.net(x), y).backward()  # the gradient of one batch at the initial weights
    expected = est.net.weight.grad.clone()
    est.net.zero_grad(set_to_none=True)
    est.fit(regression_batches(1), epochs=2, event_handlers=[CancelFirstEpoch(), GradAtStep()])
    # Epoch 0 was cancelled before its step, so epoch 1 starts from the initial weights and must see
    # exactly one batch's gradient, not two accumulated.
    assert len(GradAtStep.grads) == 1 and torch.allclose(GradAtStep.grads[0], expected)


@pytest.mark.parametrize("entry", ["evaluate", "predict"])
def test_cancel_fit_does_not_escape_evaluate_or_predict(entry):
    class Stop(BatchBegin):
        def batch_begin(self, state):
            if state.batch_idx == 1:
                raise CancelFit("enough")

    est = make_estimator()
    result = getattr(est, entry)(regression_batches(3), event_handlers=[Stop()])
    if entry == "evaluate":  # the pass ended like CancelEpoch: values over the batches seen
        assert set(result) == {"val_loss", "val_mae"}
    else:
        assert result.shape == (4, 1)


def test_stop_requested_then_batch_cancelled_still_stops():
    class StopThenCancel(BatchEnd):
        def batch_end(self, state):
            if state.global_step == 1:
                state.run.stop("stop")
                raise CancelBatch

    rec = RecordingHandler(priority=-5000)
    history = make_estimator().fit(regression_batches(5), epochs=1, event_handlers=[StopThenCancel(), rec])
    assert rec.events.count("batch_begin") == 2 and history.stop_reason == "stop"


def test_custom_processor_raising_cancel_epoch_after_backward_clears_gradients():
    class Once(BatchProcessor):
        def fit_batch(self, state, batch):
            out = super().fit_batch(state, batch)
            if state.epoch == 0:
                raise CancelEpoch
            return out

    est = make_estimator(batch_processor=Once())
    est.fit(regression_batches(1), epochs=1)
    assert est.net.weight.grad is None


def test_predict_handlers_see_the_batch_size():
    sizes = []

    class Sizes(BatchEnd):
        def batch_end(self, state):
            sizes.append(state.output.batch_size)

    make_estimator().predict([torch.zeros(3, 1), torch.zeros(2, 1)], event_handlers=[Sizes()])
    assert sizes == [3, 2]


def test_the_loop_reads_like_its_pseudocode_no_function_over_40_lines():
    import ast
    import inspect

    import fitforge.core.loop

    tree = ast.parse(inspect.getsource(fitforge.core.loop))
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert lengths and max(lengths.values()) <= 40, lengths

"""The closing line of a fit and History.restored_epoch: the summary matches the weights the net
holds, and a failed run says where it failed and what was raised, never "Finished"."""

import logging
import math

import pytest
import torch
from torch import nn

from fitforge import History
from fitforge.handlers import CheckpointHandler, EarlyStoppingHandler, LambdaHandler, ValidationHandler
from fitforge.reporting import closing
from fitforge.reporting.closing import raised
from helpers import make_estimator, regression_batches

VAL = regression_batches(2, seed=1)


def worse_from(epoch):
    """From epoch ``epoch`` (0-based) on, a learning rate that overshoots: val_loss grows again."""

    def hook(state):
        if state.epoch >= epoch:
            for group in state.estimator.optimizer.param_groups:
                group["lr"] = 1.2

    return LambdaHandler(epoch_begin=hook)


def stopper():
    return EarlyStoppingHandler("val_loss", patience=2, restore_best=True)


def messages(caplog):
    return [record.getMessage() for record in caplog.records]


def test_the_restored_epoch_is_the_one_evaluate_agrees_with(caplog):
    estimator, handlers = make_estimator(), [worse_from(4), stopper()]
    with caplog.at_level(logging.INFO, logger="fitforge"):
        history = estimator.fit(regression_batches(), val_data=VAL, epochs=20, event_handlers=handlers)
    best = min(range(history.epochs), key=lambda i: history["val_loss"][i]) + 1
    assert history.restored_epoch == best == 4 and history.epochs == 6 and estimator.history.restored_epoch == 4
    result = estimator.evaluate(VAL)
    for key in ("val_loss", "val_mae"):
        assert result[key] == pytest.approx(history[key][best - 1], rel=1e-6)
        assert result[key] != pytest.approx(history[key][-1], rel=1e-3)  # the last epoch's are other weights
    closing = messages(caplog)[-1]
    assert closing.startswith("Finished: 6 epochs, 18 batches in ")
    assert "Final:" not in closing and closing.endswith(
        f"Restored epoch 4: train_loss={history['train_loss'][3]:#.4g} train_mae={history['train_mae'][3]:#.4g} "
        f"val_loss={result['val_loss']:#.4g} val_mae={result['val_mae']:#.4g}"
    )


def test_the_restored_epoch_is_numbered_across_fits_and_cleared_by_training_on(caplog):
    estimator = make_estimator()
    estimator.fit(regression_batches(), epochs=3)
    with caplog.at_level(logging.INFO, logger="fitforge"):
        second = estimator.fit(regression_batches(), val_data=VAL, epochs=20, event_handlers=[worse_from(1), stopper()])
    restored = second.restored_epoch  # counted in the fit's own History
    assert restored is not None and estimator.history.restored_epoch == 3 + restored
    assert f"Restored epoch {3 + restored}: " in messages(caplog)[-1]  # as the epoch lines number it
    assert estimator.history["val_loss"][3 + restored - 1] == pytest.approx(estimator.evaluate(VAL)["val_loss"])
    third = estimator.fit(regression_batches(), epochs=1)
    assert third.restored_epoch is None and estimator.history.restored_epoch is None  # the weights moved on


def test_no_restore_when_the_last_epoch_is_the_best(caplog):
    estimator = make_estimator()
    with caplog.at_level(logging.INFO, logger="fitforge"):
        history = estimator.fit(regression_batches(), val_data=VAL, epochs=3, event_handlers=[stopper()])
    assert history.restored_epoch is None and " Final: train_loss=" in messages(caplog)[-1]


def test_the_restored_epoch_survives_a_checkpoint_and_resume(tmp_path):
    first = make_estimator()
    handlers = [worse_from(4), stopper(), CheckpointHandler(tmp_path, resume_from_checkpoint=True)]
    history = first.fit(regression_batches(), val_data=VAL, epochs=20, event_handlers=handlers)
    again = make_estimator()  # a new process: the run had stopped, so it only restores the best weights
    handlers = [worse_from(4), stopper(), CheckpointHandler(tmp_path, resume_from_checkpoint=True)]
    resumed = again.fit(regression_batches(), val_data=VAL, epochs=20, event_handlers=handlers)
    assert resumed.epochs == history.epochs and resumed.restored_epoch == history.restored_epoch == 4
    assert again.evaluate(VAL) == pytest.approx(first.evaluate(VAL))


def test_history_keeps_the_restored_epoch_through_state_dict_and_extend():
    history = History()
    for _ in range(3):
        history.new_epoch()
        history.record("val_loss", 1.0)
    history.restored_epoch = 2
    copy = History()
    copy.load_state_dict(history.state_dict())
    assert copy.restored_epoch == 2
    old = history.state_dict()
    del old["restored_epoch"]  # a checkpoint written before restored_epoch existed
    copy.load_state_dict(old)
    assert copy.restored_epoch is None
    copy.load_state_dict({**history.state_dict(), "restored_epoch": 7})  # past the rows: no such epoch
    assert copy.restored_epoch is None

    joined = History()
    joined.new_epoch()
    joined.extend(history)
    assert joined.restored_epoch == 3  # renumbered among the joined rows
    joined.extend(History())  # a fit that trained no epoch leaves the weights as they were
    assert joined.restored_epoch == 3
    joined.new_epoch()
    assert joined.restored_epoch is None


class Boom(RuntimeError):
    pass


def failing(at, message="boom"):
    """Raise in batch_begin of global batch ``at`` (0-based): that batch has no optimizer step."""

    def hook(state):
        if state.global_step == at:
            raise Boom(message)

    return LambdaHandler(batch_begin=hook)


def fit_failing(caplog, handlers, error=Boom, epochs=3, **kwargs):
    with caplog.at_level(logging.INFO, logger="fitforge"), pytest.raises(error):
        make_estimator(**kwargs).fit(regression_batches(4), epochs=epochs, event_handlers=handlers)
    assert not any(line.startswith("Finished") for line in messages(caplog))
    return caplog.records[-1]


def test_a_run_failing_mid_epoch_says_where_and_what(caplog):
    record = fit_failing(caplog, [failing(5)])
    assert record.levelno == logging.INFO  # the handler's level, as the line it stands for
    assert record.getMessage().startswith(
        "Failed in epoch 2/3 at batch 2 of 4 (5 batches completed, 5 optimizer steps taken, "
    )
    assert record.getMessage().endswith("s): Boom: boom")


def test_a_run_failing_on_its_first_batch_says_so(caplog):
    net = nn.Linear(3, 1)  # the data has one feature
    record = fit_failing(caplog, [], error=Exception, net=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    text = record.getMessage()
    assert text.startswith("Failed in epoch 1/3 at batch 1 of 4 (0 batches completed, 0 optimizer steps taken, ")
    assert "Error: " in text and len(text) < 400


def test_where_a_run_fails_outside_its_batches(caplog):
    def fail(state):
        raise Boom("in a hook")

    before = fit_failing(caplog, [LambdaHandler(train_begin=fail)]).getMessage()
    assert before.startswith("Failed before epoch 1/3 (0 batches completed")
    caplog.clear()
    start = fit_failing(caplog, [LambdaHandler(epoch_begin=fail)]).getMessage()
    assert start.startswith("Failed at the start of epoch 1/3 (0 batches") and start.endswith("Boom: in a hook")
    caplog.clear()
    validation = ValidationHandler(VAL, eval_fn=lambda data, event_handlers: fail(None))
    text = fit_failing(caplog, [validation], epochs=2).getMessage()
    assert text.startswith("Failed at the end of epoch 1/2 (4 batches completed, 4 optimizer steps taken")


def test_an_interrupt_is_no_failure_but_is_said(caplog):
    def interrupt(state):
        if state.global_step == 2:
            raise KeyboardInterrupt

    record = fit_failing(caplog, [LambdaHandler(batch_begin=interrupt)], error=KeyboardInterrupt)
    assert record.getMessage().startswith("Interrupted in epoch 1/3 at batch 3 of 4 (2 batches")
    assert record.getMessage().endswith("s): KeyboardInterrupt")


def test_the_exception_is_shortened():
    assert raised(ValueError("x" * 500)) == "ValueError: " + "x" * 198 + " …"
    assert raised(ValueError("first line\nsecond line")) == "ValueError: first line …"
    assert raised(ValueError()) == "ValueError"
    assert raised(ValueError(math.pi)).startswith("ValueError: 3.14159")


def test_a_train_end_hook_failing_after_training_is_no_finished_run(caplog):
    def final_save(state):
        raise OSError("disk full")

    record = fit_failing(caplog, [LambdaHandler(train_end=final_save)], error=OSError, epochs=2)
    line = record.getMessage()
    assert line.startswith("Failed at the end of training (8 batches completed") and "OSError: disk full" in line


def test_after_a_resume_it_says_what_this_fit_trained_and_where_the_run_stands(tmp_path, caplog):
    class Crash(LambdaHandler):
        def __init__(self):
            super().__init__(batch_end=self.crash)

        def crash(self, state):
            if state.global_step == 5:
                raise RuntimeError("crash")

    def handlers():
        return [CheckpointHandler(tmp_path, batch_period=1, resume_from_checkpoint=True)]

    with pytest.raises(RuntimeError, match="crash"):
        make_estimator().fit(regression_batches(), epochs=3, event_handlers=[*handlers(), Crash()])
    with caplog.at_level(logging.INFO, logger="fitforge"):
        make_estimator().fit(regression_batches(), epochs=3, event_handlers=handlers())
    closing = messages(caplog)[-1]
    # the crash came after batch 5 was saved (1 epoch of 3 batches and 2 more): 4 of the 9 batches were left
    assert closing.startswith("Finished: 4 batches in ")
    assert (
        "s, resumed after 1 epoch, 5 batches; the run stands at 3 epochs, 9 batches (reached epochs=3). Goodput "
        in closing
    )


def test_a_fault_tolerant_run_counts_its_replica_groups_changes():
    history = History()
    for epoch, row in enumerate(
        (
            {"ft_groups": 3, "ft_lost": 1, "ft_joined": 0, "ft_failed_steps": 2},
            {"ft_groups": 3, "ft_lost": 0, "ft_joined": 1, "ft_failed_steps": 0},
        )
    ):
        history.open_epoch(epoch)
        for key, value in row.items():
            history.record(key, value)
    assert closing._replica_groups(history) == " Replica groups: 3 at the end; 1 lost, 1 joined, 2 failed steps."
    assert closing._replica_groups(History()) == ""

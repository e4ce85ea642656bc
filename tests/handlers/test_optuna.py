"""OptunaPruningHandler: a study over SQLite whose pruned trials end cleanly (their epoch lines
logged, a closing line saying "Pruned", recorded as PRUNED), the values reported equal to the
History's, train_end and checkpoints intact after a prune, validation every n batches reported
by batches, and the errors. The 2-rank run is in tests/distributed/test_optuna_ranks.py."""

import logging
import re
import sys

import optuna
import pytest
import torch

from fitforge.checkpoint.files import load_checkpoint
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, MonitorKeyError
from fitforge.handlers import CheckpointHandler, LambdaHandler, OptunaPruningHandler, ValidationHandler
from fitforge.testing import HostReadCounter, linear_data, linear_problem
from helpers import make_estimator, regression_batches

EPOCHS = 6
TRAIN, VAL = regression_batches(3, 8, seed=1), regression_batches(1, 16, seed=2)


class ScriptedTrial:
    """A stand-in for ``optuna.Trial`` that prunes at the steps given, and records the reports."""

    number = 7

    def __init__(self, prune_at=()):
        self.prune_at, self.reports = set(prune_at), []

    def report(self, value, step):
        self.reports.append((step, value))

    def should_prune(self):
        return self.reports[-1][0] in self.prune_at


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger="fitforge")
    return caplog


def closing(messages):
    return next(m for m in messages if m.startswith(("Finished", "Pruned", "Failed")))


def epoch_lines(messages):
    return [m for m in messages if m.startswith("[Epoch ")]


def test_a_study_over_sqlite_records_pruned_trials_as_pruned_with_their_lines(tmp_path, lines):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    logged, histories = {}, {}

    def objective(trial):
        torch.manual_seed(0)
        lr = trial.suggest_float("lr", 1e-4, 0.5, log=True)
        estimator = make_estimator(optimizer="sgd")
        estimator.optimizer.param_groups[0]["lr"] = lr
        lines.clear()
        try:
            history = estimator.fit(TRAIN, val_data=VAL, epochs=EPOCHS, event_handlers=[OptunaPruningHandler(trial)])
            return history["val_loss"][-1]
        finally:
            logged[trial.number], histories[trial.number] = list(lines.messages), estimator.history

    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1)
    study = optuna.create_study(
        study_name="fit", storage=storage, sampler=optuna.samplers.RandomSampler(seed=0), pruner=pruner
    )
    study.optimize(objective, n_trials=10)

    trials = optuna.load_study(study_name="fit", storage=storage).trials  # as the SQLite file holds them
    states = {t.number: t.state for t in trials}
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    assert len(trials) == 10 and set(states.values()) == {
        optuna.trial.TrialState.PRUNED,
        optuna.trial.TrialState.COMPLETE,
    }, states
    for trial in trials:
        messages, history = logged[trial.number], histories[trial.number]
        steps = sorted(trial.intermediate_values)
        assert steps == list(range(history.epochs))  # one report per epoch, numbered from 0
        assert [trial.intermediate_values[s] for s in steps] == history["val_loss"]  # the values the History holds
        assert len(epoch_lines(messages)) == history.epochs  # the pruned epoch's own line too
        assert not any(m.startswith("Failed") for m in messages)
        if trial in pruned:
            assert history.epochs < EPOCHS
            assert re.match(
                rf"Pruned at the end of epoch {history.epochs}/{EPOCHS} \({history.epochs} epochs, "
                rf"{3 * history.epochs} batches in [\d.]+s\): Optuna pruned trial {trial.number} at step "
                rf"{history.epochs - 1} \(val_loss=",
                closing(messages),
            ), closing(messages)
            assert history.stop_reason.startswith(f"Optuna pruned trial {trial.number}")
        else:
            assert history.epochs == EPOCHS and closing(messages).startswith("Finished: 6 epochs")


def test_after_a_prune_train_end_ran_and_the_checkpoints_are_intact(tmp_path, lines):
    estimator, trial, ended = make_estimator(), ScriptedTrial(prune_at={2}), []
    handlers = [
        OptunaPruningHandler(trial),
        CheckpointHandler(tmp_path, max_checkpoints=10),
        LambdaHandler(train_end=lambda state: ended.append((state.epoch, state.run.error))),
    ]
    with pytest.raises(optuna.TrialPruned, match="Optuna pruned trial 7 at step 2"):
        estimator.fit(TRAIN, val_data=VAL, epochs=EPOCHS, event_handlers=handlers, check_access=True)
    assert ended == [(2, None)]  # train_end ran, for a run that no error ended
    files = sorted(p.name for p in tmp_path.glob("model-epoch*.pt"))
    assert files == ["model-epoch1batch3.pt", "model-epoch2batch6.pt", "model-epoch3batch9.pt"]
    last = load_checkpoint(tmp_path / files[-1])
    for name, tensor in estimator.net.state_dict().items():  # the pruned epoch's weights were saved
        assert torch.equal(last["model"][name], tensor)
    history = estimator.history
    assert trial.reports == [(epoch, value) for epoch, value in enumerate(history["val_loss"])]
    assert len(epoch_lines(lines.messages)) == 3
    assert closing(lines.messages).startswith("Pruned at the end of epoch 3/6 (3 epochs, 9 batches in ")


def test_a_trial_that_is_not_pruned_completes_normally(lines):
    trial = ScriptedTrial()
    history = make_estimator().fit(TRAIN, val_data=VAL, epochs=3, event_handlers=[OptunaPruningHandler(trial)])
    assert history.epochs == 3 and history.stop_reason == "reached epochs=3"
    assert trial.reports == list(enumerate(history["val_loss"]))
    assert closing(lines.messages).startswith("Finished: 3 epochs, 9 batches")


def test_validation_every_n_batches_is_reported_by_batches_and_pruned_at_that_batch(lines):
    trial = ScriptedTrial(prune_at={4})
    handlers = [ValidationHandler(VAL, batch_period=2, epoch_period=None), OptunaPruningHandler(trial)]
    estimator = make_estimator()
    with pytest.raises(optuna.TrialPruned):
        estimator.fit(TRAIN, epochs=EPOCHS, event_handlers=handlers)
    assert [step for step, _ in trial.reports] == [2, 4]  # the batches completed at each validation
    assert trial.reports[-1][1] == estimator.history["val_loss"][-1]
    assert estimator.history.epochs == 2  # stopped at the 4th batch: the 1st of the 2nd epoch
    assert epoch_lines(lines.messages)[-1].startswith("[Epoch 2/6, partial: 1 of 3 batches]")
    assert closing(lines.messages).startswith("Pruned in epoch 2/6 at batch 1 of 3 (2 epochs, 4 batches in ")


@pytest.mark.parametrize("batch_period", [None, 4], ids=["by epochs", "by validations every 4 batches"])
def test_the_handler_adds_no_host_read(batch_period):
    def reads(*pruning):
        estimator, _, val = linear_problem()
        validation = ValidationHandler(val, batch_period=batch_period, epoch_period=None if batch_period else 1)
        with HostReadCounter() as counter:
            estimator.fit(linear_data(n=64, batch_size=4), epochs=2, event_handlers=[validation, *pruning])
        return counter.count

    trial = ScriptedTrial()
    assert reads(OptunaPruningHandler(trial)) == reads() > 0  # the values it reports are on the host already
    assert len(trial.reports) == (8 if batch_period else 2)


def test_an_epoch_without_a_value_reports_nothing():
    trial = ScriptedTrial()
    handlers = [ValidationHandler(VAL, epoch_period=2), OptunaPruningHandler(trial)]
    history = make_estimator().fit(TRAIN, epochs=4, event_handlers=handlers)
    assert trial.reports == [(1, history["val_loss"][1]), (3, history["val_loss"][3])]


def test_a_monitored_key_the_run_will_not_produce_fails_at_fit_start():
    trial = ScriptedTrial()
    with pytest.raises(MonitorKeyError, match=r"monitors 'val_los'.*Did you mean 'val_loss'"):
        make_estimator().fit(TRAIN, val_data=VAL, epochs=2, event_handlers=[OptunaPruningHandler(trial, "val_los")])
    assert trial.reports == []


def test_without_optuna_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(ImportError, match=r'pip install "fitforge\[optuna\]"'):
        OptunaPruningHandler(ScriptedTrial())


def test_a_bad_trial_is_an_error_naming_what_to_pass():
    with pytest.raises(FitforgeTypeError, match="trial must be an optuna.Trial .* got str"):
        OptunaPruningHandler("trial")
    with pytest.raises(FitforgeValueError, match="trial is None on rank 0"):
        make_estimator().fit(TRAIN, val_data=VAL, epochs=1, event_handlers=[OptunaPruningHandler(None)])


def test_a_study_of_several_objectives_cannot_prune():
    trial = optuna.create_study(directions=["minimize", "maximize"]).ask()
    with pytest.raises(FitforgeValueError, match="2 objectives"):
        make_estimator().fit(TRAIN, val_data=VAL, epochs=1, event_handlers=[OptunaPruningHandler(trial)])


def test_a_study_going_the_other_way_than_the_key_is_warned_about(caplog):
    trial = optuna.create_study(direction="maximize").ask()
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        make_estimator().fit(TRAIN, val_data=VAL, epochs=1, event_handlers=[OptunaPruningHandler(trial)])
    assert any("monitors val_loss, which is better lower" in m and "maximizes" in m for m in caplog.messages)

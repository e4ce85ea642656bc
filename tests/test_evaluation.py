"""Evaluation: set up once (data, dispatcher, step), run as often as asked; the first pass checks
its first batch unless the check before training did."""

import logging

import pytest

import fitforge.checks.first_batch
import fitforge.evaluation as evaluation_module
from fitforge import BatchProcessor
from fitforge.core.dispatch import Dispatcher
from fitforge.evaluation import Evaluation
from fitforge.exceptions import BatchFormatError, FitforgeTypeError, FitforgeValueError
from fitforge.handlers import LoggingHandler, ValidationHandler
from helpers import make_estimator, regression_batches


def counting(monkeypatch, name, module=evaluation_module):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def first_batch_checks(monkeypatch):
    """The evaluation passes whose first batch went through the check (its step, errors explained)."""
    calls = []
    real = fitforge.checks.first_batch.explained_step

    def counted(state, step, batch):
        calls.extend([1] if state.phase == "validate" else [])
        return real(state, step, batch)

    monkeypatch.setattr(fitforge.checks.first_batch, "explained_step", counted)
    return calls


def test_an_evaluation_runs_again_with_the_same_set_up_and_checks_its_first_pass_only(monkeypatch):
    checks = first_batch_checks(monkeypatch)
    estimator = make_estimator()
    run = estimator.evaluation(regression_batches())
    first, second = run(), run()
    assert first == second == estimator.evaluate(regression_batches())
    assert set(first) == {"val_loss", "val_mae"} and len(checks) == 2  # the first pass, then evaluate's own
    assert isinstance(run, Evaluation) and isinstance(run.dispatcher, Dispatcher)


def test_a_checked_evaluation_skips_the_first_batch_check(monkeypatch):
    checks = first_batch_checks(monkeypatch)
    estimator = make_estimator()
    assert estimator.evaluation(regression_batches(), checked=True)() == estimator.evaluate(regression_batches())
    assert len(checks) == 1  # evaluate's only


@pytest.mark.parametrize("check_first, checks_in_fit", [(True, 0), (False, 1)])
def test_a_fit_validates_through_one_evaluation_checked_before_training(monkeypatch, check_first, checks_in_fit):
    built, checks = counting(monkeypatch, "Dispatcher"), first_batch_checks(monkeypatch)
    estimator = make_estimator()
    validation = ValidationHandler(regression_batches(), check_first=check_first)
    history = estimator.fit(regression_batches(), epochs=3, event_handlers=[validation])
    assert len(history["val_loss"]) == 3 and validation.checked_first is check_first
    assert len(built) == 1 and len(checks) == checks_in_fit  # one set-up for 3 validations
    assert history["val_loss"][-1] == pytest.approx(estimator.evaluate(regression_batches())["val_loss"])


def test_an_unchecked_first_pass_still_names_a_bad_batch():
    estimator = make_estimator()
    with pytest.raises(BatchFormatError, match="pair of tensors"):
        estimator.evaluation([(1, 2)])()
    unchecked = ValidationHandler([(1, 2)], check_first=False)
    with pytest.raises(BatchFormatError, match="pair of tensors"):  # at the first validation, by its first pass
        estimator.fit(regression_batches(), epochs=1, event_handlers=[unchecked])


class LogsSpread(BatchProcessor):
    """A step that also logs a named value (``<prefix>_spread``)."""

    def evaluate_batch(self, state, batch):
        out = super().evaluate_batch(state, batch)
        state.log("spread", out.pred.std())
        return out


def test_evaluate_names_its_keys_by_prefix(caplog):
    estimator = make_estimator(train_metrics=["mae", "rmse"], batch_processor=LogsSpread())
    val = estimator.evaluate(regression_batches())
    with caplog.at_level(logging.INFO, logger="fitforge"):
        test = estimator.evaluate(regression_batches(), event_handlers=[LoggingHandler()], prefix="test")
    assert list(val) == ["val_loss", "val_mae", "val_rmse", "val_spread"]
    assert test == {key.replace("val_", "test_"): value for key, value in val.items()}
    assert "[Test] test_loss=" in caplog.text
    assert estimator.evaluate(regression_batches(), prefix="holdout_2").keys() >= {"holdout_2_loss", "holdout_2_mae"}


def test_the_validation_in_fit_keeps_val_after_a_test_evaluation():
    estimator = make_estimator()
    estimator.evaluate(regression_batches(), prefix="test")
    history = estimator.fit(regression_batches(), val_data=regression_batches(1), epochs=1)
    assert {"val_loss", "val_mae"} <= set(history) and not any(key.startswith("test_") for key in history)
    assert set(estimator.evaluate(regression_batches(), prefix="val")) == {"val_loss", "val_mae"}


@pytest.mark.parametrize(
    ("prefix", "error", "message"),
    [
        ("", FitforgeValueError, "prefix must be a non-empty name .* got ''"),
        ("test_", FitforgeValueError, "got 'test_'; the '_' is added: pass 'test'"),
        ("my test", FitforgeValueError, "got 'my test'"),
        ("2nd", FitforgeValueError, "starts with a letter"),
        ("_test", FitforgeValueError, "got '_test'$"),  # no hint: '_test' is no better
        ("tést_", FitforgeValueError, "got 'tést_'$"),
        (None, FitforgeTypeError, "prefix must be a str such as 'val' or 'test', got None"),
        (b"test", FitforgeTypeError, "got bytes"),
    ],
)
def test_a_bad_prefix_is_refused_before_any_batch(prefix, error, message):
    estimator = make_estimator()
    with pytest.raises(error, match=f"^evaluate: .*{message}"):
        estimator.evaluate([(1, 2)], prefix=prefix)  # bad data too: the prefix is checked first


def test_the_check_before_training_runs_through_the_evaluation_it_stands_for(monkeypatch):
    import fitforge.checks.validation as validation_module

    seen = []
    real = validation_module.check_handlers
    monkeypatch.setattr(validation_module, "check_handlers", lambda state, hs: seen.append(hs) or real(state, hs))
    checks = first_batch_checks(monkeypatch)

    class Kept(ValidationHandler):
        def use_evaluation(self, evaluation, checked):
            self.kept = evaluation
            super().use_evaluation(evaluation, checked)

    estimator = make_estimator()
    validation = Kept(regression_batches())
    estimator.fit(regression_batches(), epochs=2, event_handlers=[validation])
    assert validation.checked_first and validation._evaluation is None  # handed to the fit, which used it
    assert seen == [validation.kept.services.first_batch_checks] and validation.kept.checked
    assert not checks  # the validation passes checked nothing again


def test_a_fit_checks_the_net_s_placement_once_for_training_and_validation(monkeypatch):
    import fitforge.checks.model

    checked = []
    real = fitforge.checks.model.check_devices
    monkeypatch.setattr(fitforge.checks.model, "check_devices", lambda *a: checked.append(a[2]) or real(*a))
    estimator = make_estimator()
    estimator.fit(regression_batches(), val_data=regression_batches(), epochs=1)
    assert checked == ["net"]  # val_net is net: fit checks it once and sets up its validation unchecked
    estimator.evaluation(regression_batches())
    assert checked == ["net", "val_net"]  # set up on its own, an evaluation checks


def test_an_estimator_overriding_evaluation_with_a_former_signature_still_validates():
    from torch import nn

    from fitforge import Estimator

    built = []

    class Mine(Estimator):
        def evaluation(self, val_data, event_handlers=None, checked=False):
            built.append(val_data)
            return super().evaluation(val_data, event_handlers, checked)

    estimator = Mine(nn.Linear(1, 1), nn.MSELoss(), optimizer="sgd", device="cpu")
    history = estimator.fit(regression_batches(), val_data=regression_batches(), epochs=1)
    assert "val_loss" in history and not built  # fit sets its validations up itself: no override in its way

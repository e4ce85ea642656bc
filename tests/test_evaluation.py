"""Evaluation: set up once (data, dispatcher, step), run as often as asked; the first pass checks
its first batch unless the check before training did."""

import logging

import pytest

import fitforge.evaluation as evaluation_module
from fitforge import BatchProcessor
from fitforge.core.dispatch import Dispatcher
from fitforge.evaluation import Evaluation
from fitforge.exceptions import BatchFormatError, FitforgeTypeError, FitforgeValueError
from fitforge.handlers import LoggingHandler, ValidationHandler
from helpers import make_estimator, regression_batches


def counting(monkeypatch, name):
    calls = []
    real = getattr(evaluation_module, name)
    monkeypatch.setattr(evaluation_module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_an_evaluation_runs_again_with_the_same_set_up_and_checks_its_first_pass_only(monkeypatch):
    checks = counting(monkeypatch, "check_first_batch_of")
    estimator = make_estimator()
    run = estimator.evaluation(regression_batches())
    first, second = run(), run()
    assert first == second == estimator.evaluate(regression_batches())
    assert set(first) == {"val_loss", "val_mae"} and len(checks) == 2  # the first pass, then evaluate's own
    assert isinstance(run, Evaluation) and isinstance(run.dispatcher, Dispatcher)


def test_a_checked_evaluation_skips_the_first_batch_check(monkeypatch):
    checks = counting(monkeypatch, "check_first_batch_of")
    estimator = make_estimator()
    assert estimator.evaluation(regression_batches(), checked=True)() == estimator.evaluate(regression_batches())
    assert len(checks) == 1  # evaluate's only


@pytest.mark.parametrize("check_first, checks_in_fit", [(True, 0), (False, 1)])
def test_a_fit_validates_through_one_evaluation_checked_before_training(monkeypatch, check_first, checks_in_fit):
    built, checks = counting(monkeypatch, "Dispatcher"), counting(monkeypatch, "check_first_batch_of")
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
    import fitforge.preflight as preflight_module

    def refuse(*args):
        raise AssertionError("the check built handlers of its own")

    monkeypatch.setattr(preflight_module, "evaluate_handlers", refuse)
    checks = counting(monkeypatch, "check_first_batch_of")
    estimator = make_estimator()
    run = estimator.evaluation(regression_batches())
    assert run.check_first() is True and run.checked
    assert run() == estimator.evaluation(regression_batches(), checked=True)() and not checks  # no second check
    validation = ValidationHandler(regression_batches())
    estimator.fit(regression_batches(), epochs=2, event_handlers=[validation])
    assert validation.checked_first and validation._evaluation is None  # handed to the fit, which used it


def test_a_fit_checks_the_net_s_placement_once_for_training_and_validation(monkeypatch):
    import fitforge.preflight

    checked = []
    real = fitforge.preflight.check_devices
    monkeypatch.setattr(fitforge.preflight, "check_devices", lambda *a: checked.append(a[2]) or real(*a))
    estimator = make_estimator()
    estimator.fit(regression_batches(), val_data=regression_batches(), epochs=1)
    assert checked == ["net"]  # val_net is net: fit checks it once and sets up its validation unchecked
    estimator.evaluation(regression_batches())
    assert checked == ["net", "val_net"]  # set up on its own, an evaluation checks


def test_an_estimator_overriding_evaluation_with_its_former_signature_still_validates():
    from torch import nn

    from fitforge import Estimator

    built = []

    class Mine(Estimator):
        def evaluation(self, val_data, event_handlers=None, checked=False):
            built.append(val_data)
            return super().evaluation(val_data, event_handlers, checked)

    estimator = Mine(nn.Linear(1, 1), nn.MSELoss(), optimizer="sgd", device="cpu")
    history = estimator.fit(regression_batches(), val_data=regression_batches(), epochs=1)
    assert len(built) == 1 and "val_loss" in history

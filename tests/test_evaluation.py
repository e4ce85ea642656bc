"""Evaluation: set up once (data, dispatcher, step), run as often as asked; the first pass checks
its first batch unless the check before training did."""

import pytest

import fitforge.evaluation as evaluation_module
from fitforge.core.dispatch import Dispatcher
from fitforge.evaluation import Evaluation
from fitforge.exceptions import BatchFormatError
from fitforge.handlers import ValidationHandler
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

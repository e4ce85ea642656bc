"""The plans of fit, evaluate and predict: each input judged once, in a fixed order."""

import pytest

import fitforge.plans.fit as pipeline
from fitforge.core.processes import ONE_PROCESS
from fitforge.exceptions import FitforgeValueError
from fitforge.handlers import StoppingHandler, ValidationHandler
from helpers import make_estimator, regression_batches


def test_a_validation_by_eval_fn_still_has_its_data_checked_before_training():
    def custom(val_data, event_handlers):
        return {"val_custom": float(sum(1 for _ in val_data))}

    one_shot = ValidationHandler(iter(regression_batches()), eval_fn=custom)
    with pytest.raises(FitforgeValueError, match="ValidationHandler val_data is a one-shot iterator"):
        make_estimator().fit(regression_batches(), epochs=2, event_handlers=[one_shot])
    with pytest.raises(FitforgeValueError, match="ValidationHandler val_data is empty"):
        make_estimator().fit(regression_batches(), epochs=1, event_handlers=[ValidationHandler([], eval_fn=custom)])
    history = make_estimator().fit(
        regression_batches(), epochs=1, event_handlers=[ValidationHandler(regression_batches(), eval_fn=custom)]
    )
    assert history["val_custom"] == [len(regression_batches())]


def test_stopping_limits_fold_in_before_the_validations_are_judged():
    # One epoch in all: a one-shot validation iterator is read once, so it is no error.
    handlers = [StoppingHandler(max_epochs=1), ValidationHandler(iter(regression_batches()))]
    history = make_estimator().fit(regression_batches(), epochs=3, event_handlers=handlers)
    assert history.epochs == 1 and "val_loss" in history


def test_an_unsized_val_data_is_checked_once(monkeypatch):
    judged = []
    real = pipeline.check_data
    monkeypatch.setattr(
        pipeline, "check_data", lambda data, name, passes: judged.append(name) or real(data, name, passes)
    )
    unsized = (batch for batch in regression_batches())
    make_estimator().fit(regression_batches(), val_data=unsized, epochs=1)
    assert judged == ["train_data", "val_data"]


def test_evaluate_and_predict_passes_ask_the_ranks_of_their_own_run():
    seen = []
    from fitforge.events import EpochEnd

    class Asks(EpochEnd):
        def epoch_end(self, state):
            seen.append(state.run.ranks)

    estimator = make_estimator()
    estimator.evaluate(regression_batches(), event_handlers=[Asks()])
    estimator.predict(regression_batches(), event_handlers=[Asks()])
    assert seen == [ONE_PROCESS, ONE_PROCESS]  # one process: a Collective under torch.distributed

"""MLflowHandler against a real local MLflow store (SQLite), read back with MlflowClient: params,
a metric point per epoch, written from a background thread while training goes on, the run's status
(FINISHED, FAILED, KILLED), the best checkpoint as an artifact, joining an active run, a resumed fit
continuing its run, and nothing on a rank other than 0. A SIGKILL: tests/reliability/test_tracker_kill9.py."""

import logging
import os
import signal
import sys
import threading

import pytest
import torch

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, LambdaHandler, MLflowHandler, ValidationHandler, throttle
from fitforge.reporting.hparams import run_params
from fitforge.testing import HostReadCounter, linear_data, linear_problem

mlflow = pytest.importorskip("mlflow", reason="MLflowHandler needs mlflow (pip install 'fitforge[mlflow]')")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:mlflow")  # its own use of sqlalchemy


def _no_fsync(connection, record):
    connection.execute("PRAGMA synchronous=OFF")


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One SQLite store for the module; each test uses its own experiment. Creating the store runs
    MLflow's schema migrations, a commit each: without fsync (a test's data need not survive a
    power cut) it takes a second or two instead of ten. MLflow's usage telemetry is off: no network."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    event.listen(Engine, "connect", _no_fsync)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        yield f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    event.remove(Engine, "connect", _no_fsync)


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch, uri):
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact folder (./mlruns) lands here
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)


def client(uri):
    return mlflow.MlflowClient(uri)


def fit(handlers, epochs=3, validate=True, **kwargs):
    torch.manual_seed(0)
    estimator, train, val = linear_problem()
    return estimator.fit(train, val_data=val if validate else None, epochs=epochs, event_handlers=handlers, **kwargs)


def runs_of(uri, experiment_name):
    experiment = client(uri).get_experiment_by_name(experiment_name)
    return [] if experiment is None else client(uri).search_runs([experiment.experiment_id])


def steps(uri, run_id, key):
    return [(m.step, m.value) for m in sorted(client(uri).get_metric_history(run_id, key), key=lambda m: m.step)]


def test_params_a_metric_per_epoch_and_finished(uri):
    seen = []
    tracker = MLflowHandler(uri, experiment_name="finished", run_name="first", params={"seed": 7, "lr": 0.5})
    probe = LambdaHandler(train_begin=lambda state: seen.append(run_params(state)))
    validation = ValidationHandler(linear_data(n=64, seed=1), epoch_period=2)
    history = fit([tracker, probe, validation], validate=False, check_access=True)
    run = client(uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    assert run.data.params == {key: str(value) for key, value in {**seen[0], "seed": 7, "lr": 0.5}.items()}
    assert run.data.params["model"] == "Linear" and run.data.params["epochs"] == "3"
    assert set(run.data.metrics) == set(history)
    for key in ("train_loss", "lr", "epoch_time"):
        assert steps(uri, tracker.run_id, key) == [(step, pytest.approx(history[key][step - 1])) for step in (1, 2, 3)]
    assert steps(uri, tracker.run_id, "val_loss") == [(2, pytest.approx(history["val_loss"][1]))]  # finite only
    assert [r.info.run_id for r in runs_of(uri, "finished")] == [tracker.run_id]


def test_a_tracking_error_is_a_warning_not_the_end_of_training(uri, monkeypatch, caplog):
    tracker = MLflowHandler(uri, experiment_name="blip", flush_secs=1000)  # the epochs' metrics written at the end
    calls = []

    def flaky(self, run_id, metrics=(), **kwargs):
        calls.append(len(metrics))
        if metrics:
            raise ConnectionError("server unreachable")
        return original(self, run_id, metrics=metrics, **kwargs)

    import mlflow

    original = mlflow.MlflowClient.log_batch
    monkeypatch.setattr(mlflow.MlflowClient, "log_batch", flaky)
    with caplog.at_level("WARNING", logger="fitforge"):
        history = fit([tracker], validate=False)
    assert history.epochs == 3 and calls == [0, 3 * len(history)]  # the params, then one batch of 3 epochs
    assert "the metrics of epoch(s) 1, 2, 3 were not logged (server unreachable); training goes on" in caplog.text
    assert steps(uri, tracker.run_id, "train_loss") == []
    assert client(uri).get_run(tracker.run_id).info.status == "FINISHED"


def test_an_exception_in_a_batch_fails_the_run(uri):
    def boom(state):
        if state.global_step == 10:  # in the second epoch
            raise RuntimeError("boom")

    tracker = MLflowHandler(uri, experiment_name="failed")
    with pytest.raises(RuntimeError, match="boom"):
        fit([tracker, LambdaHandler(batch_end=boom)])
    assert client(uri).get_run(tracker.run_id).info.status == "FAILED"
    assert [step for step, _ in steps(uri, tracker.run_id, "train_loss")] == [1]  # the completed epoch


def test_sigterm_kills_the_run_and_leaves_the_cut_epoch_to_the_resumed_run(uri):
    def terminate(state):
        if state.global_step == 10:
            os.kill(os.getpid(), signal.SIGTERM)

    tracker = MLflowHandler(uri, experiment_name="preempted")
    with pytest.raises(SystemExit) as exit_info:
        fit([tracker, LambdaHandler(batch_begin=terminate)])
    assert exit_info.value.code == 143
    assert client(uri).get_run(tracker.run_id).info.status == "KILLED"
    assert [step for step, _ in steps(uri, tracker.run_id, "train_loss")] == [1]


def test_a_keyboard_interrupt_kills_the_run(uri):
    def interrupt(state):
        raise KeyboardInterrupt

    tracker = MLflowHandler(uri, experiment_name="interrupted")
    with pytest.raises(KeyboardInterrupt):
        fit([tracker, LambdaHandler(epoch_end=interrupt, priority=2000)])
    assert client(uri).get_run(tracker.run_id).info.status == "KILLED"


def test_a_fit_inside_an_except_block_still_finishes(uri):
    tracker = MLflowHandler(uri, experiment_name="ambient")
    try:
        raise ValueError("handled by the caller, before fit")
    except ValueError:
        fit([tracker], epochs=1)
    assert client(uri).get_run(tracker.run_id).info.status == "FINISHED"


def test_the_best_checkpoint_as_an_artifact(uri, tmp_path):
    client(uri).create_experiment("best", artifact_location=(tmp_path / "artifacts").as_uri())
    saver = CheckpointHandler(tmp_path / "ckpt", monitor="val_loss", save_best=True, epoch_period=None)
    tracker = MLflowHandler(uri, experiment_name="best", log_best_checkpoint=True)
    fit([throttle(saver, every_n_epochs=1), tracker], epochs=2)
    listed = [a.path for a in client(uri).list_artifacts(tracker.run_id, "checkpoints")]
    assert listed == ["checkpoints/model-best.pt"]
    uploaded = tmp_path / "artifacts" / tracker.run_id / "artifacts" / "checkpoints" / "model-best.pt"
    assert uploaded.read_bytes() == (tmp_path / "ckpt" / "model-best.pt").read_bytes()


def test_no_best_checkpoint_saved_is_a_warning(uri, tmp_path, caplog):
    saver = CheckpointHandler(tmp_path / "ckpt", monitor="val_loss", save_best=True, epoch_period=None)
    remove = LambdaHandler(train_end=lambda state: saver.best_path.unlink())  # runs before the tracker
    tracker = MLflowHandler(uri, experiment_name="no best", log_best_checkpoint=True)
    fit([saver, tracker, remove], epochs=1)
    assert "no best checkpoint was saved in this fit; none uploaded" in caplog.text
    assert client(uri).list_artifacts(tracker.run_id) == []
    assert client(uri).get_run(tracker.run_id).info.status == "FINISHED"


def test_log_best_checkpoint_needs_a_best_saver(uri, tmp_path):
    tracker = MLflowHandler(uri, experiment_name="no saver", log_best_checkpoint=True)
    with pytest.raises(FitforgeValueError, match=r"needs a CheckpointHandler\(save_best=True, monitor=...\)"):
        fit([tracker, CheckpointHandler(tmp_path / "ckpt")])
    assert tracker.run_id is None and runs_of(uri, "no saver") == []


def test_an_active_run_is_joined_and_left_open(uri, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    experiment = client(uri).create_experiment("joined")
    with mlflow.start_run(experiment_id=experiment) as active:
        mlflow.log_param("lr", "0.5")  # the user's own value: kept
        mlflow.log_param("model", "Linear")  # the same value: no clash
        tracker = MLflowHandler(experiment_name="ignored when joining")
        fit([tracker], epochs=2)
        assert tracker.run_id == active.info.run_id
        run = client(uri).get_run(active.info.run_id)
        assert run.info.status == "RUNNING"  # its owner ends it
        assert run.data.params["lr"] == "0.5" and run.data.params["optimizer"] == "SGD"
        assert "the active run already has other values for lr; kept them" in caplog.text
        assert [step for step, _ in steps(uri, tracker.run_id, "train_loss")] == [1, 2]
    assert client(uri).get_run(active.info.run_id).info.status == "FINISHED"
    assert client(uri).get_experiment_by_name("ignored when joining") is None


def test_an_active_run_elsewhere_is_not_joined(uri, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a folder store: quicker to set up than a database
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "elsewhere").as_uri())
    with mlflow.start_run() as active:
        tracker = MLflowHandler(uri, experiment_name="elsewhere")
        fit([tracker], epochs=1)
    assert tracker.run_id != active.info.run_id
    assert client(uri).get_run(tracker.run_id).info.status == "FINISHED"


def test_experiment_from_the_environment_default_and_one_run_per_fit(uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from env")
    tracker = MLflowHandler(tags={"team": "vision"})
    fit([tracker], epochs=1)
    first = tracker.run_id
    fit([tracker], epochs=1)
    assert [r.info.run_id for r in runs_of(uri, "from env")] == [tracker.run_id, first]  # newest first
    assert client(uri).get_run(first).data.tags["team"] == "vision"
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    fit([tracker], epochs=1)
    assert client(uri).get_run(tracker.run_id).info.experiment_id == "0"  # MLflow's Default


def test_no_run_when_an_earlier_handler_fails_at_train_begin(uri):
    def fail(state):
        raise RuntimeError("not ready")

    tracker = MLflowHandler(uri, experiment_name="never started")
    with pytest.raises(RuntimeError, match="not ready"):
        fit([LambdaHandler(train_begin=fail, priority=-5000), tracker])
    assert tracker.run_id is None and runs_of(uri, "never started") == []


def test_nothing_is_logged_on_a_rank_other_than_0(uri, monkeypatch):
    monkeypatch.setattr("fitforge.distributed.ranks.rank", lambda: 1)
    tracker = MLflowHandler(uri, experiment_name="rank 1")
    fit([tracker], epochs=1)
    assert tracker.run_id is None and runs_of(uri, "rank 1") == []


def test_the_values_reach_the_store_while_training_goes_on(uri):
    tracker = MLflowHandler(uri, experiment_name="background", flush_secs=0.01)
    seen = []

    def wait_for_epoch_1(state):  # at epoch 1's end, after the tracker's epoch_end: the fit goes on after it
        if state.epoch == 0:
            for _ in range(6000):  # the thread writes within its interval; a minute before the test fails
                written = steps(uri, tracker.run_id, "train_loss")
                if written:
                    break
                threading.Event().wait(0.01)
            seen.append((written, client(uri).get_run(tracker.run_id).info.status))

    history = fit([tracker, LambdaHandler(epoch_end=wait_for_epoch_1, priority=2000)], epochs=2, validate=False)
    assert seen == [([(1, pytest.approx(history["train_loss"][0]))], "RUNNING")]
    assert [step for step, _ in steps(uri, tracker.run_id, "train_loss")] == [1, 2]


def resumed_fit(uri, tmp_path, epochs, experiment="resumed"):
    """The same script each time: resumes from the newest checkpoint, tracks in ``experiment``."""
    saver = CheckpointHandler(tmp_path / "ckpt", resume_from_checkpoint=True)
    tracker = MLflowHandler(uri, experiment_name=experiment)
    return tracker, fit([saver, tracker], epochs=epochs, validate=False)


def test_a_resumed_fit_continues_the_run(uri, tmp_path, caplog):
    first, _ = resumed_fit(uri, tmp_path, 2)
    second, history = resumed_fit(uri, tmp_path, 4)
    assert second.run_id == first.run_id and [r.info.run_id for r in runs_of(uri, "resumed")] == [first.run_id]
    assert steps(uri, first.run_id, "train_loss") == [
        (step, pytest.approx(history["train_loss"][step - 1])) for step in (1, 2, 3, 4)
    ]
    run = client(uri).get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.params["epochs"] == "2"  # MLflow keeps a param's first value
    assert "the resumed run already has other values for epochs; kept them" in caplog.text


def test_a_checkpoints_run_missing_from_the_store_starts_a_new_run(uri, tmp_path, caplog):
    first, _ = resumed_fit(uri, tmp_path, 1, experiment="deleted")
    client(uri).delete_run(first.run_id)
    second, _ = resumed_fit(uri, tmp_path, 2, experiment="deleted")
    assert second.run_id != first.run_id and f"cannot continue the checkpoint's run {first.run_id}" in caplog.text
    assert [step for step, _ in steps(uri, second.run_id, "train_loss")] == [2]
    assert client(uri).get_run(second.run_id).info.status == "FINISHED"


def test_no_host_read_per_batch_with_mlflow_and_tensorboard(uri, tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoardHandler needs tensorboard")
    from fitforge.handlers import TensorBoardHandler

    def reads(batches):
        estimator, _, val = linear_problem()
        trackers = [MLflowHandler(uri, experiment_name="reads"), TensorBoardHandler(tmp_path / str(batches))]
        with HostReadCounter() as counter:
            estimator.fit(linear_data(n=4 * batches, batch_size=4), val_data=val, epochs=1, event_handlers=trackers)
        return counter.count

    assert reads(8) == reads(64)


def test_an_evaluation_starts_no_run(uri):
    tracker = MLflowHandler(uri, experiment_name="evaluated")
    estimator, _, val = linear_problem()
    estimator.evaluate(val, event_handlers=[tracker])
    assert tracker.run_id is None and runs_of(uri, "evaluated") == []


def test_a_missing_mlflow_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"pip install 'fitforge\[mlflow\]'"):
        MLflowHandler()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"tracking_uri": 3}, FitforgeTypeError, r"tracking_uri must be a str or None, got int 3"),
        ({"experiment_name": ""}, FitforgeValueError, r"experiment_name must not be empty"),
        ({"run_name": ["a"]}, FitforgeTypeError, r"run_name must be a str or None, got list"),
        ({"params": {"a": [1]}}, FitforgeTypeError, r"params must map str keys to str, int, float or bool"),
        ({"tags": {"a": 1}}, FitforgeTypeError, r"tags must be a dict of str to str, got dict"),
        ({"log_best_checkpoint": "yes"}, FitforgeTypeError, r"log_best_checkpoint must be True or False"),
        ({"flush_secs": 0}, FitforgeValueError, r"MLflowHandler: flush_secs must be a positive number of seconds"),
    ],
)
def test_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        MLflowHandler(**kwargs)


def test_repr():
    assert repr(MLflowHandler("sqlite:///x.db", experiment_name="e")) == (
        "MLflowHandler('sqlite:///x.db', experiment_name='e')"
    )


@pytest.fixture(autouse=True)
def _quiet_mlflow():
    logging.getLogger("mlflow").setLevel(logging.WARNING)

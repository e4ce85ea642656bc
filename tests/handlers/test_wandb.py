"""WandbHandler in W&B's offline mode (no account, no network), read back from the offline run's
transaction log (tests/wandb_offline.py): the config, a row per epoch, the run's end (finished, failed,
preempted), a resumed fit continuing the run id, joining an active run, no host read per batch with all
three trackers on. A W&B run starts W&B's service process: those tests are marked integration. A
SIGKILL and a resume in another process: tests/reliability/test_tracker_kill9.py."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, LambdaHandler, ValidationHandler, WandbHandler
from fitforge.reporting.hparams import run_params
from fitforge.testing import HostReadCounter, linear_data, linear_problem
from wandb_offline import offline_runs, run_of

wandb = pytest.importorskip("wandb", reason="WandbHandler needs wandb (pip install 'fitforge[wandb]')")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # wandb's own use of deprecated APIs
starts_wandb = pytest.mark.integration  # a W&B run starts W&B's service process


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    """Offline, every W&B file under tmp_path; its console capture off (pytest captures the output)."""
    monkeypatch.chdir(tmp_path)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for name in ("WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    # W&B reads its environment once, when its process-wide set-up is made: one left by an earlier test
    # (a docs page's offline fit) would hold that test's environment, not this one's.
    wandb.teardown()


@pytest.fixture(scope="module", autouse=True)
def _service_stopped():
    yield
    wandb.teardown()  # W&B's service process ends with the module


def fit(handlers, epochs=3, validate=True, **kwargs):
    torch.manual_seed(0)
    estimator, train, val = linear_problem()
    return estimator.fit(train, val_data=val if validate else None, epochs=epochs, event_handlers=handlers, **kwargs)


def runs(folder):
    """The offline runs under ``folder``, once W&B's service has written them: it writes a run's log after
    ``finish`` returns, and is through when it ends (``wandb.teardown``; the next run starts it again)."""
    wandb.teardown()
    return [run_of(path) for path in offline_runs(folder)]


def the_run(folder):
    (run,) = runs(folder)
    return run


@starts_wandb
def test_the_config_and_a_row_per_epoch_are_in_the_offline_run(tmp_path):
    seen = []
    tracker = WandbHandler(project="fitforge", run_name="first", config={"seed": 7}, tags=["test"])
    probe = LambdaHandler(train_begin=lambda state: seen.append(run_params(state)))
    validation = ValidationHandler(linear_data(n=64, seed=1), epoch_period=2)
    history = fit([tracker, probe, validation], validate=False, check_access=True)
    run = the_run(tmp_path)
    assert run["id"] == tracker.run_id and run["exit_code"] == 0 and not run["preempting"]
    assert {key: run["config"][key] for key in seen[0]} == pytest.approx(seen[0])
    assert run["config"]["seed"] == 7 and run["config"]["model"] == "Linear"
    assert [row["epoch"] for row in run["rows"]] == [1, 2, 3]
    for key in ("train_loss", "lr", "epoch_time"):
        assert [row[key] for row in run["rows"]] == pytest.approx(history[key])
    assert ["val_loss" in row for row in run["rows"]] == [False, True, False]  # an epoch without one: left out
    assert run["rows"][1]["val_loss"] == pytest.approx(history["val_loss"][1])


def resumed_fit(tmp_path, epochs, **kwargs):
    """The same script each time: resumes from the newest checkpoint."""
    saver = CheckpointHandler(tmp_path / "ckpt", resume_from_checkpoint=True)
    tracker = WandbHandler(project="fitforge")
    return tracker, fit([saver, tracker], epochs=epochs, validate=False, **kwargs)


@starts_wandb
def test_a_resumed_fit_continues_the_run_id(tmp_path):
    first, _ = resumed_fit(tmp_path, 2)
    second, history = resumed_fit(tmp_path, 4)
    assert second.run_id == first.run_id
    both = runs(tmp_path)  # offline, each fit writes its own files of the run
    assert [run["id"] for run in both] == [first.run_id] * 2
    assert [[row["epoch"] for row in run["rows"]] for run in both] == [[1, 2], [3, 4]]
    assert [row["train_loss"] for run in both for row in run["rows"]] == pytest.approx(history["train_loss"])


@starts_wandb
def test_a_failed_fit_exits_1_and_a_sigterm_marks_the_run_preempted(tmp_path):
    def boom(state):
        if state.global_step == 10:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fit([WandbHandler(dir=str(tmp_path / "failed")), LambdaHandler(batch_end=boom)])
    failed = the_run(tmp_path / "failed")
    assert failed["exit_code"] == 1 and not failed["preempting"] and len(failed["rows"]) == 1

    def terminate(state):
        if state.global_step == 10:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit):
        fit([WandbHandler(dir=str(tmp_path / "killed")), LambdaHandler(batch_begin=terminate)])
    killed = the_run(tmp_path / "killed")
    assert killed["exit_code"] == 1 and killed["preempting"] and len(killed["rows"]) == 1  # the cut epoch: resumed


@starts_wandb
def test_an_active_run_is_joined_and_left_open(tmp_path):
    active = wandb.init(project="mine", config={"lr": 0.5})
    try:
        tracker = WandbHandler(project="ignored when joining")
        fit([tracker], epochs=2)
        assert tracker.run_id == active.id and wandb.run is active  # its owner finishes it
        assert active.config["lr"] == 0.5 and active.config["optimizer"] == "SGD"  # the owner's values kept
    finally:
        active.finish()
    run = the_run(tmp_path)
    assert [row["epoch"] for row in run["rows"]] == [1, 2] and run["exit_code"] == 0


@starts_wandb
def test_no_host_read_per_batch_with_all_three_trackers(tmp_path):
    pytest.importorskip("mlflow", reason="MLflowHandler needs mlflow")
    pytest.importorskip("tensorboard", reason="TensorBoardHandler needs tensorboard")
    from fitforge.handlers import MLflowHandler, TensorBoardHandler

    def reads(batches):
        estimator, _, val = linear_problem()
        trackers = [
            WandbHandler(),
            MLflowHandler(f"sqlite:///{tmp_path}/mlflow.db"),
            TensorBoardHandler(tmp_path / f"tb{batches}"),
        ]
        with HostReadCounter() as counter:
            estimator.fit(linear_data(n=4 * batches, batch_size=4), val_data=val, epochs=1, event_handlers=trackers)
        return counter.count

    reads(8)  # the first fit creates the MLflow store
    assert reads(8) == reads(64)


@starts_wandb
def test_the_trackers_are_imported_only_when_built():
    code = "import sys, fitforge.handlers; print(sorted({'wandb', 'mlflow', 'tensorboard'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_nothing_is_logged_on_a_rank_other_than_0(tmp_path, monkeypatch):
    monkeypatch.setattr("fitforge.distributed.ranks.rank", lambda: 1)
    tracker = WandbHandler()
    fit([tracker], epochs=1)
    assert tracker.run_id is None and offline_runs(tmp_path) == []


def test_an_evaluation_starts_no_run(tmp_path):
    tracker = WandbHandler()
    estimator, _, val = linear_problem()
    estimator.evaluate(val, event_handlers=[tracker])
    assert tracker.run_id is None and offline_runs(tmp_path) == []


def test_a_missing_wandb_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'fitforge\[wandb\]'"):
        WandbHandler()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"project": 3}, FitforgeTypeError, r"WandbHandler: project must be a str or None, got int 3"),
        ({"dir": ["a"]}, FitforgeTypeError, r"dir must be a str or None, got list"),
        ({"project": ""}, FitforgeValueError, r"project must not be empty; pass None for the tracker's default"),
        ({"mode": "local"}, FitforgeValueError, r"mode must be one of \('online', 'offline', 'disabled'\) or None"),
        ({"tags": "a"}, FitforgeTypeError, r"tags must be a list of str, got str 'a'"),
        ({"tags": [1]}, FitforgeTypeError, r"tags must be a list of str, got list"),
        ({"config": {"a": [1]}}, FitforgeTypeError, r"config must map str keys to str, int, float or bool"),
        ({"init_kwargs": ["a"]}, FitforgeTypeError, r"init_kwargs must be a dict, got list"),
        ({"flush_secs": 0}, FitforgeValueError, r"flush_secs must be a positive number of seconds, got 0"),
    ],
)
def test_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        WandbHandler(**kwargs)


def test_repr():
    assert repr(WandbHandler(project="p", mode="offline")) == "WandbHandler(project='p', mode='offline')"

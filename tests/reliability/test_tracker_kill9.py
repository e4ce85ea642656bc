"""SIGKILL of a fit tracked by MLflow (SQLite), TensorBoard and W&B (offline) at once
(tracker_trainer.py): what the trackers' background threads wrote before the kill is all in the
stores, without the fit ever reaching train_end, so a kill loses at most the values of the last
flush interval; a re-run resumes from the checkpoint and continues the same MLflow run, the same
TensorBoard folder and the same W&B run id, each epoch once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from wandb_offline import offline_runs, run_of

pytestmark = pytest.mark.integration  # kills and restarts trainer processes, starts W&B's service
mlflow = pytest.importorskip("mlflow", reason="the trainer tracks with MLflow")
pytest.importorskip("wandb", reason="the trainer tracks with W&B")
pytest.importorskip("tensorboard", reason="the trainer tracks with TensorBoard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

TRAINER = Path(__file__).with_name("tracker_trainer.py")
TRACKERS = ("MLflowHandler", "TensorBoardHandler", "WandbHandler")
WAIT = 120  # seconds before a wait fails the test (a trainer takes seconds)


def start(folder: Path, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "src"), os.environ.get("PYTHONPATH", "")]),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        **{name: str(folder) for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")},
    }
    command = [sys.executable, str(TRAINER), str(folder), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=folder)


def lines_until(process: subprocess.Popen, done) -> list[dict]:
    """The trainer's JSON lines until ``done(lines)``; fails if it ends or stays silent before."""
    lines: list[dict] = []
    timer = threading.Timer(WAIT, process.kill)  # a stuck trainer ends the wait, and the test fails below
    timer.start()
    try:
        while not done(lines):
            line = process.stdout.readline()
            if not line:
                process.wait()
                pytest.fail(f"the trainer ended (status {process.returncode}) first:\n{process.stderr.read()[-4000:]}")
            lines.append(json.loads(line))
    finally:
        timer.cancel()
    return lines


def written(lines: list[dict], owner: str) -> int:
    return sum(line["records"] for line in lines if line.get("wrote") == owner)


def mlflow_steps(folder: Path, run_id: str) -> list[int]:
    history = mlflow.MlflowClient(f"sqlite:///{folder}/mlflow.db").get_metric_history(run_id, "train_loss")
    return sorted(metric.step for metric in history)


def tensorboard_steps(folder: Path) -> list[int]:
    events = EventAccumulator(str(folder / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [event.step for event in events.Scalars("train_loss")]


def wandb_runs(folder: Path, rows: int, finished: bool) -> list[dict]:
    """The offline runs, once W&B's service (a process of its own, which writes the run's file every flush
    interval and at the run's end) has written ``rows`` rows and, if ``finished``, the last run's end."""
    for _ in range(WAIT * 10):
        runs = [run_of(path) for path in offline_runs(folder)]
        if sum(len(run["rows"]) for run in runs) >= rows and (not finished or runs[-1]["exit_code"] is not None):
            return runs
        threading.Event().wait(0.1)
    pytest.fail(f"W&B's offline runs hold {[len(run['rows']) for run in runs]} rows, expected {rows}")


def test_a_sigkill_loses_nothing_written_and_a_rerun_continues_every_tracker(tmp_path):
    killed = start(tmp_path, "--epochs", "5", "--hang-after", "3")
    # It hangs at epoch 3's end, after its checkpoint; each tracker's thread writes the 3 epochs within its interval.
    lines = lines_until(killed, lambda lines: all(written(lines, owner) >= 3 for owner in TRACKERS))
    wandb_runs(tmp_path, rows=3, finished=False)  # W&B's service writes its file each interval, while the fit hangs
    killed.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    epochs = [line for line in lines if "epoch" in line]
    assert [line["epoch"] for line in epochs] == [1, 2, 3]
    run_id, wandb_id = epochs[0]["mlflow"], epochs[0]["wandb"]
    assert mlflow_steps(tmp_path, run_id) == [1, 2, 3]
    assert mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id).info.status == "RUNNING"  # no end
    assert tensorboard_steps(tmp_path) == [1, 2, 3]
    (cut,) = [run_of(path) for path in offline_runs(tmp_path)]
    assert cut["id"] == wandb_id and [row["epoch"] for row in cut["rows"]] == [1, 2, 3] and cut["exit_code"] is None

    rerun = start(tmp_path, "--epochs", "5")
    out, err = rerun.communicate(timeout=WAIT)
    assert rerun.returncode == 0, err[-4000:]
    epochs = [line for line in map(json.loads, out.splitlines()) if "epoch" in line]
    assert [(line["epoch"], line["mlflow"], line["wandb"]) for line in epochs] == [
        (4, run_id, wandb_id),
        (5, run_id, wandb_id),
    ]
    assert mlflow_steps(tmp_path, run_id) == [1, 2, 3, 4, 5]
    assert mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id).info.status == "FINISHED"
    assert tensorboard_steps(tmp_path) == [1, 2, 3, 4, 5]
    runs = wandb_runs(tmp_path, rows=5, finished=True)  # offline, each process writes its own files of the run
    assert [(run["id"], [row["epoch"] for row in run["rows"]]) for run in runs] == [
        (wandb_id, [1, 2, 3]),
        (wandb_id, [4, 5]),
    ]
    assert runs[1]["exit_code"] == 0

"""fitforge inside Ray Train's TorchTrainer on a local Ray cluster that the run starts (2 CPU workers,
gloo; ray_run.py): the fit uses Ray's process group, trains like one process, reports its metrics
and checkpoints with RayTrainReportHandler, and after a worker is killed Ray restarts the group,
which resumes from the last reported checkpoint and ends exactly as the run that was never stopped."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration  # a local Ray cluster

ray = pytest.importorskip("ray", reason="needs Ray Train: pip install 'fitforge[ray]'")

SCRIPT = str(Path(__file__).resolve().parent / "ray_run.py")
TIMEOUT = 300
POLL = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}  # how often Ray takes in reports (2 s by default)
EPOCHS = 3  # of 6 steps: 96 samples in global batches of 16


def launch(out: Path, config: dict) -> dict:
    done = subprocess.run(
        [sys.executable, SCRIPT, str(out), json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", **POLL},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reported = out / "reported.json"
    return {
        **json.loads((out / "result.json").read_text()),
        "reported": json.loads(reported.read_text()) if reported.exists() else None,
        "killed": (out / "killed").exists(),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("ray")
    configs = {
        "one": {"epochs": EPOCHS},  # one process, no Ray
        "ray": {"epochs": EPOCHS, "workers": 2},
        # [CheckpointHandler(folder, resume_from_checkpoint=True), RayTrainReportHandler()], as Ray's
        # Lightning integration puts RayTrainReportCallback beside ModelCheckpoint.
        "beside": {"epochs": EPOCHS, "workers": 2, "beside": True},
        # Worker 1 dies in batch 10 (epoch 2); the last checkpoint reported is of batch 8.
        "killed": {"epochs": EPOCHS, "workers": 2, "kill_at": 9, "batch_period": 4, "beside": True},
    }
    with ThreadPoolExecutor(max_workers=len(configs)) as pool:
        futures = {name: pool.submit(launch, root / name, config) for name, config in configs.items()}
        return {name: future.result() for name, future in futures.items()}


def max_difference(a: dict, b: dict) -> float:
    return max(float((torch.tensor(a[key]) - torch.tensor(b[key])).abs().max()) for key in a)


def test_fit_in_a_torch_trainer_uses_rays_process_group_and_trains_like_one_process(runs):
    run, one = runs["ray"], runs["one"]
    assert run["world"] == 2 and run["same_group"]
    assert max_difference(run["params"], one["params"]) <= 1e-6
    assert run["history"].keys() == one["history"].keys()
    for key, values in run["history"].items():
        assert values == pytest.approx(one["history"][key], rel=1e-6)


def test_beside_a_checkpoint_handler_of_ones_own_it_reports_its_files_and_trains_like_one_process(runs):
    run, one = runs["beside"], runs["one"]
    assert max_difference(run["params"], one["params"]) <= 1e-6
    assert run["reported"]["checkpoint"] == [f"model-epoch{EPOCHS}batch{6 * EPOCHS}.pt"]
    assert run["reported"]["metrics"]["train_loss"] == run["history"]["train_loss"][-1]


def test_each_epochs_metrics_and_checkpoint_are_reported_to_ray(runs):
    run = runs["ray"]
    reported = run["reported"]
    assert reported["error"] is None and reported["checkpoint"] == [f"model-epoch{EPOCHS}batch{6 * EPOCHS}.pt"]
    assert reported["metrics"]["epoch"] == EPOCHS and reported["metrics"]["global_step"] == 6 * EPOCHS
    assert reported["metrics"]["train_loss"] == run["history"]["train_loss"][-1]
    assert reported["metrics"]["val_loss"] == run["history"]["val_loss"][-1]


def test_a_killed_worker_restarts_from_the_last_reported_checkpoint_and_ends_exactly(runs):
    killed, uninterrupted = runs["killed"], runs["ray"]
    assert killed["killed"] and killed["reported"]["error"] is None
    assert killed["resumed_from"] == "model-epoch1batch8.pt"  # in the middle of epoch 2
    assert killed["params"] == uninterrupted["params"]
    assert killed["history"] == uninterrupted["history"]

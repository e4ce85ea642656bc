"""RayTrainReportHandler in Ray Train's local mode (ScalingConfig(num_workers=0): the training function
runs in this process with the real ray.train API, no cluster), and its refusals. The cluster, the
workers and the restart after a killed worker are in tests/distributed/test_ray.py."""

import gc
import subprocess
import sys

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.exceptions import FitforgeValueError
from helpers import checkpoint_files

pytest.importorskip("ray.train", reason="RayTrainReportHandler needs Ray Train (pip install 'fitforge[ray]')")
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from fitforge.handlers import RayTrainReportHandler


def estimator():
    net = nn.Linear(3, 1)
    return Estimator(net, nn.MSELoss(), device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


def data():
    x = torch.randn(32, 3, generator=torch.Generator().manual_seed(0))
    return x, x.sum(1, keepdim=True)


def test_each_epoch_and_each_save_is_reported_and_the_staging_folder_goes(tmp_path):
    seen: dict = {}

    def train(config):
        handler = RayTrainReportHandler(batch_period=3, monitor="train_loss", save_best=True)
        seen["history"] = estimator().fit(data(), batch_size=8, epochs=2, event_handlers=[handler])
        seen["folder"] = handler.model_dir
        seen["saved"] = [path.name for path in handler.saved]
        seen["best"] = handler.best_checkpoint().exists()  # kept after fit, for handlers reading it at train_end

    trainer = TorchTrainer(
        train, scaling_config=ScalingConfig(num_workers=0), run_config=RunConfig(storage_path=str(tmp_path))
    )
    result = trainer.fit()
    history = seen["history"]
    assert result.error is None and result.checkpoint is not None
    assert result.metrics["epoch"] == 2 and result.metrics["global_step"] == 8
    assert result.metrics["train_loss"] == history["train_loss"][-1]
    assert seen["saved"][-1] == "model-epoch2batch8.pt" and seen["best"]
    gc.collect()  # the handler, gone with the fit's objects
    assert not seen["folder"].exists()  # the temporary staging folder went with its handler


def test_a_folder_of_yours_keeps_its_files(tmp_path):
    def train(config):
        estimator().fit(data(), batch_size=8, epochs=1, event_handlers=[RayTrainReportHandler(tmp_path / "mine")])

    TorchTrainer(
        train, scaling_config=ScalingConfig(num_workers=0), run_config=RunConfig(storage_path=str(tmp_path))
    ).fit()
    assert checkpoint_files(tmp_path / "mine") == ["model-epoch1batch4.pt"]


def test_options_it_sets_itself_are_refused():
    for option in ("resume_from_checkpoint", "async_save"):
        with pytest.raises(FitforgeValueError, match=f"RayTrainReportHandler: {option} is not an option here"):
            RayTrainReportHandler(**{option: True})


OUTSIDE = """
import torch
from torch import nn
from fitforge import Estimator
from fitforge.handlers import RayTrainReportHandler
net = nn.Linear(3, 1)
x = torch.randn(16, 3)
handlers = [RayTrainReportHandler()]
Estimator(net, nn.MSELoss()).fit((x, x.sum(1, keepdim=True)), batch_size=8, epochs=1, event_handlers=handlers)
"""


@pytest.mark.integration  # a fresh interpreter, outside Ray Train
def test_a_fit_outside_ray_train_is_refused_with_what_to_use():
    # In a fresh process: Ray's local mode, run above, leaves a training context in this one.
    done = subprocess.run([sys.executable, "-c", OUTSIDE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert (
        "FitforgeValueError: RayTrainReportHandler runs inside Ray Train: in the training function of a "
        "TorchTrainer (train_loop_per_worker); outside Ray, save and resume with CheckpointHandler"
    ) in done.stderr


def test_an_object_store_folder_is_refused_at_fit_start():
    pytest.importorskip("fsspec")
    with pytest.raises(FitforgeValueError, match="RayTrainReportHandler: model_dir must be a local folder"):
        estimator().fit(data(), batch_size=8, epochs=1, event_handlers=[RayTrainReportHandler("memory://ray-run")])


def test_beside_a_checkpoint_handler_of_yours_it_reports_its_saves_and_adds_none(tmp_path):
    from fitforge.handlers import CheckpointHandler

    seen: dict = {}

    def train(config):
        mine = CheckpointHandler(tmp_path / "mine", batch_period=3, resume_from_checkpoint=True)
        reporter = RayTrainReportHandler()
        est = estimator()
        assert "CheckpointHandler" in est.describe_loop([mine, reporter])
        est.fit(data(), batch_size=8, epochs=2, event_handlers=[mine, reporter])
        seen["saved"], seen["reported"] = [p.name for p in mine.saved], [p.name for p in reporter.saved]

    result = TorchTrainer(
        train, scaling_config=ScalingConfig(num_workers=0), run_config=RunConfig(storage_path=str(tmp_path / "ray"))
    ).fit()
    assert result.error is None and result.checkpoint is not None and seen["saved"] == seen["reported"]
    assert checkpoint_files(tmp_path / "mine")[-1] == "model-epoch2batch8.pt"


def test_options_beside_a_checkpoint_handler_of_yours_and_shared_prefixes_are_refused(tmp_path):
    from fitforge.handlers import CheckpointHandler

    mine = CheckpointHandler(tmp_path / "mine")
    with pytest.raises(FitforgeValueError, match=r"has a CheckpointHandler of yours.*\(batch_period\)"):
        estimator().fit(data(), batch_size=8, epochs=1, event_handlers=[mine, RayTrainReportHandler(batch_period=2)])
    twins = [CheckpointHandler(tmp_path / "a"), CheckpointHandler(tmp_path / "b"), RayTrainReportHandler()]
    with pytest.raises(FitforgeValueError, match=r"share a model_prefix \(\['model', 'model'\]\)"):
        estimator().fit(data(), batch_size=8, epochs=1, event_handlers=twins)

"""ManifestHandler: every field of manifest.json, beside a checkpoint handler's files or a logger's, written
at each epoch end and after a mid-epoch save, through an object store too; a resume appended; under 50 kB
after 100 epochs; a store that cannot hold it skipped, one that fails warned about and training goes on."""

import json
import logging
import platform

import fsspec
import pytest
import torch

from fitforge.checkpoint.files import load_checkpoint
from fitforge.handlers import (
    CheckpointHandler,
    CSVLoggerHandler,
    FingerprintHandler,
    LambdaHandler,
    ManifestHandler,
)
from fitforge.testing import linear_data, linear_problem
from helpers import Crash


def manifest_of(folder):
    return json.loads((folder / "manifest.json").read_text())


def checksum_in(path):
    """The checksum a checkpoint file carries (load_checkpoint verifies it, then drops it)."""
    return torch.load(path, weights_only=True)["checksum"]


def test_a_checkpointed_fit_records_every_field(tmp_path):
    estimator, train, val = linear_problem()  # 8 batches an epoch
    estimator.fit(train, val_data=val, epochs=3, event_handlers=[CheckpointHandler(tmp_path, max_checkpoints=2)])
    manifest = manifest_of(tmp_path)
    assert manifest["format"] == 1 and manifest["started"] <= manifest["ended"]
    assert manifest["outcome"] == "finished (reached epochs=3)"
    assert manifest["time"]["wall"] >= manifest["time"]["step"] > 0 and manifest["time"]["validation"] > 0
    assert isinstance(manifest["command"], list) and manifest["cwd"] and "repository" in manifest
    environment = manifest["environment"]
    assert environment["python"] == platform.python_version() and environment["torch"] == torch.__version__
    assert environment["cuda"] == torch.version.cuda and "fitforge" in environment
    assert environment["packages"]["numpy"]  # installed with torch here
    assert manifest["hardware"]["device"] == "cpu" and manifest["hardware"]["cpus"] >= 1
    assert manifest["config"] is None  # a run from Python: its arguments instead
    assert manifest["arguments"]["lr"] == 0.1 and manifest["arguments"]["optimizer"] == "SGD"
    assert manifest["seeds"]["torch"] == 0 and isinstance(manifest["seeds"]["data"], int)
    assert [(e["epoch"], e["step"]) for e in manifest["epochs"]] == [(1, 8), (2, 16), (3, 24)]
    assert all(len(e["order"]) == 16 for e in manifest["epochs"])
    assert manifest["metrics"]["train_loss"] == estimator.history["train_loss"]
    assert manifest["metrics"]["val_loss"] == estimator.history["val_loss"]
    kept = ["model-epoch2batch16.pt", "model-epoch3batch24.pt"]  # the rotation's: only the checkpoints kept
    assert manifest["checkpoints"] == {name: checksum_in(tmp_path / name) for name in kept}
    assert manifest["resumes"] == []


def test_a_logger_alone_writes_it_beside_its_log_and_a_fit_without_files_writes_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=1)
    assert not list(tmp_path.rglob("manifest.json"))
    estimator.fit(train, epochs=2, event_handlers=[CSVLoggerHandler(tmp_path / "logs" / "log.csv")])
    manifest = manifest_of(tmp_path / "logs")
    assert len(manifest["epochs"]) == 2 and manifest["checkpoints"] == {}


def test_one_manifest_per_folder_and_a_fresh_run_replaces_it(tmp_path):
    estimator, train, _ = linear_problem()
    handlers = [CheckpointHandler(tmp_path, overwrite=True), CSVLoggerHandler(tmp_path / "log.csv")]
    estimator.fit(train, epochs=2, event_handlers=handlers)
    first = manifest_of(tmp_path)
    estimator.fit(train, epochs=1, event_handlers=handlers)  # a fresh run (it does not resume)
    second = manifest_of(tmp_path)
    assert len(first["epochs"]) == 2 and len(second["epochs"]) == 1 and second["resumes"] == []


def test_a_partial_last_epoch_is_marked(tmp_path):
    estimator, train, _ = linear_problem()
    estimator.fit(train, batches=12, event_handlers=[CSVLoggerHandler(tmp_path / "log.csv")])
    epochs = manifest_of(tmp_path)["epochs"]
    assert [(e["epoch"], e["step"], e.get("partial", False)) for e in epochs] == [(1, 8, False), (2, 12, True)]


def test_a_save_mid_epoch_is_in_the_manifest_at_once_with_its_checksum(tmp_path):
    seen = []

    def after_save(state):  # after the checkpoint handler's batch_end
        if state.global_step == 2:
            seen.append(manifest_of(tmp_path))

    estimator, train, _ = linear_problem()
    handlers = [CheckpointHandler(tmp_path, batch_period=3), LambdaHandler(batch_end=after_save, priority=950)]
    estimator.fit(train, epochs=1, event_handlers=handlers)
    assert seen[0]["checkpoints"] == {"model-epoch0batch3.pt": checksum_in(tmp_path / "model-epoch0batch3.pt")}
    assert seen[0]["epochs"] == []  # no epoch ended yet


def test_background_saves_have_their_checksums_by_the_end(tmp_path):
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=3, event_handlers=[CheckpointHandler(tmp_path, async_save=True)])
    checkpoints = manifest_of(tmp_path)["checkpoints"]
    assert len(checkpoints) == 3
    assert checkpoints == {name: checksum_in(tmp_path / name) for name in checkpoints}


def test_an_object_store_run_has_its_manifest_beside_its_checkpoints():
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=2, event_handlers=[CheckpointHandler("memory://manifest-test/run")])
    manifest = json.loads(fsspec.filesystem("memory").cat_file("/manifest-test/run/manifest.json"))
    assert len(manifest["epochs"]) == 2 and set(manifest["checkpoints"]) == {
        "model-epoch1batch8.pt",
        "model-epoch2batch16.pt",
    }


def test_a_resume_is_appended_and_its_epochs_and_fingerprints_continue_the_run(tmp_path):
    def run(folder, *extra, resume=False):
        estimator, _, _ = linear_problem()
        train = linear_data(shuffle=True)
        handlers = [CheckpointHandler(folder, batch_period=4, resume_from_checkpoint=resume), FingerprintHandler(3)]
        estimator.fit(train, epochs=3, event_handlers=[*handlers, *extra])

    run(tmp_path / "whole")
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "cut", Crash(at=14))  # after the save of step 12
    cut = manifest_of(tmp_path / "cut")
    assert cut["outcome"] == "error: RuntimeError: crash" and [e["epoch"] for e in cut["epochs"]] == [1]
    run(tmp_path / "cut", resume=True)
    whole, resumed = manifest_of(tmp_path / "whole"), manifest_of(tmp_path / "cut")
    assert resumed["started"] == cut["started"] and resumed["seeds"] == cut["seeds"]
    [resume] = resumed["resumes"]
    assert resume["from"] == "model-epoch1batch12.pt" and resume["at"] == [1, 12]
    assert resume["environment"] == resumed["environment"] and resume["started"] >= cut["started"]
    assert [e["epoch"] for e in resumed["epochs"]] == [1, 2, 3]
    assert [e["order"] for e in resumed["epochs"]] == [e["order"] for e in whole["epochs"]]
    assert resumed["fingerprints"] == whole["fingerprints"]  # exactly the uninterrupted run's steps
    assert resumed["outcome"] == "finished (reached epochs=3)"


def test_a_hundred_epochs_stay_under_50_kB(tmp_path):
    estimator, _, _ = linear_problem(train_metrics=["mae", "mse"])
    train, val = linear_data(n=160, batch_size=16), linear_data(n=16, batch_size=16, seed=1)
    fingerprints = FingerprintHandler(every=1)  # 1,000 steps, of which it keeps at most 250
    handlers = [CheckpointHandler(tmp_path, epoch_period=10), CSVLoggerHandler(tmp_path / "log.csv"), fingerprints]
    estimator.fit(train, val_data=val, epochs=100, event_handlers=handlers)
    manifest = manifest_of(tmp_path)
    assert len(manifest["epochs"]) == 100 and len(manifest["metrics"]) >= 8
    assert 125 <= len(manifest["fingerprints"]["steps"]) <= 250 and manifest["fingerprints"]["every"] == 4
    assert manifest["metrics"]["epoch_time"][0] == float(f"{manifest['metrics']['epoch_time'][0]:.4g}")
    assert (tmp_path / "manifest.json").stat().st_size < 50_000


class Memory:
    """A CheckpointIO of one's own, in a dict: no write_text, so no manifest."""

    def __init__(self):
        self.files = {}

    def write(self, name, checkpoint):
        self.files[name] = checkpoint

    def read(self, name):
        return self.files[name]

    def names(self):
        return list(self.files)

    def delete(self, name):
        self.files.pop(name, None)


class Failing(Memory):
    def write_text(self, name, text):
        raise OSError("the store refuses")

    def read_text(self, name):
        raise FileNotFoundError(name)


def test_a_store_without_text_files_is_skipped_and_a_failing_one_warned_about_once(caplog):
    estimator, train, _ = linear_problem()
    own = Memory()
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(io=own)])
    assert "manifest.json" not in own.files and own.names() == ["model-epoch1batch8.pt"]
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        estimator.fit(train, epochs=3, event_handlers=[CheckpointHandler(io=Failing())])
    warned = [r for r in caplog.records if "cannot write manifest.json" in r.getMessage()]
    assert len(warned) == 1 and "the store refuses" in warned[0].getMessage()


def test_every_fit_has_one_and_its_declared_access_holds(tmp_path):
    estimator, train, _ = linear_problem()
    assert "ManifestHandler" in estimator.describe_loop()
    handlers = [CheckpointHandler(tmp_path), FingerprintHandler(2), ManifestHandler()]  # the user's replaces it
    estimator.fit(train, epochs=2, event_handlers=handlers, check_access=True)
    assert len(manifest_of(tmp_path)["fingerprints"]["steps"]) == 8
    assert load_checkpoint(tmp_path / "model-epoch2batch16.pt")["handlers"]["FingerprintHandler"]["every"] == 2


def test_the_command_line_keeps_no_secret():
    from fitforge.reporting.manifest import redacted

    argv = ["train.py", "--api-key=SECRET", "--token", "abc", "--lr", "0.1", "s3://user:pw@bucket/run"]
    assert redacted(argv) == ["train.py", "--api-key=***", "--token", "***", "--lr", "0.1", "s3://user:***@bucket/run"]

"""Checkpoints in an object store (fsspec's ``memory://``): committed by a marker written last,
rotated, resumed exactly; what a crash in the middle of an upload leaves is never picked; errors."""

import importlib
import io
import json
import sys
import uuid

import fsspec
import pytest
import torch

from fitforge.checkpoint.files import CheckpointError, load_checkpoint
from fitforge.exceptions import FitforgeValueError
from fitforge.handlers import CheckpointHandler
from fitforge.testing import linear_problem
from helpers import checkpoint_files
from objectstore import assert_same, listing, train

memory = fsspec.filesystem("memory")


@pytest.fixture
def url():
    """A fresh folder in fsspec's process-wide memory store, emptied afterwards."""
    folder = f"/run-{uuid.uuid4().hex[:8]}"
    yield f"memory://{folder}"
    if memory.exists(folder):
        memory.rm(folder, recursive=True)


def folder_of(url: str) -> str:
    return url.removeprefix("memory://")


@pytest.fixture(scope="module")
def uninterrupted():
    return train(f"memory:///whole-{uuid.uuid4().hex[:8]}", epochs=3)[0]


def test_saves_commit_rotate_and_resume_exactly(url, uninterrupted):
    _, saver = train(url, epochs=2, max_checkpoints=2)  # saves after 4, 6, 8, 12 batches
    assert listing(memory, folder_of(url)) == [
        "model-epoch1batch8.pt",
        "model-epoch1batch8.pt.commit",
        "model-epoch2batch12.pt",
        "model-epoch2batch12.pt.commit",
    ]
    assert [p.name for p in saver.saved] == ["model-epoch1batch8.pt", "model-epoch2batch12.pt"]
    marker = json.loads(memory.cat_file(f"{folder_of(url)}/model-epoch2batch12.pt.commit"))
    assert marker["size"] == len(memory.cat_file(f"{folder_of(url)}/model-epoch2batch12.pt"))
    assert load_checkpoint(saver.saved[-1])["global_step"] == 12  # by its location, or its URL
    assert load_checkpoint(f"{url}/model-epoch2batch12.pt")["epochs_completed"] == 2
    weights, resumed = train(url, epochs=3, seed=123, resume_from_checkpoint=True)  # another init: all restored
    assert (
        resumed.resumed_from.name == "model-epoch2batch12.pt" and str(resumed.model_dir) == f"memory://{folder_of(url)}"
    )
    assert_same(weights, uninterrupted)


def test_async_saves_upload_commit_rotate_and_resume_exactly(url, uninterrupted):
    train(url, epochs=2, max_checkpoints=2, async_save=True)  # uploaded by a background thread
    assert listing(memory, folder_of(url)) == [
        "model-epoch1batch8.pt",
        "model-epoch1batch8.pt.commit",
        "model-epoch2batch12.pt",
        "model-epoch2batch12.pt.commit",
    ]
    weights, resumed = train(url, epochs=3, seed=123, resume_from_checkpoint=True, async_save=True)
    assert resumed.resumed_from.name == "model-epoch2batch12.pt"
    assert_same(weights, uninterrupted)


def test_resumes_in_the_middle_of_an_epoch(url, uninterrupted):
    train(url, epochs=1)  # saves after 4 and 6 batches
    newest = f"{folder_of(url)}/model-epoch1batch6.pt"
    memory.rm_file(f"{newest}.commit")  # as if killed in its upload: cut short, no commit
    memory.pipe_file(newest, memory.cat_file(newest)[:100])
    weights, resumed = train(url, epochs=3, resume_from_checkpoint=True)
    assert resumed.resumed_from.name == "model-epoch0batch4.pt"
    assert_same(weights, uninterrupted)


def test_an_upload_cut_short_is_never_picked_and_is_removed_at_the_next_start(url, caplog):
    train(url, epochs=1, epoch_period=None, max_checkpoints=5)  # one save, after 4 batches
    folder = folder_of(url)
    committed = memory.cat_file(f"{folder}/model-epoch0batch4.pt")
    memory.pipe_file(f"{folder}/model-epoch1batch6.pt", committed[: len(committed) // 2])  # half-uploaded, newer
    memory.pipe_file(f"{folder}/model-epoch9batch9.pt.commit", b"{}")  # a marker whose object is gone
    unverifiable = io.BytesIO()
    torch.save({"format_version": 1, "global_step": 99}, unverifiable)  # loads, but has no checksum
    memory.pipe_file(f"{folder}/model-epoch9batch99.pt", unverifiable.getvalue())
    memory.pipe_file(f"{folder}/other-epoch1batch1.pt.commit", b"{}")  # another prefix's: not this run's to clean
    memory.pipe_file(f"{folder}/other-epoch1batch1.pt", b"torn")
    with pytest.raises(CheckpointError, match=r"model-epoch1batch6.pt is not committed .*upload did not finish"):
        load_checkpoint(f"{url}/model-epoch1batch6.pt")
    caplog.set_level("WARNING", logger="fitforge")
    _, resumed = train(url, epochs=1, resume_from_checkpoint=True, epoch_period=None)
    assert resumed.resumed_from.name == "model-epoch0batch4.pt"
    assert "removed 2 uncommitted object(s) of prefix 'model'" in caplog.text
    assert "['model-epoch1batch6.pt', 'model-epoch9batch9.pt.commit']" in caplog.text
    # Whole, but no fitforge checkpoint (no checksum): left in place, and skipped by the resume.
    assert "1 file(s) under checkpoint names of prefix 'model' that are not fitforge checkpoints" in caplog.text
    assert "model-epoch9batch99.pt is not a fitforge checkpoint" in caplog.text
    left = listing(memory, folder)
    assert "other-epoch1batch1.pt.commit" in left and "other-epoch1batch1.pt" in left
    assert "model-epoch1batch6.pt" not in left and "model-epoch9batch9.pt.commit" not in left
    assert memory.cat_file(f"{folder}/model-epoch9batch99.pt") == unverifiable.getvalue()


def test_a_foreign_file_under_a_checkpoint_name_is_an_earlier_run_s_never_replaced_unasked(url):
    folder = folder_of(url)
    mine = io.BytesIO()
    torch.save({"weight": torch.ones(3)}, mine)  # the user's own file, named as a best checkpoint
    memory.pipe_file(f"{folder}/model-best.pt", mine.getvalue())
    with pytest.raises(
        FitforgeValueError, match=r"already holds 1 checkpoint file\(s\) of an earlier run \(model-best.pt\)"
    ):
        train(url, epochs=1, monitor="train_loss", save_best=True)
    assert memory.cat_file(f"{folder}/model-best.pt") == mine.getvalue()


def test_a_whole_checkpoint_without_its_marker_is_committed_and_resumed_from(url, uninterrupted, tmp_path, caplog):
    # Copied into the store by hand from a local run (no marker), or uploaded whole by a run killed
    # before its commit: its contents verify, so the next start commits it instead of deleting it.
    train(str(tmp_path), epochs=2)  # the same run, on a local disk
    local = tmp_path / "model-epoch2batch12.pt"
    folder = folder_of(url)
    memory.pipe_file(f"{folder}/model-epoch2batch12.pt", local.read_bytes())
    memory.pipe_file(f"{folder}/model-best.pt", local.read_bytes())
    caplog.set_level("INFO", logger="fitforge")
    weights, resumed = train(url, epochs=3, seed=123, resume_from_checkpoint=True)
    assert resumed.resumed_from.name == "model-epoch2batch12.pt"
    assert "committed 2 whole checkpoint(s) of prefix 'model'" in caplog.text and "removed" not in caplog.text
    assert "model-best.pt.commit" in listing(memory, folder)  # kept, and committed
    assert_same(weights, uninterrupted)


def test_a_checkpoint_that_no_longer_matches_its_marker_is_skipped(url):
    train(url, epochs=1, epoch_period=None)  # one save, after 4 batches
    folder = folder_of(url)
    # A crash after the new bytes went up under an old marker (the marker is removed first, so only
    # bytes changed in the store can do this): the digest refuses them.
    memory.pipe_file(f"{folder}/model-epoch0batch4.pt", memory.cat_file(f"{folder}/model-epoch0batch4.pt") + b"x")
    with pytest.raises(CheckpointError, match=r"none of the 1 checkpoint\(s\) .* does not match its commit marker"):
        train(url, epochs=1, resume_from_checkpoint=True)


def test_the_best_checkpoint_is_replaced_by_uncommit_upload_commit(url):
    estimator, train_data, val_data = linear_problem()
    saver = CheckpointHandler(url, monitor="val_loss", save_best=True, epoch_period=None)
    estimator.fit(train_data, val_data=val_data, epochs=3, event_handlers=[saver])
    assert listing(memory, folder_of(url)) == ["model-best.pt", "model-best.pt.commit"]
    best = load_checkpoint(saver.best_path)
    assert best["best"]["value"] == saver.best and saver.best_checkpoint() is None  # not a local file
    restored = CheckpointHandler(url, monitor="val_loss", save_best=True)
    restored.load_state_dict(saver.state_dict())
    assert restored.best_path == saver.best_path


def test_estimator_load_checkpoint_takes_a_url(url):
    estimator, train_data, _ = linear_problem()
    estimator.fit(train_data, epochs=1, event_handlers=[CheckpointHandler(url)])
    other, _, _ = linear_problem(seed=5)
    checkpoint = other.load_checkpoint(f"{url}/model-epoch1batch8.pt")
    assert checkpoint["global_step"] == 8
    assert torch.equal(other.net.weight, estimator.net.weight)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at memory://.*/model-epoch9batch9.pt"):
        other.load_checkpoint(f"{url}/model-epoch9batch9.pt")


def test_file_urls_are_local_folders(tmp_path):
    estimator, train_data, _ = linear_problem()
    saver = CheckpointHandler(f"file://{tmp_path}", epoch_period=1)
    estimator.fit(train_data, epochs=1, event_handlers=[saver])
    assert saver.model_dir == tmp_path and checkpoint_files(tmp_path) == ["model-epoch1batch8.pt"]
    assert load_checkpoint(f"file://{tmp_path}/model-epoch1batch8.pt")["global_step"] == 8


def test_a_missing_fsspec_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now raises ImportError
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(ImportError, match=r"'s3://bucket/run'.* needs fsspec: pip install \"fitforge\[cloud\]\""):
        CheckpointHandler("s3://bucket/run")


def test_a_missing_store_package_names_the_extra(monkeypatch):
    registry = importlib.import_module("fsspec.registry")  # the module (fsspec.registry is its read-only view)
    monkeypatch.delitem(registry._registry, "s3", raising=False)  # so that fsspec imports s3fs again
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(
        ImportError, match=r'needs a package that is not installed: pip install "fitforge\[cloud\]" \(s3fs\)'
    ):
        CheckpointHandler("s3://bucket/run")


def test_storage_options_with_a_local_folder_are_an_error(tmp_path):
    with pytest.raises(FitforgeValueError, match="storage_options are for an fsspec URL"):
        CheckpointHandler(tmp_path, storage_options={"key": "k"})


def test_broken_markers_and_failed_uploads_are_clear_checkpoint_errors(url, monkeypatch):
    from fitforge.checkpoint import objects

    train(url, epochs=1, epoch_period=None)  # one save, after 4 batches
    folder = folder_of(url)
    memory.pipe_file(f"{folder}/model-epoch0batch4.pt.commit", b"not json")
    with pytest.raises(CheckpointError, match="the commit marker of .* is unreadable"):
        load_checkpoint(f"{url}/model-epoch0batch4.pt")
    memory.pipe_file(f"{folder}/model-epoch0batch4.pt.commit", b"[]")
    with pytest.raises(CheckpointError, match="is not a fitforge marker"):
        load_checkpoint(f"{url}/model-epoch0batch4.pt")
    memory.pipe_file(f"{folder}/model-epoch0batch4.pt.commit", b'{"size": 1, "blake2b": "0"}')
    memory.rm_file(f"{folder}/model-epoch0batch4.pt")
    with pytest.raises(CheckpointError, match="is committed but its object is gone"):
        load_checkpoint(f"{url}/model-epoch0batch4.pt")

    def unreachable(fs, key, data):
        raise ConnectionError("the store is unreachable")  # an OSError, as s3fs raises them

    monkeypatch.setattr(objects, "upload", unreachable)
    with pytest.raises(
        CheckpointError, match=r"cannot upload memory://.*model-epoch0batch4.pt: the store is unreachable"
    ):
        train(url, epochs=1, epoch_period=None)


def test_a_fresh_run_beside_an_earlier_runs_objects_is_refused_and_overwrite_replaces_them(url):
    train(url, epochs=1)
    before = {name: memory.cat_file(f"{folder_of(url)}/{name}") for name in listing(memory, folder_of(url))}
    with pytest.raises(FitforgeValueError, match=r"already holds 2 checkpoint file\(s\) of an earlier run"):
        train(url, epochs=1)
    assert {name: memory.cat_file(f"{folder_of(url)}/{name}") for name in listing(memory, folder_of(url))} == before
    train(url, epochs=1, batch_period=8, overwrite=True)  # deletes the earlier run's objects first
    assert listing(memory, folder_of(url)) == ["model-epoch1batch6.pt", "model-epoch1batch6.pt.commit"]


def test_an_unknown_url_scheme_names_the_model_dir_and_the_known_ones():
    with pytest.raises(FitforgeValueError, match=r"the checkpoint URL 's4://bucket/run' names no storage fsspec knows"):
        CheckpointHandler("s4://bucket/run")


def test_an_endpoint_that_cannot_be_reached_is_a_clear_error_before_training():
    pytest.importorskip("s3fs")
    estimator, data, _ = linear_problem()
    options = {
        "key": "x",
        "secret": "x",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:1", "region_name": "us-east-1"},  # nothing listens
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
    }
    saver = CheckpointHandler("s3://bucket/run", storage_options=options)
    with pytest.raises(
        FitforgeValueError, match=r"cannot be written \(EndpointConnectionError: .*endpoint is reachable"
    ):
        estimator.fit(data, epochs=1, event_handlers=[saver])
    assert estimator.history.epochs == 0

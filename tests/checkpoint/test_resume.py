"""CheckpointHandler(resume_from_checkpoint=True): continue from the newest checkpoint that loads,
to the same target, exactly as the uninterrupted run at epoch boundaries; corrupt files skipped."""

import logging
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.checkpoint.files import CheckpointError
from fitforge.exceptions import FitforgeTypeError
from fitforge.handlers import CheckpointHandler
from helpers import checkpoint_files

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)


def run(folder, epochs, seed=0, resume=False, lr=0.01, handlers=()):
    """A fresh net and Adam from ``seed``, shuffled data and dropout: every random draw matters.
    Returns the final weights and the history."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=lr), device="cpu")
    data = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)
    saver = CheckpointHandler(folder, resume_from_checkpoint=resume, max_checkpoints=10)
    history = estimator.fit(data, epochs=epochs, event_handlers=[*handlers, saver])
    return net.state_dict(), history


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run(tmp_path_factory.mktemp("whole"), epochs=4)


def assert_same(weights, expected):
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_resume_continues_exactly_to_the_same_target(tmp_path, uninterrupted):
    run(tmp_path, epochs=2)
    weights, history = run(tmp_path, epochs=4, seed=123, resume=True)  # another init: all of it is restored
    assert_same(weights, uninterrupted[0])
    assert history["train_loss"] == uninterrupted[1]["train_loss"] and len(history["train_loss"]) == 4
    assert checkpoint_files(tmp_path) == [f"model-epoch{e}batch{6 * e}.pt" for e in (1, 2, 3, 4)]


def test_a_run_that_reached_its_target_trains_no_more(tmp_path):
    done, _ = run(tmp_path, epochs=2)
    weights, history = run(tmp_path, epochs=2, seed=123, resume=True)
    assert_same(weights, done)
    assert len(history["train_loss"]) == 2 and history.stop_reason.startswith("already trained: 2 of epochs=2")


def flip_a_weight_byte(content: bytes, path) -> bytes:
    """``content`` with one byte flipped inside the first weight tensor's data (torch.load still reads it)."""
    weights = torch.load(path, weights_only=True)["model"]["0.weight"]
    at = content.find(weights.numpy().tobytes()) + 5
    assert at > 5
    return content[:at] + bytes([content[at] ^ 0xFF]) + content[at + 1 :]


@pytest.mark.parametrize("damage", ["truncated", "emptied", "foreign", "byte-flipped"])
def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(tmp_path, uninterrupted, caplog, damage):
    run(tmp_path, epochs=2)
    newest = tmp_path / "model-epoch2batch12.pt"
    content = newest.read_bytes()
    newest.write_bytes(
        {
            "truncated": content[: len(content) // 2],
            "emptied": b"",
            "foreign": b"not a checkpoint",
            "byte-flipped": flip_a_weight_byte(content, newest) if damage == "byte-flipped" else b"",
        }[damage]
    )
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        weights, history = run(tmp_path, epochs=4, seed=123, resume=True)
    assert "skipping checkpoint model-epoch2batch12.pt" in caplog.text
    if damage == "byte-flipped":  # torch.load reads it: only the checksum notices
        assert "no longer match the checksum" in caplog.text
    assert_same(weights, uninterrupted[0])  # from epoch 1 on, the same run
    assert history["train_loss"] == uninterrupted[1]["train_loss"]


def test_checkpoints_none_of_which_loads_are_an_error_not_a_fresh_start(tmp_path):
    run(tmp_path, epochs=2)
    for path in tmp_path.glob("model-epoch*.pt"):
        path.write_bytes(b"")
    with pytest.raises(
        CheckpointError,
        match=r"resume_from_checkpoint: none of the 2 checkpoint\(s\) in .* can be "
        r"loaded \(model-epoch2batch12.pt: checkpoint .* is empty; ",
    ):
        run(tmp_path, epochs=4, resume=True)


def test_no_checkpoint_means_training_from_scratch(tmp_path, uninterrupted, caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        weights, _ = run(tmp_path, epochs=4, resume=True)
    assert "no checkpoint in" in caplog.text and "training from scratch" in caplog.text
    assert_same(weights, uninterrupted[0])


def test_resume_from_checkpoint_must_be_a_bool(tmp_path):
    with pytest.raises(FitforgeTypeError, match="CheckpointHandler: resume_from_checkpoint must be True or False"):
        CheckpointHandler(tmp_path, resume_from_checkpoint="yes")


def run_with_early_stopping(folder, epochs, seed=0, resume=False):
    from fitforge.handlers import EarlyStoppingHandler

    stopper = EarlyStoppingHandler("train_loss", patience=1, restore_best=True)
    # lr 0.2: the training loss is best at epoch 3 and worse at epoch 4, where patience 1 stops the run
    weights, history = run(folder, epochs, seed, resume, lr=0.2, handlers=[stopper])
    return weights, stopper, history


def test_early_stopping_state_and_best_weights_ride_in_checkpoints(tmp_path):
    weights, stopper, history = run_with_early_stopping(tmp_path / "whole", epochs=5)
    assert len(history["train_loss"]) == 4 and stopper.best_epoch == 2  # stopped early, best weights restored
    run_with_early_stopping(tmp_path / "cut", epochs=2)
    resumed_weights, resumed, resumed_history = run_with_early_stopping(
        tmp_path / "cut", epochs=5, seed=123, resume=True
    )
    assert (resumed.best, resumed.best_epoch, resumed.wait) == (stopper.best, stopper.best_epoch, stopper.wait)
    assert resumed_history["train_loss"] == history["train_loss"] and resumed_history.stop_reason == history.stop_reason
    assert_same(resumed_weights, weights)  # restore_best at the end used the restored copy


def test_stateful_handlers_of_one_class_get_numbered_keys():
    from fitforge.checkpoint.resume import stateful_handlers as _stateful
    from fitforge.handlers import EarlyStoppingHandler

    first, second = EarlyStoppingHandler("train_loss"), EarlyStoppingHandler("train_loss")
    assert _stateful((first, object(), second)) == {"EarlyStoppingHandler": first, "EarlyStoppingHandler#2": second}


def test_random_states_round_trip_through_a_weights_only_load(tmp_path):
    import random

    import numpy as np

    from fitforge.checkpoint.files import save_atomic
    from fitforge.core.rng import restore_rng_states, rng_states

    np.random.randn()  # leaves a cached gaussian in numpy's state
    save_atomic(rng_states(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.randn(), torch.rand(2))
    restore_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (random.random(), np.random.randn(), torch.rand(2))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])


def test_a_checksum_catches_changed_tensor_bytes_and_old_files_without_one_still_load(tmp_path):
    from fitforge.checkpoint.files import FORMAT_VERSION, load_checkpoint, save_atomic, save_checkpoint

    content = {"format_version": FORMAT_VERSION, "w": torch.arange(64, dtype=torch.float32), "n": [1, 2.5, None]}
    save_checkpoint(content, tmp_path / "a.pt")
    loaded = load_checkpoint(tmp_path / "a.pt")
    assert torch.equal(loaded["w"], content["w"]) and loaded["n"] == [1, 2.5, None] and "checksum" not in loaded
    raw = (tmp_path / "a.pt").read_bytes()
    at = raw.find(content["w"].numpy().tobytes()) + 9
    (tmp_path / "a.pt").write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :])
    with pytest.raises(CheckpointError, match=r"a.pt is corrupt: its contents no longer match the checksum"):
        load_checkpoint(tmp_path / "a.pt")
    save_atomic(content, tmp_path / "old.pt")  # written before checksums existed
    assert torch.equal(load_checkpoint(tmp_path / "old.pt")["w"], content["w"])


def test_a_full_disk_is_a_clear_error_leaving_no_debris_and_older_checkpoints_intact(tmp_path, monkeypatch):

    import fitforge.checkpoint.files as checkpoint_io

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full (a device that is always full) on this system")
    run(tmp_path, epochs=1)
    real_fdopen = os.fdopen

    def full_disk(fd, mode="r", *args, **kwargs):  # the temporary file, on a device with no space left
        os.close(fd)
        return real_fdopen(os.open("/dev/full", os.O_WRONLY), mode, *args, **kwargs)

    monkeypatch.setattr(checkpoint_io.os, "fdopen", full_disk)
    with pytest.raises(
        CheckpointError,
        match=r"cannot write .*model-epoch2batch12.pt: No space left on device; "
        r"free space or save elsewhere \(the files already there are intact\)",
    ):
        run(tmp_path, epochs=2, resume=True)
    monkeypatch.undo()
    assert checkpoint_files(tmp_path) == ["model-epoch1batch6.pt"]  # no temporary file left behind
    checkpoint_io.load_checkpoint(tmp_path / "model-epoch1batch6.pt")


def test_a_folder_that_cannot_be_written_mid_run_is_a_checkpoint_error(tmp_path, monkeypatch):
    import fitforge.checkpoint.files as checkpoint_io
    from fitforge.checkpoint.files import save_atomic

    with pytest.raises(CheckpointError, match=r"cannot write .*/gone/a.pt: No such file or directory; make the"):
        save_atomic({"w": torch.ones(2)}, tmp_path / "gone" / "a.pt")  # a folder removed (or made read-only)

    def refused(*args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpoint_io.os, "replace", refused)
    with pytest.raises(CheckpointError, match=r"cannot write .*b.pt: Permission denied \(the files already"):
        save_atomic({"w": torch.ones(2)}, tmp_path / "b.pt")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []  # no temporary file left


def test_rerunning_a_run_that_stopped_early_trains_no_more(tmp_path):
    weights, _, history = run_with_early_stopping(tmp_path, epochs=5)  # stops after epoch 4
    again_weights, _, again_history = run_with_early_stopping(tmp_path, epochs=5, seed=123, resume=True)
    assert again_history["train_loss"] == history["train_loss"] and len(again_history["train_loss"]) == 4
    assert again_history.stop_reason == "already stopped: " + history.stop_reason
    assert_same(again_weights, weights)  # restore_best still put the best epoch's weights back

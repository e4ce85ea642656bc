"""CheckpointHandler and checkpoint_io: names, rotation, best, atomic writes, safe loading, errors."""

import math
import os

import pytest
import torch
from torch import nn

from fitforge import TrainState
from fitforge.checkpoint.files import CheckpointError, load_checkpoint, restore_weights, save_atomic
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, LambdaHandler
from fitforge.testing import RecordingHandler, linear_problem
from helpers import checkpoint_files, make_estimator


def names(folder):
    return checkpoint_files(folder)


def test_epoch_and_batch_checkpoints_are_named_by_completed_epochs_and_batches(tmp_path):
    estimator, train, _ = linear_problem()  # 8 batches per epoch
    saver = CheckpointHandler(tmp_path, epoch_period=1, batch_period=5, max_checkpoints=10)
    estimator.fit(train, epochs=2, event_handlers=[saver])
    assert names(tmp_path) == [
        "model-epoch0batch5.pt",
        "model-epoch1batch10.pt",
        "model-epoch1batch15.pt",
        "model-epoch1batch8.pt",
        "model-epoch2batch16.pt",
    ]
    last = load_checkpoint(tmp_path / "model-epoch2batch16.pt")
    assert (last["epochs_completed"], last["global_step"], last["format_version"]) == (2, 16, 1)
    assert last["history"]["epochs"] == 2 and len(last["history"]["columns"]["train_loss"]) == 2
    for key, value in estimator.net.state_dict().items():
        assert torch.equal(last["model"][key], value)


def test_rotation_keeps_the_newest_and_deletes_by_exact_name(tmp_path):
    estimator, train, _ = linear_problem()
    foreign = tmp_path / "model-epoch0batch10.pt"  # shares the prefix of epoch0batch1: must survive
    # written once training runs (a fit refuses to start beside another run's files)
    write_foreign = LambdaHandler(batch_begin=lambda state: state.global_step == 0 and foreign.write_bytes(b"not ours"))
    saver = CheckpointHandler(tmp_path, epoch_period=None, batch_period=1, max_checkpoints=2)
    estimator.fit(train, batches=4, event_handlers=[saver, write_foreign])
    assert names(tmp_path) == ["model-epoch0batch10.pt", "model-epoch0batch3.pt", "model-epoch0batch4.pt"]
    assert [p.name for p in saver.saved] == ["model-epoch0batch3.pt", "model-epoch0batch4.pt"]
    assert foreign.read_bytes() == b"not ours"


def test_save_best_keeps_the_best_value_and_its_weights(tmp_path):
    estimator, train, val = linear_problem()
    saver = CheckpointHandler(tmp_path, model_prefix="lin", monitor="val_loss", save_best=True, epoch_period=None)
    history = estimator.fit(train, val_data=val, epochs=3, event_handlers=[saver])
    assert names(tmp_path) == ["lin-best.pt"] and saver.best_path == tmp_path / "lin-best.pt"
    best = load_checkpoint(saver.best_path)
    assert best["best"] == {"monitor": "val_loss", "value": min(history["val_loss"]), "epoch": 2}


def test_nan_is_never_best(tmp_path):
    saver = CheckpointHandler(tmp_path, monitor="val_loss", save_best=True, epoch_period=None)
    state = TrainState(make_estimator())
    saver.train_begin(state)
    for epoch, value in enumerate([math.nan, 2.0, math.nan, 3.0]):
        state.epoch = epoch
        state.history.new_epoch()
        state.history.record("val_loss", value)
        saver.epoch_end(state)
    assert saver.best == 2.0 and load_checkpoint(saver.best_path)["best"]["epoch"] == 1


def test_an_infinite_value_is_never_best(tmp_path):
    saver = CheckpointHandler(tmp_path, monitor="val_loss", save_best=True, epoch_period=None)
    state = TrainState(make_estimator())
    saver.train_begin(state)
    for epoch, value in enumerate([2.0, -math.inf, 1.0, math.inf]):
        state.epoch = epoch
        state.history.new_epoch()
        state.history.record("val_loss", value)
        saver.epoch_end(state)
    assert saver.best == 1.0 and load_checkpoint(saver.best_path)["best"]["epoch"] == 2


def test_checkpoints_load_with_weights_only_and_restore(tmp_path):
    estimator, train, _ = linear_problem()
    estimator.optimizers = [torch.optim.Adam(estimator.net.parameters(), lr=0.01)]  # has per-parameter state
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    path = tmp_path / "model-epoch1batch8.pt"
    torch.load(path, weights_only=True)  # no pickled code inside
    fresh = make_estimator()
    fresh.optimizers = [torch.optim.Adam(fresh.net.parameters(), lr=0.01)]
    restore_weights(fresh, path)
    assert torch.equal(fresh.net.weight, estimator.net.weight)
    assert torch.equal(
        fresh.optimizer.state_dict()["state"][0]["exp_avg"], estimator.optimizer.state_dict()["state"][0]["exp_avg"]
    )


def test_restore_into_another_architecture_lists_the_keys(tmp_path):
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    other = make_estimator(net=nn.Sequential(nn.Linear(1, 1)))
    with pytest.raises(
        CheckpointError,
        match=r"the weights in checkpoint \S*model-epoch1batch8.pt do not fit this "
        r"net: missing keys \['0.bias', '0.weight'\]; unexpected keys "
        r"\['bias', 'weight'\]",
    ):
        restore_weights(other, tmp_path / "model-epoch1batch8.pt")
    wide = make_estimator(net=nn.Linear(2, 1))
    with pytest.raises(CheckpointError, match=r"shape mismatches \['weight: checkpoint \(1, 1\) vs net \(1, 2\)'\]"):
        restore_weights(wide, tmp_path / "model-epoch1batch8.pt")
    two = make_estimator()
    two.optimizers = [two.optimizer, torch.optim.SGD(two.net.parameters(), lr=0.1)]
    with pytest.raises(CheckpointError, match="holds 1 optimizer state.* has 2 optimizer"):
        restore_weights(two, tmp_path / "model-epoch1batch8.pt")


def test_a_load_whose_optimizer_state_does_not_fit_changes_nothing(tmp_path):
    # Issue 14, point 6: the net kept the weights it had just loaded when an optimizer's state failed.
    estimator, train, _ = linear_problem()
    estimator.optimizers = [torch.optim.Adam(estimator.net.parameters(), lr=0.01)]
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    other = make_estimator()
    extra = torch.nn.Parameter(torch.zeros(3))  # a second param group: Adam's saved groups no longer fit
    other.optimizers = [torch.optim.Adam([{"params": other.net.parameters()}, {"params": [extra]}], lr=0.5)]
    weights = {k: v.clone() for k, v in other.net.state_dict().items()}
    groups = [dict(group) for group in other.optimizer.param_groups]
    with pytest.raises(
        CheckpointError,
        match=r"the optimizer state in checkpoint \S*model-epoch1batch8.pt does not "
        r"fit Adam: .*nothing was loaded",
    ):
        other.load_checkpoint(tmp_path / "model-epoch1batch8.pt")
    assert all(torch.equal(other.net.state_dict()[k], v) for k, v in weights.items())
    assert other.optimizer.param_groups == groups and not other.optimizer.state


def test_the_state_of_another_optimizer_class_is_refused(tmp_path):
    estimator, train, _ = linear_problem()
    estimator.optimizers = [torch.optim.Adam(estimator.net.parameters(), lr=0.01)]
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    other = make_estimator()  # SGD: torch would load Adam's state into it, and fail at the next step
    with pytest.raises(
        CheckpointError,
        match=r"holds the state of a Adam for optimizer 0, but the estimator's "
        r"optimizer 0 is a SGD",
    ):
        other.load_checkpoint(tmp_path / "model-epoch1batch8.pt")
    other.load_checkpoint(tmp_path / "model-epoch1batch8.pt", optimizers=False)  # the weights alone load


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is empty"),
        (b"\x00garbage" * 10, "cannot be read"),
    ],
)
def test_corrupt_files_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "model-epoch1batch1.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)


def test_truncated_foreign_and_future_files_are_refused(tmp_path):
    good = save_atomic({"format_version": 1, "model": {"w": torch.ones(1000)}}, tmp_path / "a.pt")
    truncated = tmp_path / "b.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="b.pt cannot be read"):
        load_checkpoint(truncated)
    with pytest.raises(CheckpointError, match="not a fitforge checkpoint"):
        load_checkpoint(save_atomic({"w": torch.ones(1)}, tmp_path / "c.pt"))
    with pytest.raises(CheckpointError, match="format version 99; this fitforge reads up to 1"):
        load_checkpoint(save_atomic({"format_version": 99}, tmp_path / "d.pt"))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "missing.pt")


def test_a_failed_save_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = save_atomic({"format_version": 1, "v": 1}, tmp_path / "x.pt")
    with pytest.raises(Exception):  # noqa: B017 (whatever pickling raises)
        save_atomic({"format_version": 1, "v": lambda: 2}, path)  # a lambda cannot be saved
    assert load_checkpoint(path)["v"] == 1 and names(tmp_path) == ["x.pt"]


def test_leftover_temporary_files_are_removed_at_fit_start(tmp_path):
    (tmp_path / ".model-epoch1batch8.pt.abc.tmp").write_bytes(b"torn")
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    assert names(tmp_path) == ["model-epoch1batch8.pt"]


def test_an_unwritable_model_dir_fails_before_the_first_step(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    estimator, train, _ = linear_problem()
    recorder = RecordingHandler()
    with pytest.raises(FitforgeValueError, match="model_dir '.*file/runs' is not a writable folder"):
        estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(blocker / "runs"), recorder])
    assert "batch_begin" not in recorder.events


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs a non-root POSIX user")
def test_a_read_only_model_dir_fails_before_the_first_step(tmp_path):
    tmp_path.chmod(0o500)
    try:
        estimator, train, _ = linear_problem()
        with pytest.raises(FitforgeValueError, match="is not a writable folder"):
            estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    finally:
        tmp_path.chmod(0o700)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"model_dir": 3}, FitforgeTypeError, "model_dir must be a folder path, got int 3"),
        ({"model_prefix": "a/b"}, FitforgeValueError, "model_prefix must be a non-empty file-name prefix"),
        ({"epoch_period": 0}, FitforgeValueError, "epoch_period must be a positive int or None, got 0"),
        ({"batch_period": 2.5}, FitforgeTypeError, "batch_period must be a positive int or None, got float 2.5"),
        ({"epoch_period": None}, FitforgeValueError, "would never save: epoch_period and batch_period are None"),
        ({"max_checkpoints": 0}, FitforgeValueError, "max_checkpoints must be a positive int, got 0"),
        ({"save_best": True}, FitforgeValueError, "save_best=True needs a monitor"),
        ({"save_best": 1, "monitor": "val_loss"}, FitforgeTypeError, "save_best must be True or False, got int 1"),
        ({"monitor": "val_loss", "mode": "best"}, FitforgeValueError, "mode must be 'auto', 'min' or 'max'"),
    ],
)
def test_argument_errors(tmp_path, kwargs, error, message):
    kwargs.setdefault("model_dir", tmp_path)
    with pytest.raises(error, match=message):
        CheckpointHandler(**kwargs)


def test_state_dict_round_trip(tmp_path):
    saver = CheckpointHandler(tmp_path, monitor="val_loss", save_best=True)
    estimator, train, val = linear_problem()
    estimator.fit(train, val_data=val, epochs=2, event_handlers=[saver])
    copy = CheckpointHandler(tmp_path, monitor="val_loss", save_best=True)
    copy.load_state_dict(saver.state_dict())  # the files to rotate come from the folder, not the state
    assert copy.best == saver.best and copy.best_path == saver.best_path == tmp_path / "model-best.pt"


def test_estimator_load_checkpoint_restores_weights_and_returns_the_counters(tmp_path):
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=2, event_handlers=[CheckpointHandler(tmp_path)])
    fresh = make_estimator()
    checkpoint = fresh.load_checkpoint(tmp_path / "model-epoch1batch8.pt", optimizers=False)
    assert (checkpoint["epochs_completed"], checkpoint["global_step"]) == (1, 8)
    assert not torch.equal(fresh.net.weight, estimator.net.weight)  # epoch 1's weights, not the final ones
    fresh.load_checkpoint(tmp_path / "model-epoch2batch16.pt")
    assert torch.equal(fresh.net.weight, estimator.net.weight)


def test_describe_loop_names_handlers_by_class(tmp_path):
    estimator, _, _ = linear_problem()
    text = estimator.describe_loop([CheckpointHandler(tmp_path, monitor="train_loss")])
    assert "StoppingHandler(report)" in text and "CheckpointHandler(persist)" in text and "monitor=" not in text


def test_a_partial_last_epoch_is_named_by_the_epochs_it_completed(tmp_path):
    estimator, train, _ = linear_problem()  # 8 batches per epoch
    saver = CheckpointHandler(tmp_path)
    estimator.fit(train, batches=12, event_handlers=[saver])
    assert names(tmp_path) == ["model-epoch1batch12.pt", "model-epoch1batch8.pt"]
    assert load_checkpoint(tmp_path / "model-epoch1batch12.pt")["epochs_completed"] == 1


def test_a_batch_save_at_an_epochs_end_is_not_written_twice(tmp_path):
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=2, event_handlers=[CheckpointHandler(tmp_path, batch_period=4, max_checkpoints=9)])
    assert names(tmp_path) == [
        "model-epoch0batch4.pt",
        "model-epoch1batch12.pt",
        "model-epoch1batch8.pt",
        "model-epoch2batch16.pt",
    ]


def test_files_get_the_usual_permissions_and_other_prefixes_temporaries_survive(tmp_path):
    other = tmp_path / ".model-small-epoch1batch8.pt.x.tmp"  # another run's save in flight
    other.write_bytes(b"")
    mine = tmp_path / ".model-epoch3batch9.pt.y.tmp"
    mine.write_bytes(b"")
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    assert other.exists() and not mine.exists()
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "model-epoch1batch8.pt").stat().st_mode & 0o777 == 0o666 & ~mask


def contents(folder):
    return {name: (folder / name).read_bytes() for name in checkpoint_files(folder)}


def test_a_fresh_run_beside_an_earlier_runs_files_is_refused_and_leaves_them_byte_identical(tmp_path):
    estimator, train, val = linear_problem()  # 8 batches per epoch
    estimator.fit(
        train, val_data=val, epochs=2, event_handlers=[CheckpointHandler(tmp_path, monitor="val_loss", save_best=True)]
    )
    before = contents(tmp_path)
    estimator, train, val = linear_problem()
    with pytest.raises(FitforgeValueError) as refused:
        estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    message = str(refused.value)
    assert f"{tmp_path} already holds 3 checkpoint file(s) of an earlier run" in message
    assert "(model-epoch1batch8.pt, model-epoch2batch16.pt, model-best.pt)" in message
    assert "To continue that run pass resume_from_checkpoint=True; to replace its files pass overwrite=True" in message
    assert contents(tmp_path) == before and estimator.history.epochs == 0  # refused before training


def test_a_best_only_folder_is_kept_from_a_run_that_finds_nothing_to_resume(tmp_path, caplog):
    estimator, train, val = linear_problem()
    best_only = dict(monitor="val_loss", save_best=True, epoch_period=None)
    estimator.fit(train, val_data=val, epochs=3, event_handlers=[CheckpointHandler(tmp_path, **best_only)])
    before = contents(tmp_path)
    assert list(before) == ["model-best.pt"]
    caplog.set_level("INFO", logger="fitforge")
    for resume in (False, True):
        estimator, train, val = linear_problem(lr=0.5)  # a worse first epoch would replace the best
        saver = CheckpointHandler(tmp_path, resume_from_checkpoint=resume, **best_only)
        with pytest.raises(FitforgeValueError, match="already holds 1 checkpoint file") as refused:
            estimator.fit(train, val_data=val, epochs=1, event_handlers=[saver])
        assert ("found no checkpoint to resume from beside them" in str(refused.value)) == resume
        assert contents(tmp_path) == before
    assert "no periodic checkpoint to resume from in" in caplog.text and "(only ['model-best.pt'])" in caplog.text
    assert "training from scratch" not in caplog.text  # it does not: it is refused


def test_overwrite_deletes_the_earlier_runs_files_before_training(tmp_path, caplog):
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=2, event_handlers=[CheckpointHandler(tmp_path, batch_period=4)])
    estimator, train, _ = linear_problem()
    with caplog.at_level("WARNING", logger="fitforge"):
        estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path, overwrite=True)])
    assert "overwrite=True: deleting the 4 checkpoint file(s) of an earlier run" in caplog.text
    assert names(tmp_path) == ["model-epoch1batch8.pt"]  # this run's alone: a resume cannot pick the other's
    with pytest.raises(FitforgeTypeError, match="overwrite must be True or False"):
        CheckpointHandler(tmp_path, overwrite="yes")


def test_a_second_phase_of_one_estimator_is_told_to_save_apart_not_to_resume(tmp_path):
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=2, event_handlers=[CheckpointHandler(tmp_path)])
    with pytest.raises(FitforgeValueError) as refused:
        estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path)])  # fine-tuning, phase 2
    message = str(refused.value)
    assert "this fit goes on from the estimator's 2 epoch(s) but names its files from epoch 0" in message
    assert "Give each fit its own model_prefix (or model_dir)" in message and "resume_from_checkpoint" not in message
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path, model_prefix="phase2")])


def test_a_resume_another_prefix_or_an_empty_folder_is_not_refused(tmp_path):
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path / "run")])
    for handler in (
        CheckpointHandler(tmp_path / "run", resume_from_checkpoint=True),
        CheckpointHandler(tmp_path / "run", model_prefix="other"),
        CheckpointHandler(tmp_path / "empty"),
    ):
        estimator, train, _ = linear_problem()
        estimator.fit(train, epochs=2, event_handlers=[handler])

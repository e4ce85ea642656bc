"""A store of one's own: a CheckpointIO written here, in plain Python (no fitforge class to subclass),
that CheckpointHandler saves, rotates, keeps the best and resumes through, exactly as on disk."""

import os
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
import torch

from fitforge.checkpoint import CheckpointIO, checkpoint_bytes, checkpoint_from_bytes
from fitforge.exceptions import CheckpointError, FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler
from fitforge.testing import linear_problem


class SQLiteIO:
    """Checkpoints as rows of a SQLite table: each write is one transaction, so whole or not at all."""

    def __init__(self, database):
        self.database = str(database)
        with closing(sqlite3.connect(self.database)) as db, db:
            db.execute("CREATE TABLE IF NOT EXISTS checkpoints (name TEXT PRIMARY KEY, data BLOB)")

    def _run(self, sql, *args):
        with closing(sqlite3.connect(self.database)) as db, db:  # commits, or rolls back on an error
            return db.execute(sql, args).fetchall()

    def write(self, name, checkpoint):
        self._run("INSERT OR REPLACE INTO checkpoints VALUES (?, ?)", name, checkpoint_bytes(checkpoint))

    def read(self, name):
        rows = self._run("SELECT data FROM checkpoints WHERE name = ?", name)
        if not rows:
            raise FileNotFoundError(f"no checkpoint {name} in {self.database}")
        return checkpoint_from_bytes(rows[0][0], name)

    def names(self):
        return [name for (name,) in self._run("SELECT name FROM checkpoints")]

    def delete(self, name):
        self._run("DELETE FROM checkpoints WHERE name = ?", name)


def test_fit_saves_rotates_and_keeps_the_best_through_an_io_of_ones_own(tmp_path):
    io = SQLiteIO(tmp_path / "checkpoints.db")
    assert isinstance(io, CheckpointIO)  # by its methods alone
    estimator, train, val = linear_problem()  # 8 batches an epoch
    saver = CheckpointHandler(io=io, batch_period=5, max_checkpoints=2, monitor="val_loss", save_best=True)
    history = estimator.fit(train, val_data=val, epochs=3, event_handlers=[saver])
    assert sorted(io.names()) == ["model-best.pt", "model-epoch2batch20.pt", "model-epoch3batch24.pt"]
    assert [location.name for location in saver.saved] == ["model-epoch2batch20.pt", "model-epoch3batch24.pt"]
    best = io.read("model-best.pt")
    assert best["best"]["value"] == min(history["val_loss"]) and saver.best == min(history["val_loss"])
    last = io.read("model-epoch3batch24.pt")
    for key, value in estimator.net.state_dict().items():
        assert torch.equal(last["model"][key], value)


def test_a_fresh_run_refuses_an_earlier_runs_checkpoints_in_the_io_and_overwrite_replaces_them(tmp_path):
    io = SQLiteIO(tmp_path / "checkpoints.db")
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(io=io)])
    estimator, train, _ = linear_problem()
    with pytest.raises(
        FitforgeValueError, match=r"already holds 1 checkpoint file\(s\) of an earlier run \(model-epoch1batch8.pt\)"
    ):
        estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(io=io)])
    assert io.names() == ["model-epoch1batch8.pt"]  # refused before training: nothing replaced
    estimator.fit(train, epochs=2, event_handlers=[CheckpointHandler(io=io, overwrite=True, epoch_period=2)])
    assert io.names() == ["model-epoch2batch16.pt"]


def test_a_torn_or_missing_checkpoint_in_the_io_is_skipped_on_resume(tmp_path):
    io = SQLiteIO(tmp_path / "checkpoints.db")
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=2, event_handlers=[CheckpointHandler(io=io)])
    io._run("UPDATE checkpoints SET data = ? WHERE name = ?", b"torn", "model-epoch2batch16.pt")
    estimator, train, _ = linear_problem()
    saver = CheckpointHandler(io=io, resume_from_checkpoint=True)
    estimator.fit(train, epochs=3, event_handlers=[saver])
    assert saver.resumed_from.name == "model-epoch1batch8.pt"
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoint_from_bytes(b"torn", "model-epoch2batch16.pt")


def test_fsdp_into_an_io_without_folder_path_is_refused_at_fit_start(tmp_path):
    from fitforge import TrainState
    from fitforge.distributed import FSDPStrategy

    estimator, _, _ = linear_problem()
    estimator.strategy = FSDPStrategy()  # what train_begin reads; no process group is needed to refuse
    io = SQLiteIO(tmp_path / "checkpoints.db")
    with pytest.raises(FitforgeValueError, match=r"FSDP's sharded checkpoints .* give your CheckpointIO a folder_path"):
        CheckpointHandler(io=io).train_begin(TrainState(estimator=estimator))
    assert io.names() == []  # refused before anything was written


def test_a_resume_outside_a_fit_is_refused(tmp_path):
    from fitforge import TrainState

    io = SQLiteIO(tmp_path / "checkpoints.db")
    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(io=io)])
    estimator, _, _ = linear_problem()
    before = {key: value.clone() for key, value in estimator.net.state_dict().items()}
    with pytest.raises(FitforgeValueError, match="CheckpointHandler resumes within a fit"):
        CheckpointHandler(io=io, resume_from_checkpoint=True).train_begin(TrainState(estimator=estimator))
    assert all(torch.equal(value, before[key]) for key, value in estimator.net.state_dict().items())  # untouched


def test_an_io_must_be_given_alone_and_have_the_four_methods(tmp_path):
    with pytest.raises(FitforgeValueError, match=r"or an io \(a CheckpointIO\), not both"):
        CheckpointHandler(tmp_path, io=SQLiteIO(tmp_path / "c.db"))
    with pytest.raises(FitforgeValueError, match="or an io .*got neither"):
        CheckpointHandler()
    with pytest.raises(FitforgeTypeError, match="io must be a CheckpointIO .* lacks names, delete"):
        CheckpointHandler(io=type("Half", (), {"write": lambda self, n, c: None, "read": lambda self, n: {}})())


RUN = """
import sys, os, signal, torch
sys.path.insert(0, {tests!r})
from test_checkpoint_io import SQLiteIO
from fitforge.handlers import CheckpointHandler, LambdaHandler
from fitforge.testing import linear_problem

database, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
estimator, train, _ = linear_problem()
kill = LambdaHandler(batch_end=lambda state: state.global_step == kill_at and os.kill(os.getpid(), signal.SIGKILL))
saver = CheckpointHandler(io=SQLiteIO(database), batch_period=3, resume_from_checkpoint=True)
estimator.fit(train, epochs=3, event_handlers=[saver, kill])
torch.save(estimator.net.state_dict(), out)
"""


def run(script, database, out, kill_at):
    return subprocess.run([sys.executable, str(script), str(database), str(out), str(kill_at)], timeout=120).returncode


@pytest.mark.integration
def test_a_run_killed_mid_epoch_resumes_through_the_io_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RUN.format(tests=str(Path(__file__).parent)))
    assert run(script, tmp_path / "whole.db", tmp_path / "whole.pt", -1) == 0
    assert run(script, tmp_path / "killed.db", tmp_path / "killed.pt", 12) == -signal.SIGKILL  # epoch 2, after a save
    assert "model-epoch1batch12.pt" in SQLiteIO(tmp_path / "killed.db").names()  # the newest, saved before the kill
    assert not os.path.exists(tmp_path / "killed.pt")
    assert run(script, tmp_path / "killed.db", tmp_path / "killed.pt", -1) == 0  # resumes, then completes
    whole, resumed = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "killed.pt")
    assert all(torch.equal(whole[key], resumed[key]) for key in whole)

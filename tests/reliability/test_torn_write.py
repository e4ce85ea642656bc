"""SIGKILL in the middle of a checkpoint write (half of its bytes on disk, flushed and fsynced):
only the temporary file is torn, every file under a checkpoint name still loads, and the resumed
run removes the temporary file at its start and ends bitwise equal to the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import (
    assert_same_losses,
    assert_same_weights,
    event,
    injected,
    journal,
    losses,
    regular_checkpoints,
    run_trainer,
    survived,
    torn,
    unreadable,
    weights,
)

from fitforge.checkpoint.files import CheckpointError, load_checkpoint

pytestmark = pytest.mark.integration  # kills and restarts trainer processes (harness.py)

# Saves 1-3 write 3, 6 and 8 (the end of epoch 1) completed batches; save 4 is 9's.
TORN_SAVE, TORN_NAME, BEFORE = (
    4,
    "model-epoch1batch9.pt",
    ["model-epoch0batch3.pt", "model-epoch0batch6.pt", "model-epoch1batch8.pt"],
)


def test_sigkill_during_a_checkpoint_write_tears_only_the_temporary_file(tmp_path, reference):
    folder = tmp_path / "checkpoints"
    injected("SIGKILL mid-write")
    rc, _, _ = run_trainer(folder, tmp_path / "torn.jsonl", fault=f"tear:{TORN_SAVE}", expect_rc=None)
    fault = event(journal(tmp_path / "torn.jsonl"), "fault")
    assert rc == -9 and fault is not None  # killed inside torch.save, after the half write

    temps = sorted(folder.glob(".model-*.tmp"))
    assert [path.name for path in temps] == [Path(fault["temp"]).name]  # the torn write is left as a temp file
    assert temps[0].name.startswith(f".{TORN_NAME}.")
    assert temps[0].stat().st_size == fault["written"] < fault["size"]  # half of it, as the fault wrote
    with pytest.raises(CheckpointError):
        load_checkpoint(temps[0])  # it is torn indeed
    assert [path.name for path in regular_checkpoints(folder)] == BEFORE  # nothing under the torn file's name
    assert torn(unreadable(folder)) == []

    rc, _, _ = run_trainer(folder, tmp_path / "resumed.jsonl", out=tmp_path / "out.pt")
    entries = journal(tmp_path / "resumed.jsonl")
    start = event(entries, "start")
    assert not any(name.endswith(".tmp") for name in start["files"])  # removed at train_begin, before training
    assert start["resume_step"] == 8
    assert not list(folder.glob(".*.tmp"))
    assert_same_losses(losses(entries), reference[0].losses)
    assert_same_weights(weights(tmp_path / "out.pt"), reference[0].weights)
    survived("SIGKILL mid-write")

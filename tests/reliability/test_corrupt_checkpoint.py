"""A run killed part-way, then its newest checkpoint corrupted (truncated, one byte flipped inside
tensor data, emptied): the resume skips it with a warning naming it and ends bitwise equal to the
uninterrupted run. With every checkpoint corrupt, the resume fails with a CheckpointError."""

from __future__ import annotations

import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from harness import (
    assert_same_losses,
    assert_same_weights,
    event,
    in_parallel,
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

pytestmark = pytest.mark.integration  # kills and restarts trainer processes (harness.py)

KILL = "kill@begin:20"  # leaves the checkpoints of 15, 16 and 18 completed batches (max_checkpoints=3)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path: Path) -> None:
    """Flip one byte in the middle of the largest tensor's data (a stored zip entry of torch.save)."""
    with zipfile.ZipFile(path) as archive:
        entry = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    assert entry.compress_type == zipfile.ZIP_STORED
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[entry.header_offset + 26 : entry.header_offset + 30])
    start = entry.header_offset + 30 + name_length + extra_length  # after the local file header
    data[start + entry.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    torch.load(path, weights_only=True)  # torch.load alone does not notice: only fitforge's checksum does


def empty(path: Path) -> None:
    path.write_bytes(b"")


CORRUPTIONS = {"truncated": truncate, "flipped": flip, "emptied": empty}
REASONS = {"truncated": "cannot be read", "flipped": "no longer match the checksum", "emptied": "is empty"}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[dict, list[str]]:
    """Each case's resume, run in parallel: case -> (rc, stderr, journal, final weights or None)."""
    root = tmp_path_factory.mktemp("corrupt")
    rc, _, _ = run_trainer(root / "killed", root / "killed.jsonl", fault=KILL, expect_rc=None)
    assert rc == -9 and event(journal(root / "killed.jsonl"), "fault") and torn(unreadable(root / "killed")) == []
    names = [path.name for path in regular_checkpoints(root / "killed")]

    def resume(case: str):
        folder = root / case
        shutil.copytree(root / "killed", folder)
        files = regular_checkpoints(folder)
        if case == "all":  # each file corrupted in one of the three ways
            for corrupt, path in zip(CORRUPTIONS.values(), files, strict=True):
                corrupt(path)
        else:
            CORRUPTIONS[case](files[-1])
        out = root / f"{case}.pt"
        rc, _, stderr = run_trainer(folder, root / f"{case}.jsonl", out=out, expect_rc=None)
        return rc, stderr, journal(root / f"{case}.jsonl"), weights(out) if out.exists() else None

    cases = [*CORRUPTIONS, "all"]
    return dict(zip(cases, in_parallel(*(lambda case=case: resume(case) for case in cases)))), names


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(resumed, reference, case):
    results, names = resumed
    assert names == ["model-epoch1batch15.pt", "model-epoch2batch16.pt", "model-epoch2batch18.pt"]
    injected(f"newest checkpoint {case}")
    rc, stderr, entries, final = results[case]
    assert rc == 0, stderr[-3000:]
    warning = next(line for line in stderr.splitlines() if "skipping checkpoint" in line)
    assert f"skipping checkpoint {names[-1]}: " in warning and REASONS[case] in warning  # names the file and why
    assert event(entries, "start")["resume_step"] == 16  # the checkpoint before it
    assert_same_losses(losses(entries), reference[0].losses)
    assert_same_weights(final, reference[0].weights)
    survived(f"newest checkpoint {case}")


def test_every_checkpoint_corrupt_is_a_checkpoint_error(resumed):
    results, names = resumed
    injected("every checkpoint corrupt")
    rc, stderr, entries, final = results["all"]
    assert rc != 0 and final is None and event(entries, "start") is None  # it failed before training
    assert "CheckpointError" in stderr and "none of the" in stderr
    assert all(f"skipping checkpoint {name}" in stderr for name in names)
    survived("every checkpoint corrupt")

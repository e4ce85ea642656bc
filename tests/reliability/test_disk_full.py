"""The disk fills up during a checkpoint write: fit fails with a CheckpointError naming the file
and saying to free space, leaves no debris, and the checkpoints already written still load.

The disk is a tmpfs sized for two checkpoints, mounted in a private mount namespace
(``unshare -rm``); where that is impossible the write fails with an injected ENOSPC instead."""

from __future__ import annotations

import math
import shutil

import pytest
from harness import (
    event,
    injected,
    journal,
    regular_checkpoints,
    run_process,
    run_trainer,
    survived,
    torn,
    unreadable,
)

from helpers import checkpoint_files

pytestmark = pytest.mark.integration  # mounts a tmpfs for the disk through unshare

PAGE = 4096
# In the namespace: mount the tmpfs on the folder, train, and copy the folder out before the
# namespace (and the mount with it) goes away; the exit status is the trainer's.
MOUNT_AND_RUN = (
    'dir=$1 copy=$2 size=$3; shift 3; mount -t tmpfs -o size="$size" tmpfs "$dir" || exit 97; '
    '"$@"; rc=$?; cp -a "$dir/." "$copy/" || exit 98; exit $rc'
)
EXPECTED = ["model-epoch0batch3.pt", "model-epoch0batch6.pt"]  # the third write (epoch 1's end) fails
FAILING = "model-epoch1batch8.pt"


def can_mount(tmp_path) -> bool:
    if shutil.which("unshare") is None:
        return False
    (tmp_path / "probe").mkdir()
    rc, _, _ = run_process(
        ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=4k tmpfs "$1"', "sh", str(tmp_path / "probe")],
        timeout=30,
    )
    return rc == 0


def test_a_full_disk_is_a_checkpoint_error_and_leaves_no_debris(tmp_path, reference):
    folder, copy = tmp_path / "checkpoints", tmp_path / "copy"
    folder.mkdir()
    copy.mkdir()
    if can_mount(tmp_path):
        pages = max(math.ceil(path.stat().st_size / PAGE) for path in regular_checkpoints(reference[0].folder))
        size = (2 * pages + pages // 2) * PAGE  # room for two checkpoints, not three

        def wrap(cmd):
            return ["unshare", "-rm", "sh", "-c", MOUNT_AND_RUN, "sh", str(folder), str(copy), str(size), *cmd]

        fault, options, left = f"tmpfs of {size // 1024} KiB", {"wrap": wrap}, copy
    else:
        fault, options, left = "injected ENOSPC", {"fault": "enospc:3"}, folder
    print(f"\ndisk full: {fault}")
    injected(f"disk full ({fault})")
    rc, _, stderr = run_trainer(folder, tmp_path / "full.jsonl", expect_rc=None, **options)
    assert rc not in (0, 97, 98), stderr[-3000:]  # it failed, and not in the mount or the copy
    assert "No space left on device" in stderr  # the fault fired
    if "fault" in options:
        assert event(journal(tmp_path / "full.jsonl"), "fault") is not None
    assert "CheckpointError" in stderr and f"cannot write {folder / FAILING}" in stderr and "free space" in stderr

    assert checkpoint_files(left) == EXPECTED  # no temporary file, no partial checkpoint
    assert regular_checkpoints(left) and torn(unreadable(left)) == []  # they load, checksums verified
    survived(f"disk full ({fault})")

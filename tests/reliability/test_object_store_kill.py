"""SIGKILL in the middle of checkpoint uploads to S3 (a real S3-compatible server on the loopback,
moto's server mode), between the data upload and its commit marker, scheduled by the save's number:
the object left is never loaded uncommitted. Cut short, the re-run deletes it and resumes from the
previous committed checkpoint; uploaded whole, the re-run verifies it, commits it and resumes from
it. The run ends bitwise equal to the uninterrupted one. The kills are chained, as in test_kill9."""

from __future__ import annotations

import fnmatch

import pytest
from harness import (
    FIGURES,
    STEPS,
    assert_same_losses,
    assert_same_weights,
    event,
    injected,
    journal,
    losses,
    run_trainer,
    survived,
    torn,
    weights,
)

from fitforge.checkpoint.files import CheckpointError
from fitforge.checkpoint.objects import FsspecCheckpointIO, load_url
from objectstore import listing, local_s3, s3, s3_environment, storage_options

pytestmark = pytest.mark.integration  # kills trainer processes that upload to a moto S3 server

URL = "s3://bucket/kill9"
# (fault, the save it kills, the newest committed checkpoint then, the next run's resume). Saves after
# 3, 6, 8, 9, 12, 15, 16, 18, 21... batches: the first run's fifth save is at 12, uploaded whole; the
# re-run commits it, resumes from it and saves 15, 16, 18, then 21, cut short.
FAULTS = [("upload-kill:5", 12, 9, 12), ("upload-tear:4", 21, 18, 18)]


@pytest.fixture(scope="module")
def endpoint():
    with local_s3() as address:
        yield address


def committed_steps(files: FsspecCheckpointIO) -> list[int]:
    names = fnmatch.filter(files.names(), "model-epoch*batch*.pt")
    return sorted(int(name.split("batch")[1].removesuffix(".pt")) for name in names)


def test_sigkill_between_upload_and_commit_resumes_from_the_previous_commit_bitwise(endpoint, reference, tmp_path):
    fs, files = s3(endpoint), FsspecCheckpointIO(URL, storage_options(endpoint))
    env = s3_environment(endpoint)  # the trainer reaches the server through botocore's variables
    lost = {}
    for i, (spec, killed, newest, resumed) in enumerate(FAULTS):
        injected(f"{spec} s3")
        rc, _, _ = run_trainer(URL, tmp_path / f"kill{i}.jsonl", fault=spec, expect_rc=None, env=env)
        entries = journal(tmp_path / f"kill{i}.jsonl")
        fault = event(entries, "fault")
        assert rc == -9 and fault is not None and fault["completed"] == killed and event(entries, "end") is None
        stray = fault["key"].rsplit("/", 1)[-1]
        left = listing(fs, "bucket/kill9")
        assert stray in left and f"{stray}.commit" not in left  # uploaded (whole or half), never committed
        assert (
            fs.size(fault["key"])
            == fault["written"]
            == (fault["size"] if spec.startswith("upload-kill") else fault["size"] // 2)
        )
        with pytest.raises(CheckpointError, match="is not committed"):
            load_url(f"{URL}/{stray}", storage_options(endpoint))
        steps = committed_steps(files)
        assert steps[-1] == newest and killed not in steps
        unreadable = []
        for step in steps:
            try:
                files.read(next(n for n in fnmatch.filter(files.names(), f"model-epoch*batch{step}.pt")))
            except CheckpointError:
                unreadable.append(step)
        assert torn(unreadable) == []
        lost[spec] = killed - resumed
        assert_same_losses(losses(entries), reference[0].losses)
        if i:  # this run started after the previous kill: it resumed as that kill's entry says
            assert event(entries, "start")["resume_step"] == FAULTS[i - 1][3]

    final = tmp_path / "final.jsonl"
    run_trainer(URL, final, out=tmp_path / "out.pt", env=env)
    entries = journal(final)
    start = event(entries, "start")
    assert start["resume_step"] == FAULTS[-1][3] and not any(
        name.startswith("model-epoch2batch21") for name in start["files"]
    )
    assert sorted(losses(entries)) == list(range(FAULTS[-1][3], STEPS))
    assert_same_losses(losses(entries), reference[0].losses)
    assert_same_weights(weights(tmp_path / "out.pt"), reference[0].weights)
    assert len(committed_steps(files)) == 3  # max_checkpoints: the rotation deleted the older ones
    FIGURES["lost"]["SIGKILL mid-upload to S3"] = lost
    for spec, *_ in FAULTS:
        survived(f"{spec} s3")

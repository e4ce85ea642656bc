"""SIGTERM at three points: fit stops at the next batch boundary, the newest checkpoint holds every
completed batch (0 steps lost), the exit status is 143, and the resume ends bitwise equal to the
uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from harness import (
    FIGURES,
    assert_same_losses,
    assert_same_weights,
    event,
    in_parallel,
    injected,
    journal,
    losses,
    regular_checkpoints,
    run_trainer,
    step_of,
    survived,
    torn,
    unreadable,
    weights,
)

from helpers import checkpoint_files

pytestmark = pytest.mark.integration  # signals trainer processes (harness.py)

POINTS = {
    "term@begin:10": 11,  # mid-epoch, mid-step: the batch finishes, 11 batches completed
    "term@begin:23": 24,  # the last batch of epoch 3: its batch end saves, its epoch end is the resumed run's
    "term@epoch_end:16": 16,  # at epoch 2's end, after the CheckpointHandler's epoch_end saved
}  # spec -> completed batches when training stops


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """spec -> (rc, stderr, journal, the newest checkpoint's (B of its name, global_step in it),
    unreadable files, the resumed run's journal, its final weights)."""
    root = tmp_path_factory.mktemp("sigterm")

    def term_and_resume(spec: str):
        folder = root / spec.replace("@", "-").replace(":", "-")
        folder.mkdir()
        rc, _, stderr = run_trainer(folder / "checkpoints", folder / "term.jsonl", fault=spec, expect_rc=None)
        newest = regular_checkpoints(folder / "checkpoints")[-1]
        newest = (step_of(newest), torch.load(newest, weights_only=True)["global_step"])  # before the resume
        bad = unreadable(folder / "checkpoints")
        run_trainer(folder / "checkpoints", folder / "resumed.jsonl", out=folder / "out.pt")
        return (
            rc,
            stderr,
            journal(folder / "term.jsonl"),
            newest,
            bad,
            journal(folder / "resumed.jsonl"),
            weights(folder / "out.pt"),
        )

    return dict(zip(POINTS, in_parallel(*(lambda spec=spec: term_and_resume(spec) for spec in POINTS))))


@pytest.mark.parametrize("spec", POINTS)
def test_sigterm_saves_every_completed_batch_and_exits_143(runs, reference, spec):
    injected(spec)
    rc, stderr, entries, newest, bad, resumed, final = runs[spec]
    fault = event(entries, "fault")
    assert fault is not None and "received SIGTERM" in stderr  # it fired
    assert rc == 143 and event(entries, "end") is None
    assert torn(bad) == []
    completed = max(losses(entries)) + 1  # the batches that ran, the one under way when it came included
    assert completed == POINTS[spec]
    named, saved = newest
    assert named == saved == completed  # 0 steps lost
    assert event(resumed, "start")["resume_step"] == completed and min(losses(resumed)) == completed
    assert_same_losses(losses(entries), reference[0].losses)
    assert_same_losses(losses(resumed), reference[0].losses)
    assert_same_weights(final, reference[0].weights)
    FIGURES["lost"].setdefault("SIGTERM", {})[spec] = completed - saved
    survived(spec)


@pytest.fixture(scope="module")
def restore_runs(tmp_path_factory) -> dict:
    """A SIGTERM in train_begin, once the checkpoint to resume from is loaded, of a run resuming in
    the middle of an epoch ("resumed": after term@begin:10 left a checkpoint of 11 batches) and of a
    fresh run ("fresh"); then a run to the end. case -> (the checkpoint files' bytes before and after
    the SIGTERM'd run, its rc and stderr, the last run's journal and final weights)."""
    root = tmp_path_factory.mktemp("sigterm_restore")

    def case(name: str):
        folder = root / name
        folder.mkdir()
        checkpoints = folder / "checkpoints"
        if name == "resumed":
            run_trainer(checkpoints, folder / "first.jsonl", fault="term@begin:10", expect_rc=143)

        def files():
            return (
                {name: (checkpoints / name).read_bytes() for name in checkpoint_files(checkpoints)}
                if checkpoints.exists()
                else {}
            )

        before = files()
        rc, _, stderr = run_trainer(checkpoints, folder / "restore.jsonl", fault="term@train_begin", expect_rc=None)
        after = files()
        run_trainer(checkpoints, folder / "final.jsonl", out=folder / "out.pt")
        return before, after, rc, stderr, journal(folder / "final.jsonl"), weights(folder / "out.pt")

    return dict(zip(("resumed", "fresh"), in_parallel(lambda: case("resumed"), lambda: case("fresh"))))


@pytest.mark.parametrize("case", ["resumed", "fresh"])
def test_sigterm_while_restoring_leaves_the_checkpoints_untouched(restore_runs, reference, case):
    # Issue 14, point 1: train_end saved the preempted run with the batch position at its default,
    # replacing the mid-epoch checkpoint of 11 batches (position 3) by one at position 0; the next
    # resume retrained epoch 2 from its first batch and diverged.
    spec = f"term@train_begin ({case})"
    injected(spec)
    before, after, rc, stderr, final, final_weights = restore_runs[case]
    assert rc == 143 and "received SIGTERM" in stderr
    assert after == before  # not one byte rewritten, no file added
    assert ("model-epoch1batch11.pt" in before) == (case == "resumed") and (case == "resumed" or not after)
    start = 11 if case == "resumed" else 0
    assert event(final, "start")["resume_step"] == (start or None)
    assert sorted(losses(final)) == list(range(start, 32))  # 21 steps when resumed, not the epoch again
    assert_same_losses(losses(final), reference[0].losses)
    assert_same_weights(final_weights, reference[0].weights)
    survived(spec)

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

POINTS = {
    "term@begin:10": 11,  # mid-epoch, mid-step: the batch finishes, 11 batches completed
    "term@begin:23": 24,  # the last batch of epoch 3: its epoch end saves
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
        return (rc, stderr, journal(folder / "term.jsonl"), newest, bad, journal(folder / "resumed.jsonl"),
                weights(folder / "out.pt"))

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

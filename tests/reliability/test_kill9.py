"""SIGKILL at seeded points of training, each re-run resuming from the newest checkpoint: the
run ends bitwise equal to the uninterrupted one, and every step's loss (redone steps included)
equals the uninterrupted run's at that step. The kills are chained to save processes: run 1 is
killed at the first point, its re-run at the second, and so on; the last re-run completes."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import (
    FIGURES,
    STEPS,
    assert_same_losses,
    assert_same_weights,
    event,
    in_parallel,
    injected,
    journal,
    losses,
    newest_saved,
    regular_checkpoints,
    run_trainer,
    step_of,
    survived,
    torn,
    unreadable,
    weights,
)

pytestmark = pytest.mark.integration  # kills and restarts trainer processes (harness.py)

# (where, global step): kill at batch_begin (the step is lost mid-way) or batch_end (after the
# CheckpointHandler's batch_end) of that 0-based step. 8 batches an epoch; saves after 3, 6, 8, 9...
FIXED = [
    ("end", 14),  # right after a checkpoint: the one of 15 completed batches was just written
    ("begin", 16),  # the first batch of epoch 3
    ("end", 23),  # the last batch of epoch 3, before the epoch end writes its checkpoint
]


def kill_points() -> list[tuple[str, int]]:
    rng = random.Random(1)  # fixed: the same points in every run of the suite
    others = rng.sample([step for step in range(STEPS) if step not in {s for _, s in FIXED}], 2)
    points = FIXED + [(rng.choice(["begin", "end"]), step) for step in others]
    return sorted(points, key=lambda point: point[1])  # chained: each re-run must still reach its point


@dataclass
class Kill:
    where: str
    step: int
    rc: int
    fault: dict | None  # the marker the trainer wrote right before the kill
    losses: dict[int, str]
    newest: int | None  # completed batches of the newest checkpoint left (None: none)
    unreadable: list[str]  # files under a checkpoint name that do not load, right after the kill
    start: dict | None  # what the run's train_begin found (resume_step)
    ended: bool

    @property
    def spec(self) -> str:
        return f"kill@{self.where}:{self.step}"


def chain(root: Path, workers: int) -> tuple[list[Kill], list[dict], dict]:
    """Kill at every point in turn, each run resuming the previous one's checkpoints; then one
    more run completes. Returns the kills, the last run's journal and its final weights."""
    folder = root / f"workers{workers}"
    folder.mkdir()
    checkpoints = folder / "checkpoints"
    kills = []
    for i, (where, step) in enumerate(kill_points()):
        log = folder / f"kill{i}.jsonl"
        rc, _, _ = run_trainer(checkpoints, log, workers=workers, fault=f"kill@{where}:{step}", expect_rc=None)
        entries, left = journal(log), regular_checkpoints(checkpoints)
        kills.append(
            Kill(
                where,
                step,
                rc,
                event(entries, "fault"),
                losses(entries),
                step_of(left[-1]) if left else None,
                unreadable(checkpoints),
                event(entries, "start"),
                event(entries, "end") is not None,
            )
        )
    run_trainer(checkpoints, folder / "final.jsonl", out=folder / "out.pt", workers=workers)
    return kills, journal(folder / "final.jsonl"), weights(folder / "out.pt")


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> dict:
    """The chain for num_workers 0 and 2, run in parallel."""
    root = tmp_path_factory.mktemp("kill9")
    return dict(zip((0, 2), in_parallel(lambda: chain(root, 0), lambda: chain(root, 2))))


@pytest.mark.parametrize("workers", [0, 2])
def test_sigkill_at_seeded_points_resumes_bitwise(chains, reference, workers):
    assert reference[workers].losses == reference[0].losses  # the workers change nothing in the order
    kills, final, final_weights = chains[workers]
    restarts = [kill.start for kill in kills[1:]] + [event(final, "start")]  # the run after each kill
    lost = {}
    for kill, restart in zip(kills, restarts):
        injected(f"{kill.spec} workers={workers}")
        assert kill.rc == -9 and kill.fault is not None and kill.fault["spec"] == kill.spec, kill  # it fired
        assert not kill.ended
        assert torn(kill.unreadable) == []  # no torn file under a checkpoint name
        # The next run resumes from the newest checkpoint the schedule had written before the kill.
        assert kill.newest == restart["resume_step"] == newest_saved(kill.where, kill.step)
        lost[kill.spec] = kill.fault["completed"] - (kill.newest or 0)
    after_save = next(kill for kill in kills if kill.spec == "kill@end:14")
    assert "model-epoch1batch15.pt" in after_save.fault["files"] and lost[after_save.spec] == 0  # saved, then killed

    # Every step's loss in every run, the redone ones included, is the uninterrupted run's.
    runs = [kill.losses for kill in kills] + [losses(final)]
    for logged in runs:
        assert_same_losses(logged, reference[workers].losses)
    redone = sum(len(logged) for logged in runs) - 32
    assert redone == sum(lost.values()) > 0  # each lost step ran twice, and only those
    assert sorted(losses(final)) == list(range(kills[-1].newest or 0, 32))  # the last run completes
    assert_same_weights(final_weights, reference[workers].weights)

    FIGURES["lost"][f"SIGKILL, workers={workers}"] = lost
    print(f"\nworkers={workers}: steps lost per kill {lost}")
    for kill in kills:
        survived(f"{kill.spec} workers={workers}")

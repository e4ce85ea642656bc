"""SIGKILL at 20 seeded moments of async saves (``CheckpointHandler(async_save=True)``): from the
background writer part way through a checkpoint's bytes or right after its commit, and from the
training thread while a save is in flight. The previous checkpoint is always left valid, each
re-run resumes from the newest committed one, and the run ends bitwise equal to the uninterrupted
(synchronous) one. The kills are chained, two chains of ten in parallel: each chain's re-run is
killed at the next point; its last re-run completes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from harness import (
    BATCH_END_SAVES,
    EPOCH_END_SAVES,
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

pytestmark = pytest.mark.integration  # kills and restarts trainer processes (harness.py)

SAVES = sorted(set(BATCH_END_SAVES + EPOCH_END_SAVES))  # completed batches of every checkpoint of a run
CHAINS, KILLS = 2, 10


def kill_points(chain: int) -> list[str]:
    """Ten faults at distinct saves, in the order training reaches them (a re-run resumes before
    its point: never after the previous point's save)."""
    rng = random.Random(36 + chain)  # fixed: the same points in every run of the suite
    points = []
    for step in sorted(rng.sample(SAVES, KILLS)):
        kinds = ["bytes", "committed"] + (["train"] if step != SAVES[-1] else [])  # no batch after the last save
        kind = rng.choice(kinds)
        if kind == "committed":
            points.append(f"save-kill:{step}:committed")
        else:
            points.append(f"{'save' if kind == 'bytes' else 'train'}-kill:{step}:{rng.randrange(1001)}")
    return points


def expected_newest(spec: str) -> int | None:
    """The newest checkpoint a kill leaves: the one it was writing once committed, else the one
    before it (committed, as a save waits for the previous one)."""
    _, step, stage = spec.split(":")
    if stage == "committed":
        return int(step)
    return max((s for s in SAVES if s < int(step)), default=None)


def chain(root: Path, number: int) -> tuple[list[dict], list[dict], dict]:
    folder = root / f"chain{number}"
    folder.mkdir()
    checkpoints = folder / "checkpoints"
    kills = []
    for i, spec in enumerate(kill_points(number)):
        log = folder / f"kill{i}.jsonl"
        rc, _, stderr = run_trainer(checkpoints, log, fault=spec, expect_rc=None, async_save=True)
        entries, left = journal(log), regular_checkpoints(checkpoints)
        kills.append(
            {
                "spec": spec,
                "rc": rc,
                "stderr": stderr[-2000:],
                "fault": event(entries, "fault"),
                "losses": losses(entries),
                "newest": step_of(left[-1]) if left else None,
                "unreadable": unreadable(checkpoints),
                "start": event(entries, "start"),
                "ended": event(entries, "end") is not None,
            }
        )
    run_trainer(checkpoints, folder / "final.jsonl", out=folder / "out.pt", async_save=True)
    return kills, journal(folder / "final.jsonl"), weights(folder / "out.pt")


@pytest.fixture(scope="module")
def chains(tmp_path_factory) -> list:
    root = tmp_path_factory.mktemp("async_kill9")
    return in_parallel(*(lambda number=number: chain(root, number) for number in range(CHAINS)))


def test_sigkill_during_async_saves_leaves_a_valid_checkpoint_and_resumes_bitwise(chains, reference):
    assert len({spec for number in range(CHAINS) for spec in kill_points(number)}) > 10  # the chains differ
    for number, (kills, final, final_weights) in enumerate(chains):
        restarts = [kill["start"] for kill in kills[1:]] + [event(final, "start")]
        lost = {}
        for kill, restart in zip(kills, restarts):
            name = f"{kill['spec']} async chain={number}"
            injected(name)
            assert kill["rc"] == -9 and kill["fault"] is not None and not kill["ended"], kill  # it fired
            assert torn(kill["unreadable"]) == []  # no torn file under a checkpoint name
            # The previous checkpoint is intact (once one was committed), and the re-run resumes from it.
            assert kill["newest"] == restart["resume_step"] == expected_newest(kill["spec"]), kill
            reached = max(kill["losses"], default=-1) + 1
            lost[kill["spec"]] = reached - (kill["newest"] or 0)
        runs = [kill["losses"] for kill in kills] + [losses(final)]
        for logged in runs:
            assert_same_losses(logged, reference[0].losses)  # the async run computes the synchronous one
        assert sorted(losses(final)) == list(range(kills[-1]["newest"] or 0, 32))  # the last run completes
        assert_same_weights(final_weights, reference[0].weights)
        FIGURES["lost"][f"SIGKILL during async saves, chain {number}"] = lost
        print(f"\nasync chain {number}: steps lost per kill {lost}")
        for kill in kills:
            survived(f"{kill['spec']} async chain={number}")

"""A signal to the whole process group, as SLURM sends at its time limit or on scancel: the
DataLoader's workers get it too, from a process that is not their parent. Training with 2 workers,
or in a validation whose loader has 2 workers, the fit still saves every completed batch, exits as
the signal asks, and the resumed run ends bitwise as the uninterrupted one (issue 36: the workers
died of it, and the fit failed with "DataLoader worker ... killed by signal", saving nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest
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

pytestmark = pytest.mark.integration  # signals trainer processes (harness.py)

WORKERS = 2
SLOW = 0.125  # seconds per validation batch once armed: 80 batches, a 10 s validation
LATENCY = 2.0  # seconds from the signal to the checkpoint committed, at most
CASES = {  # spec -> (trainer args, exit status, completed batches when training stops)
    "termpg@end:4": ([], 143, 5),  # training: the batch under way finishes and is saved
    "usr1pg@end:12": ([], 138, 13),  # SIGUSR1 without SLURM
    "termpg@val:10": (["--val", str(SLOW), "--val-workers", str(WORKERS)], 143, 10),  # in a validation
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The uninterrupted run with validation workers; per case the signalled run's rc, stderr,
    journal, newest checkpoint and unreadable files, and the resumed run's journal and weights."""
    root = tmp_path_factory.mktemp("group_signal")

    def validating_reference():
        args = ["--val", "0", "--val-workers", str(WORKERS)]
        run_trainer(root / "ref", root / "ref.jsonl", out=root / "ref.pt", workers=WORKERS, args=args)
        return journal(root / "ref.jsonl"), weights(root / "ref.pt")

    def case(spec: str):
        folder = root / spec.replace("@", "-").replace(":", "-")
        folder.mkdir()
        args, _, _ = CASES[spec]
        checkpoints = folder / "checkpoints"
        rc, _, stderr = run_trainer(
            checkpoints, folder / "signal.jsonl", workers=WORKERS, fault=spec, expect_rc=None, args=args
        )
        newest = regular_checkpoints(checkpoints)[-1] if checkpoints.exists() and any(checkpoints.iterdir()) else None
        bad = unreadable(checkpoints) if checkpoints.exists() else []
        resumed_args = [arg if arg != str(SLOW) else "0" for arg in args]
        run_trainer(checkpoints, folder / "resumed.jsonl", out=folder / "out.pt", workers=WORKERS, args=resumed_args)
        return rc, stderr, journal(folder / "signal.jsonl"), newest, bad, journal(folder / "resumed.jsonl"), folder

    results = in_parallel(validating_reference, *(lambda spec=spec: case(spec) for spec in CASES))
    return {"validating": results[0], **dict(zip(CASES, results[1:]))}


@pytest.mark.parametrize("spec", CASES)
def test_a_signal_to_the_process_group_with_dataloader_workers_saves_and_resumes_exactly(runs, reference, spec):
    injected(spec)
    _, expected_rc, completed = CASES[spec]
    rc, stderr, entries, newest, bad, resumed, folder = runs[spec]
    fault = event(entries, "fault")
    assert fault is not None, stderr[-3000:]
    assert "killed by signal" not in stderr and "exited unexpectedly" not in stderr, stderr[-3000:]
    assert rc == expected_rc and event(entries, "exit")["code"] == expected_rc, stderr[-3000:]
    assert torn(bad) == []
    assert newest is not None and step_of(newest) == completed == max(losses(entries)) + 1  # 0 steps lost
    commits = [e for e in entries if e.get("event") == "committed" and e["t"] >= fault["t"]]
    assert [c["name"] for c in commits] == [newest.name]
    assert event(resumed, "start")["resume_step"] == completed
    if "@val" in spec:
        ref_entries, ref_weights = runs["validating"]
        latency = commits[0]["t"] - fault["t"]
        assert latency <= LATENCY, f"committed {latency:.2f} s after the signal"
        FIGURES["save_latency"][f"{spec} ({WORKERS} validation workers)"] = latency
        ref_losses = losses(ref_entries)
    else:
        ref_losses, ref_weights = reference[WORKERS].losses, reference[WORKERS].weights
    assert_same_losses(losses(entries), ref_losses)
    assert_same_losses(losses(resumed), ref_losses)
    assert_same_weights(weights(Path(folder) / "out.pt"), ref_weights)
    FIGURES["lost"].setdefault("SIGUSR1" if "usr1" in spec else "SIGTERM", {})[spec] = completed - step_of(newest)
    survived(spec)

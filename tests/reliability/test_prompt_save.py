"""A prompt save on preemption (issue 36): a signal during a validation that would take 10 s, during
an epoch_end hook, during the check before training, and on one of 2 ranks under torchrun. The
checkpoint is committed within 2 s of the signal (the training batches take milliseconds, so 2 s
is the bound), the process exits as the launcher expects (143; SIGUSR1 under SLURM requeues the
job and exits 0), nothing of the abandoned validation is recorded, and the resumed run (whose
validations take no time) redoes it and ends bitwise as the uninterrupted one."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from harness import (
    FIGURES,
    TRAINER,
    assert_same_losses,
    assert_same_weights,
    event,
    in_parallel,
    injected,
    journal,
    losses,
    regular_checkpoints,
    run_process,
    run_trainer,
    step_of,
    survived,
    torn,
    unreadable,
    weights,
)

from helpers import checkpoint_files

pytestmark = pytest.mark.integration  # signals trainer processes (harness.py)

SLOW = 0.125  # seconds per validation batch once the fault is armed: 80 batches, 10 s
SLOW_PER_RANK = 0.25  # under torchrun each of 2 ranks reads 40 batches: 10 s
LATENCY = 2.0  # seconds from the signal to the checkpoint committed, at most (issue 36)
JOB = "4242"  # SLURM_JOB_ID of the SIGUSR1 run
CASES = {  # spec -> (the checkpoint the signal commits, exit status)
    "term@val:10": ("model-epoch1batch10.pt", 143),  # a batch_period validation, mid-epoch
    "term@val:16": ("model-epoch1batch16.pt", 143),  # the epoch-end validation: saved before that end
    "term@epoch_hook:16": ("model-epoch2batch16.pt", 143),  # an epoch_end hook after validation
    "usr1@val:10": ("model-epoch1batch10.pt", 0),  # under SLURM with scontrol: requeued
}


def validations(entries: list[dict]) -> dict[int, str]:
    """Completed validations: batches completed before each -> its loss (hex)."""
    return {entry["val"]: entry["loss"] for entry in entries if "val" in entry}


def commits_after(entries: list[dict], fault: dict) -> list[dict]:
    return [e for e in entries if e.get("event") == "committed" and e["t"] >= fault["t"]]


def fake_scontrol(folder: Path) -> Path:
    """An ``scontrol`` that writes its arguments to ``folder/called``."""
    folder.mkdir()
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" > {folder / "called"}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder / "called"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """The uninterrupted run (validations taking no time), then per case: the signalled run's rc,
    journal and newest checkpoint, and the resumed run's journal and weights."""
    root = tmp_path_factory.mktemp("prompt_save")

    def reference():
        run_trainer(root / "ref", root / "ref.jsonl", out=root / "ref.pt", args=["--val", "0"])
        return journal(root / "ref.jsonl"), weights(root / "ref.pt")

    def case(spec: str):
        folder = root / spec.replace("@", "-").replace(":", "-")
        folder.mkdir()
        env, args = {}, ["--val", str(SLOW)]
        called = None
        if spec.startswith("usr1"):
            called = fake_scontrol(folder / "bin")
            env = {"SLURM_JOB_ID": JOB, "PATH": f"{folder / 'bin'}:/usr/bin:/bin"}
        checkpoints = folder / "checkpoints"
        rc, _, stderr = run_trainer(
            checkpoints, folder / "signal.jsonl", fault=spec, expect_rc=None, args=args, env=env
        )
        newest = regular_checkpoints(checkpoints)[-1].name
        bad = unreadable(checkpoints)
        run_trainer(checkpoints, folder / "resumed.jsonl", out=folder / "out.pt", args=["--val", "0"])
        requeue = called.read_text().split() if called is not None and called.exists() else None
        resumed = journal(folder / "resumed.jsonl"), weights(folder / "out.pt")
        return rc, stderr, journal(folder / "signal.jsonl"), newest, bad, requeue, resumed

    results = in_parallel(reference, *(lambda spec=spec: case(spec) for spec in CASES))
    return {"reference": results[0], **dict(zip(CASES, results[1:]))}


@pytest.mark.parametrize("spec", CASES)
def test_a_signal_in_a_long_validation_or_an_epoch_end_hook_saves_within_2_s(single, spec):
    injected(spec)
    (ref_entries, ref_weights), (name, expected_rc) = single["reference"], CASES[spec]
    rc, stderr, entries, newest, bad, requeue, (resumed, final) = single[spec]
    fault = event(entries, "fault")
    assert fault is not None, stderr[-3000:]
    assert rc == expected_rc and event(entries, "exit")["code"] == expected_rc, stderr[-3000:]
    assert requeue == (["requeue", JOB] if spec.startswith("usr1") else None)
    assert torn(bad) == []
    commits = commits_after(entries, fault)
    assert [c["name"] for c in commits] == [name] and newest == name  # once, and the newest
    latency = commits[0]["t"] - fault["t"]
    assert latency <= LATENCY, f"committed {latency:.2f} s after the signal"
    completed = fault["completed"]
    assert step_of(Path(name)) == completed == max(losses(entries)) + 1  # 0 steps lost
    if "@val" in spec:  # the abandoned validation recorded nothing; the resumed run did it, as the reference did
        assert completed not in validations(entries) and completed in validations(resumed)
    assert validations(entries) == {k: v for k, v in validations(ref_entries).items() if k in validations(entries)}
    assert validations(resumed) == {k: v for k, v in validations(ref_entries).items() if k >= min(validations(resumed))}
    assert_same_losses(losses(resumed), losses(ref_entries))
    assert_same_weights(final, ref_weights)
    FIGURES["lost"].setdefault("SIGUSR1" if spec.startswith("usr1") else "SIGTERM", {})[spec] = completed - step_of(
        Path(name)
    )
    FIGURES["save_latency"][spec] = latency
    survived(spec)


def test_a_signal_in_the_check_before_training_leaves_the_resumed_state_as_it_is(single, tmp_path):
    # After term@val:10 left model-epoch1batch10.pt (a validation owed), a re-run gets SIGTERM while
    # its check before training reads the first validation sample: nothing to save (the state to
    # continue from is on disk), exit 143, and the next run continues exactly.
    spec = "term@check"
    injected(spec)
    checkpoints = tmp_path / "checkpoints"
    run_trainer(checkpoints, tmp_path / "first.jsonl", fault="term@val:10", expect_rc=143, args=["--val", "0"])
    before = {name: (checkpoints / name).read_bytes() for name in checkpoint_files(checkpoints)}
    rc, _, stderr = run_trainer(
        checkpoints, tmp_path / "check.jsonl", fault=spec, expect_rc=None, args=["--val", str(SLOW)]
    )
    entries = journal(tmp_path / "check.jsonl")
    assert rc == 143 and event(entries, "fault")["completed"] == 0 and "received SIGTERM" in stderr
    assert "(preempted by SIGTERM)" in stderr  # the closing line
    assert (
        not losses(entries)
        and {name: (checkpoints / name).read_bytes() for name in checkpoint_files(checkpoints)} == before
    )
    run_trainer(checkpoints, tmp_path / "final.jsonl", out=tmp_path / "out.pt", args=["--val", "0"])
    ref_entries, ref_weights = single["reference"]
    final = journal(tmp_path / "final.jsonl")
    assert event(final, "start")["resume_step"] == 10 and validations(final)[10] == validations(ref_entries)[10]
    assert_same_losses(losses(final), losses(ref_entries))
    assert_same_weights(weights(tmp_path / "out.pt"), ref_weights)
    survived(spec)


# -- 2 ranks under torchrun ------------------------------------------------------------------------
def torchrun(folder: Path, name: str, *args: str) -> tuple[int, str]:
    """trainer.py on 2 CPU ranks (gloo), its journals ``folder/name.jsonl.rank<r>``; (rc, stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAINER)]
    cmd += ["--dir", str(folder / "checkpoints"), "--journal", str(folder / f"{name}.jsonl"), *args]
    rc, _, stderr = run_process(cmd)
    return rc, stderr


def rank_journals(folder: Path, name: str) -> list[list[dict]]:
    return [journal(folder / f"{name}.jsonl.rank{r}") for r in (0, 1)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("prompt_save_ranks")
    (root / "ref").mkdir()
    (root / "run").mkdir()

    def reference():
        rc, stderr = torchrun(root / "ref", "ref", "--val", "0", "--out", str(root / "ref" / "out.pt"))
        assert rc == 0, stderr[-3000:]

    def signalled():
        rc, stderr = torchrun(
            root / "run", "signal", "--val", str(SLOW_PER_RANK), "--fault", "term@val:10", "--fault-rank", "1"
        )
        newest = regular_checkpoints(root / "run" / "checkpoints")[-1].name
        rc_resumed, resumed_err = torchrun(root / "run", "resumed", "--val", "0", "--out", str(root / "run" / "out.pt"))
        assert rc_resumed == 0, resumed_err[-3000:]
        return rc, stderr, newest

    _, (rc, stderr, newest) = in_parallel(reference, signalled)
    return {"root": root, "rc": rc, "stderr": stderr, "newest": newest}


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
def test_sigterm_on_one_of_two_ranks_in_a_long_validation_saves_once_within_2_s(ranks):
    spec = "term@val:10 (2 ranks, rank 1 only)"
    injected(spec)
    root = ranks["root"]
    signal_journals, resumed, reference = (
        rank_journals(root / d, n) for d, n in (("run", "signal"), ("run", "resumed"), ("ref", "ref"))
    )
    fault = event(signal_journals[1], "fault")
    assert fault is not None and event(signal_journals[0], "fault") is None, ranks["stderr"][-3000:]
    assert ranks["rc"] != 0  # torchrun reports its ranks' 143
    assert [event(j, "exit")["code"] for j in signal_journals] == [143, 143], ranks["stderr"][-3000:]
    commits = commits_after(signal_journals[0], fault)
    assert [c["name"] for c in commits] == ["model-epoch2batch10.pt"] == [ranks["newest"]]  # once, by rank 0
    assert not [e for e in signal_journals[1] if e.get("event") == "committed"]
    latency = commits[0]["t"] - fault["t"]
    assert latency <= LATENCY, f"committed {latency:.2f} s after the signal"
    for r in (0, 1):  # neither rank recorded the abandoned validation; the resumed ranks did it as the reference
        assert (
            10 not in validations(signal_journals[r]) and validations(resumed[r])[10] == validations(reference[r])[10]
        )
        assert max(losses(signal_journals[r])) + 1 == 10
        assert_same_losses(losses(resumed[r]), losses(reference[r]))
        suffix = f".rank{r}"
        assert_same_weights(weights(root / "run" / f"out.pt{suffix}"), weights(root / "ref" / f"out.pt{suffix}"))
    FIGURES["save_latency"][spec] = latency
    survived(spec)

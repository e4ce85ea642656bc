"""Running trainer.py in its own process and reading what it left: journals, checkpoints, weights.

Also the figures of the suite (faults injected and survived, steps lost per kill, torn
checkpoints seen), kept in tests/figures.py and printed at the end of the run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from figures import FIGURES
from fitforge.checkpoint.files import CheckpointError, load_checkpoint

HERE = Path(__file__).resolve().parent
TRAINER = HERE / "trainer.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TIMEOUT = 120  # seconds: a hang fails the test instead of blocking the suite
STEPS = 32  # 4 epochs of 8 batches
# Completed batches at which checkpoints are written: at batch_end every 3 batches, except at an
# epoch's last batch, whose state the epoch end writes (every epoch, 8 batches each).
BATCH_END_SAVES = (3, 6, 9, 12, 15, 18, 21, 27, 30)
EPOCH_END_SAVES = (8, 16, 24, 32)
_REGULAR = re.compile(r"model-epoch(\d+)batch(\d+)\.pt")


def run_process(cmd: Sequence[str], timeout: float = TIMEOUT, env: dict | None = None) -> tuple[int, str, str]:
    """Run ``cmd`` (with ``env`` added to the environment); returns (rc, stdout, stderr). Its own
    process group, killed once it ended: a SIGKILLed trainer leaves DataLoader workers behind, which
    would otherwise linger for seconds. Output goes to files, not pipes, for the same reason (the
    orphans hold a pipe open)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(
            list(cmd), stdout=out, stderr=err, env={**ENV, **(env or {})}, start_new_session=True
        )
        try:
            rc = process.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the group may be gone already
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        out.seek(0)
        err.seek(0)
        return rc, out.read().decode(errors="replace"), err.read().decode(errors="replace")


def run_trainer(
    folder: Path | str,
    log: Path,
    *,
    out: Path | None = None,
    workers: int = 0,
    fault: str = "",
    expect_rc: int | None = 0,
    wrap: Callable[[list[str]], list[str]] | None = None,
    args: Sequence[str] = (),
    env: dict | None = None,
    async_save: bool = False,
) -> tuple[int, str, str]:
    """Run trainer.py on checkpoint folder ``folder`` (a path or a URL; ``wrap`` may put a command
    in front, ``args`` are added to trainer.py's, ``env`` adds to its environment); returns (rc,
    stdout, stderr), asserting ``rc == expect_rc`` unless it is None."""
    cmd = [sys.executable, str(TRAINER), "--dir", str(folder), "--journal", str(log), "--workers", str(workers)]
    if out is not None:
        cmd += ["--out", str(out)]
    if fault:
        cmd += ["--fault", fault]
    cmd += list(args)
    if async_save:
        cmd.append("--async-save")
    rc, stdout, stderr = run_process(wrap(cmd) if wrap else cmd, env=env)
    if expect_rc is not None:
        assert rc == expect_rc, f"{' '.join(cmd)}: exit status {rc}, expected {expect_rc}\n{stderr[-4000:]}"
    return rc, stdout, stderr


def in_parallel(*calls: Callable):
    """The results of ``calls``, all run at once: each trainer is one thread, most of whose time is
    spent importing torch, so more processes than cores still share the cores fully."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def journal(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def losses(entries: list[dict]) -> dict[int, str]:
    return {entry["step"]: entry["loss"] for entry in entries if "step" in entry}


def event(entries: list[dict], name: str) -> dict | None:
    found = [entry for entry in entries if entry.get("event") == name]
    assert len(found) <= 1, found
    return found[0] if found else None


def regular_checkpoints(folder: Path) -> list[Path]:
    """The files under a checkpoint name, oldest first (by completed epochs, then batches)."""
    found = [(tuple(map(int, m.groups())), path) for path in folder.iterdir() if (m := _REGULAR.fullmatch(path.name))]
    return [path for _, path in sorted(found)]


def step_of(path: Path) -> int:
    """The B of ``model-epoch<E>batch<B>.pt``: completed batches."""
    return int(_REGULAR.fullmatch(path.name)[2])


def unreadable(folder: Path) -> list[str]:
    """The files under a checkpoint name that do not load (torn, if a crash made them)."""
    bad = []
    for path in regular_checkpoints(folder):
        try:
            load_checkpoint(path)
        except CheckpointError:
            bad.append(path.name)
    return bad


def torn(names: list[str]) -> list[str]:
    """``names`` (unreadable files found after a crash), counted in the figures."""
    FIGURES["torn"] += len(names)
    return names


def newest_saved(where: str, step: int) -> int | None:
    """The newest checkpoint written when a fault comes at ``where`` ("begin", "end" or
    "epoch_end") of 0-based global step ``step`` (for "epoch_end": after ``step`` batches), after
    the CheckpointHandler's hook of that event (None: none yet)."""
    batch_end = step + 1 if where == "end" else step
    saved = [s for s in BATCH_END_SAVES if s <= batch_end] + [s for s in EPOCH_END_SAVES if s <= step]
    return max(saved, default=None)


def weights(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def assert_same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key} differs from the uninterrupted run"


def assert_same_losses(logged: dict[int, str], reference: dict[int, str]) -> None:
    """Every logged step's loss is bitwise the uninterrupted run's at that step."""
    wrong = {step: (loss, reference.get(step)) for step, loss in logged.items() if reference.get(step) != loss}
    assert not wrong, f"steps whose loss differs from the uninterrupted run (got, want): {wrong}"


def injected(name: str) -> None:
    FIGURES["injected"].append(name)


def survived(name: str) -> None:
    FIGURES["survived"].append(name)

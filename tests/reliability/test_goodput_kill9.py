"""Where the time went, across a kill -9 and a resume (the run's clock, fitforge.core.clock.RunClock):
a loader that sleeps 20 ms a batch and checkpoint writes that sleep 300 ms each are reported within 5
points of their true shares of the run, the totals survive the resume, and the advice on waiting for data
is printed once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from harness import run_process

pytestmark = pytest.mark.integration  # trainer processes

SCRIPT = str(Path(__file__).resolve().parent / "goodput_run.py")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import goodput_run as run  # noqa: E402


def test_the_shares_of_the_run_survive_a_kill_and_name_the_data_wait(tmp_path):
    folder, out, killed, resumed = tmp_path / "checkpoints", tmp_path / "totals.json", tmp_path / "1", tmp_path / "2"
    code, _, _ = run_process([sys.executable, SCRIPT, str(folder), str(out), str(killed), str(run.PERIOD)])
    assert code == -9 and not out.exists()  # killed right after its checkpoint of batch 30
    code, stdout, stderr = run_process([sys.executable, SCRIPT, str(folder), str(out), str(resumed)])
    assert code == 0, stderr[-3000:]
    totals = json.loads(out.read_text())
    wall = totals["wall"]
    # The truth, as long as the sleeps really took: the 60 batches' 20 ms waits, the killed run's 30
    # included (its clock is in its checkpoint); the checkpoints' 300 ms writes at the ends of the 3
    # epochs, not that of batch 30 (its clock was taken before its own write, and the run then killed).
    sleeps = [line.split() for path in (killed, resumed) for line in path.read_text().splitlines()]
    writes = [float(seconds) for kind, seconds in sleeps if kind == "write"]
    assert len(writes) == 4 and len([kind for kind, _ in sleeps if kind == "data"]) == run.EPOCHS * run.BATCHES
    lost = [float(seconds) for kind, seconds in (line.split() for line in killed.read_text().splitlines())][-1]
    truth = {"data": sum(float(s) for kind, s in sleeps if kind == "data"), "checkpoint": sum(writes) - lost}
    for cause, seconds in truth.items():
        assert abs(totals[cause] / wall - seconds / wall) <= 0.05, (cause, totals)
    assert totals["replay"] > 0  # the resume's loading
    assert sum(totals[c] for c in totals if c != "wall") <= wall
    log = stdout + stderr
    assert log.count("Waiting for data took") == 1, log[-3000:]
    assert "most lost: waiting for data" in log

"""Every stateful component survives a checkpoint round trip (roundtrip.py, in its own process):
each one is perturbed before the load (so the test would fail if any were not restored), and
equal to the state at the checkpoint after it."""

from __future__ import annotations

import json
import sys

import pytest
from harness import HERE, run_process

pytestmark = pytest.mark.integration  # the load runs in a fresh process (roundtrip.py)

COMPONENTS = {
    "weights",
    "adam",
    "grad_scaler",
    "lr_scheduler (user handler)",
    "early_stopping",
    "checkpoint_best",
    "metric_sums",
    "history",
    "rng_python",
    "rng_numpy",
    "rng_torch",
    "counters",
    "data_order_seed",
    "next_batch",
}


def test_every_stateful_component_is_perturbed_then_restored(tmp_path):
    rc, stdout, stderr = run_process([sys.executable, str(HERE / "roundtrip.py"), str(tmp_path)])
    assert rc == 0, stderr[-4000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert set(report) == COMPONENTS
    assert [name for name, found in report.items() if not found["perturbed"]] == []  # else the check proves nothing
    assert [name for name, found in report.items() if not found["restored"]] == []

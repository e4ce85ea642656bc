"""benchmarks/nan_guard.py on a tiny workload: every variant runs and the host reads per batch are as
docs/checkpoints.md states (no timing is asserted)."""

import pytest

from helpers import load_benchmark

pytestmark = pytest.mark.integration  # runs the benchmarks


def test_the_guard_benchmark_counts_the_reads_each_policy_costs():
    result = load_benchmark("nan_guard").measure(["mlp"], repeats=1, samples=256)["results"]["mlp"]
    rows = result["variants"]
    assert result["batches"] == 4 and len(rows) == 6
    batches = result["batches"]
    extra = {
        name: round(
            (row["host_reads_per_batch"] - rows[f"none, {name.split(', ')[1]}"]["host_reads_per_batch"]) * batches
        )
        for name, row in rows.items()
    }
    # "stop" reads its record once per epoch; the host decides every batch for "skip", and for any
    # policy when the optimizer cannot skip a step on the device (foreach).
    assert extra == {
        "none, fused": 0,
        "stop, fused": 1,
        "skip, fused": batches,
        "none, foreach": 0,
        "stop, foreach": batches + 1,
        "skip, foreach": batches,
    }

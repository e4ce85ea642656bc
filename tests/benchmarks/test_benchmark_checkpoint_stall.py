"""benchmarks/checkpoint_stall.py on a tiny net: both variants save the planned number of times and
the table prints (no timing is asserted)."""

import pytest

from helpers import load_benchmark

pytestmark = pytest.mark.integration  # runs the benchmarks


def test_the_stall_benchmark_times_every_save_of_both_variants():
    stall = load_benchmark("checkpoint_stall")
    result = stall.measure(width=8, layers=2, saves=2, period=2, batch=4, device="cpu")
    assert [len(result[variant]["stall_ms"]) for variant in ("sync", "async")] == [2, 2]
    assert result["parameters"] == 2 * (8 * 8 + 8) and result["ratio"] > 0
    assert "| async |" in stall.table(result)

"""benchmarks/fault_tolerance.py at a debug size: DDP under torchrun and FaultTolerantStrategy's replica
groups both train, and the table reports each (no timing is asserted; the figures are in
docs/performance.md)."""

import argparse

import pytest

from helpers import load_benchmark

pytestmark = pytest.mark.integration  # runs the benchmark: torchrun, a lighthouse and replica groups
pytest.importorskip("torchft")


def test_both_engines_run_and_are_reported():
    bench = load_benchmark("fault_tolerance")
    args = argparse.Namespace(steps=8, warmup=2, width=16, layers=1, batch=4, processes=2, runs=1)
    result = bench.measure(args)
    assert [run["engine"] for run in result["runs"]] == ["ddp", "ft"]
    assert all(run["ms_per_step"] > 0 and run["timed_steps"] == 5 for run in result["runs"])
    assert set(result["runs"][1]["calls_ms"]) == set(bench.FT_CALLS)
    assert "FT/DDP" in bench.table(result)

"""benchmarks/dispatch.py runs and reports a cost per handler call (no timing is asserted)."""

import pytest

from helpers import load_benchmark

pytestmark = pytest.mark.integration  # runs the benchmarks


def test_dispatch_benchmark_reports_every_count():
    module = load_benchmark("dispatch")
    result = module.measure([0, 2, 5], batches=20, repeats=1)
    assert set(result["epoch_seconds"]) == {0, 2, 5} and set(result["ns_per_handler_call"]) == {2, 5}
    assert result["ns_per_batch_without_handlers"] > 0

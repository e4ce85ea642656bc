"""benchmarks/dispatch.py runs and reports a cost per handler call (no timing is asserted)."""

import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "dispatch.py"


def test_dispatch_benchmark_reports_every_count():
    spec = importlib.util.spec_from_file_location("dispatch_benchmark", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.measure([0, 2, 5], batches=20, repeats=1)
    assert set(result["epoch_seconds"]) == {0, 2, 5} and set(result["ns_per_handler_call"]) == {2, 5}
    assert result["ns_per_batch_without_handlers"] > 0

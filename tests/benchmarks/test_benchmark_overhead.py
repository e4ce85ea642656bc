"""benchmarks/overhead.py's pieces run on a tiny workload: every variant reaches the same loss, the
host reads are counted and peak memory is measured (no timing is asserted)."""

import pytest

from helpers import load_benchmark


@pytest.fixture(scope="module")
def overhead():
    return load_benchmark("overhead")


@pytest.fixture()
def tiny(overhead):
    workload = overhead.WORKLOADS["A"]._replace(train_samples=256, val_samples=128)
    return workload, *overhead.make_loaders(workload, 1.0)


def test_every_variant_does_the_same_arithmetic(overhead, tiny):
    losses = {v: overhead.prepare(v, *tiny)() for v in overhead.VARIANTS}
    assert len({round(loss, 6) for loss in losses.values()}) == 1


def test_host_reads_are_counted_per_variant(overhead, tiny):
    reads = overhead.host_reads(*tiny)
    # One read per value per epoch in both; fit adds two once per fit, the first batch's checks (nan/inf in
    # the data, class labels in range). tests/handlers/test_host_reads.py checks nothing grows with the batches.
    assert reads["fit lean"] == reads["hand"] + 2 and reads["hand"] > 0


def test_peak_memory_is_measured_for_each_variant(overhead, tiny):
    if overhead._malloc_in_use() is None:
        pytest.skip("glibc mallinfo2 is not available here")
    peaks = {v: overhead.measure_peak(v, *tiny) for v in overhead.VARIANTS}
    assert all(isinstance(p, int) and p > 0 for p in peaks.values()), peaks

"""benchmarks/overhead.py's pieces run on a tiny workload: every variant reaches the same loss, the
host reads are counted and peak memory is measured (no timing is asserted)."""

from types import SimpleNamespace

import pytest
import torch

from helpers import load_benchmark

pytestmark = pytest.mark.integration  # runs the benchmarks


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_variant_does_the_same_arithmetic_on_cuda(overhead):
    workload = overhead.WORKLOADS["A"]._replace(train_samples=256, val_samples=128)
    train, val = overhead.make_loaders(workload, 1.0, "cuda")
    assert train.pin_memory
    losses = {v: overhead.prepare(v, workload, train, val, "cuda")() for v in overhead.VARIANTS}
    assert max(losses.values()) - min(losses.values()) <= 1e-4 * abs(losses["hand"])


def test_host_reads_are_counted_per_variant(overhead, tiny):
    reads = overhead.host_reads(*tiny)
    # One read per value per epoch in both; fit adds one once per fit, the first batch's nan/inf check (on
    # the CPU torch's loss checks the class range itself). The hand loop's DataLoader reads the worker seed
    # it draws at each pass (2 epochs); fit, reading these loaders by indexing, draws it without reading it.
    # tests/handlers/test_host_reads.py checks nothing grows with the batches.
    assert reads["fit lean"] == reads["hand"] + 1 - 2 and reads["hand"] > 0


def test_sample_reads_make_fit_read_the_batches_as_the_hand_loop(overhead, tiny):
    from fitforge.inputs.indexed import readable

    workload = tiny[0]
    assert all(readable(loader) for loader in overhead.make_loaders(workload, 1.0))
    sample_reads = overhead.make_loaders(workload, 1.0, sample_reads=True)
    assert not any(readable(loader) for loader in sample_reads)
    reads = overhead.host_reads(workload, *sample_reads)
    # Read sample by sample by fit itself (a plain single-process loader): the worker seed drawn, not read.
    assert reads["fit lean"] == reads["hand"] + 1 - 2
    losses = {v: overhead.prepare(v, workload, *sample_reads)() for v in overhead.VARIANTS}
    assert len({round(loss, 6) for loss in losses.values()}) == 1


def test_peak_memory_is_measured_for_each_variant(overhead, tiny):
    if overhead._malloc_in_use() is None:
        pytest.skip("glibc mallinfo2 is not available here")
    peaks = {v: overhead.measure_peak(v, *tiny) for v in overhead.VARIANTS}
    assert all(isinstance(p, int) and p > 0 for p in peaks.values()), peaks


def test_workload_z_is_one_train_and_one_val_batch_and_reports_a_fixed_cost_per_fit(overhead, monkeypatch):
    # The collection before each of the 400 runs walks every object the suite's process holds (most
    # of two minutes here); none is timed, so the structure is checked without them.
    monkeypatch.setattr(overhead, "gc", SimpleNamespace(collect=lambda *args, **kwargs: 0))
    train, val = overhead.make_loaders(overhead.WORKLOADS["Z"], 1.0)
    assert len(train) == len(val) == 1
    result = overhead.bench("Z", repeats=1, fraction=1.0)
    assert result["repeats"] == 101 and len(result["wall_s"]["fit default"]) == 101  # at least 101 pairs
    assert isinstance(result["default"]["fixed_cost_us_per_fit"], float)
    assert len({round(loss, 6) for loss in result["final_train_loss"].values()}) == 1

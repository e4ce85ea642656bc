"""benchmarks/instructions.py: the valgrind runs take minutes, so only its refusals are tested here;
the counts it printed are in docs/performance.md."""

from unittest import mock

import pytest

from helpers import load_benchmark

pytestmark = pytest.mark.integration  # runs the benchmarks


def load():
    return load_benchmark("instructions")


def test_missing_tools_are_named(tmp_path):
    module = load()
    with mock.patch.object(module.shutil, "which", return_value=None), pytest.raises(SystemExit) as exit_:
        module.build_helper(tmp_path)
    assert "needs valgrind and cc on PATH" in str(exit_.value)


def test_it_counts_the_variants_of_overhead_py():
    overhead = load().load_overhead()
    assert set(overhead.VARIANTS) == {"fit default", "hand + val", "fit lean", "hand"}


def test_every_piece_it_counts_runs():
    module = load()
    calls = module.pieces(module.load_overhead())
    assert "validation check before training" in calls
    for call in calls.values():
        call()  # what the valgrind process counts, uncounted here

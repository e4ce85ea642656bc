"""benchmarks/instructions.py: the valgrind runs take minutes, so only its refusals are tested here;
the counts it printed are in docs/performance.md."""

import importlib.util
from pathlib import Path
from unittest import mock

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "instructions.py"


def load():
    spec = importlib.util.spec_from_file_location("instructions_benchmark", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_missing_tools_are_named(tmp_path):
    module = load()
    with mock.patch.object(module.shutil, "which", return_value=None), pytest.raises(SystemExit) as exit_:
        module.build_helper(tmp_path)
    assert "needs valgrind and cc on PATH" in str(exit_.value)


def test_the_variants_are_overheads(tmp_path):
    overhead = load().load_overhead()
    assert set(overhead.VARIANTS) == {"fit default", "hand + val", "fit lean", "hand"}

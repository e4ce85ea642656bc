"""benchmarks/fixed_cost.py switches off parts that exist where fit looks them up, puts them back,
and each switched-off fit still trains (no timing is asserted)."""

import importlib
from types import SimpleNamespace

import pytest

from helpers import load_benchmark

pytestmark = pytest.mark.integration  # runs the benchmarks


@pytest.fixture(scope="module")
def fixed_cost():
    return load_benchmark("fixed_cost")


def test_every_part_it_switches_off_is_where_fit_looks_it_up(fixed_cost):
    for row, parts in fixed_cost.PARTS.items():
        for module_name, name, _ in parts:
            assert callable(getattr(importlib.import_module(module_name), name)), (row, module_name, name)


def test_each_row_runs_and_puts_the_parts_back(fixed_cost, monkeypatch):
    monkeypatch.setattr(fixed_cost, "gc", SimpleNamespace(collect=lambda *args, **kwargs: 0))  # see overhead's test
    before = {
        (m, n): getattr(importlib.import_module(m), n) for parts in fixed_cost.PARTS.values() for m, n, _ in parts
    }
    results = list(fixed_cost.measure(["warm", *fixed_cost.PARTS], count=2))
    assert [row for row, _ in results] == ["base", "warm", *fixed_cost.PARTS, "base"]
    assert all(result["ratio"] > 0 and result["fit_us"] > 0 for _, result in results)
    assert {(m, n): getattr(importlib.import_module(m), n) for m, n in before} == before


def test_an_unknown_row_is_named(fixed_cost, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["fixed_cost.py", "val_checks"])
    with pytest.raises(SystemExit):
        fixed_cost.main()
    assert "unknown rows ['val_checks']" in capsys.readouterr().err

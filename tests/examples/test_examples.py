"""The examples run end to end (short runs; the full runs are in their docs)."""

import importlib.util
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # trains the examples

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_smoke_learns_and_writes_the_plot(tmp_path, capsys):
    pytest.importorskip("sklearn")
    plot = tmp_path / "history.png"
    accuracy = load("quickstart").main(["--smoke", "--plot", str(plot)])
    assert not math.isnan(accuracy) and accuracy > 0.5  # one epoch; chance is 0.1
    assert plot.stat().st_size > 1000
    out = capsys.readouterr().out
    assert f"validation accuracy: {accuracy:.4f}" in out and str(plot) in out

"""What a notebook shows and stores: each bar is one cell output redrawn in place, that keeps the
finished line as text (or is emptied for the log line); no tqdm widget warning; fit's last line
before what the cell prints after it. The display is faked here; a real kernel runs at the end."""

import io
import json
import logging
import os
import sys
import types
import warnings
from pathlib import Path

import pytest

import fitforge
from fitforge.handlers import LoggingHandler, ProgressBarHandler
from fitforge.reporting.notebook_output import CellLine
from helpers import make_estimator, regression_batches


class ZMQInteractiveShell:
    config = frozenset()


class FakeDisplay:
    """IPython.display's ``display`` with ``display_id=True``: each output's contents, in order."""

    def __init__(self):
        self.outputs = []

    def display(self, obj, raw=False, display_id=None):
        assert display_id is True
        contents = [obj]
        self.outputs.append(contents)
        return types.SimpleNamespace(update=lambda new, raw=False: contents.append(new))

    def final(self):
        return [contents[-1] for contents in self.outputs]


@pytest.fixture
def cell(monkeypatch):
    """A notebook kernel without ipywidgets, its display faked."""
    from tqdm import notebook

    fake = FakeDisplay()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
    monkeypatch.setitem(sys.modules, "IPython.display", types.SimpleNamespace(display=fake.display))
    monkeypatch.setattr(notebook, "IProgress", None)
    clock = iter(range(100_000))  # every batch refreshes the bar
    monkeypatch.setattr("fitforge.handlers.progress_bar.time.monotonic", lambda: float(next(clock)))
    return fake


def test_each_bar_is_one_output_that_keeps_the_finished_line(cell):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "IProgress not found"
        make_estimator().fit(regression_batches(4), epochs=2, event_handlers=[ProgressBarHandler()])
    assert len(cell.outputs) == 2  # one per epoch (the tests' log is at WARNING: the bar is the epoch's line)
    for epoch, contents in enumerate(cell.outputs, start=1):
        assert contents[0] == {"text/plain": ""} and len(contents) > 4  # shown empty, redrawn in place
        assert all("\r" not in text["text/plain"] for text in contents)
        assert contents[-1]["text/plain"].startswith(f"Epoch {epoch}/2: 100%|")
        assert contents[-1]["text/plain"].endswith("train_mae=" + contents[-1]["text/plain"].split("train_mae=")[1])


def test_the_bar_empties_its_output_for_the_log_line(cell, caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        make_estimator().fit(regression_batches(4), epochs=2, event_handlers=[ProgressBarHandler(), LoggingHandler()])
        make_estimator().evaluate(regression_batches(2), event_handlers=[ProgressBarHandler()])
    assert cell.final() == [{"text/plain": ""}] * 3  # two epochs, then evaluate's pass
    assert any(text["text/plain"].startswith("Validate: ") for text in cell.outputs[2])


def test_a_stream_given_in_a_notebook_draws_as_anywhere(cell):
    file = io.StringIO()  # no terminal: no redraws, the finished line once
    make_estimator().fit(regression_batches(4), epochs=2, event_handlers=[ProgressBarHandler(file=file)])
    assert cell.outputs == [] and "\r" not in file.getvalue() and len(file.getvalue().splitlines()) == 2


def test_with_ipywidgets_the_widget_runs_and_text_is_stored(cell, monkeypatch):
    from tqdm import notebook
    from tqdm.std import tqdm

    made = []

    class WidgetBar(tqdm):  # tqdm's widget bar as the handler uses it: shown by the handler, then closed
        def __init__(self, *args, display=True, **kwargs):
            assert display is False and kwargs["leave"] is False
            super().__init__(*args, file=io.StringIO(), **kwargs)
            self.container = "the widget"
            made.append(self)

    monkeypatch.setattr(notebook, "IProgress", object)
    monkeypatch.setattr(notebook, "tqdm", WidgetBar)
    make_estimator().fit(regression_batches(4), epochs=2, event_handlers=[ProgressBarHandler()])
    assert len(made) == 2 and all(bar.disable for bar in made)  # closed
    for epoch, contents in enumerate(cell.outputs, start=1):
        assert contents[0] == "the widget" and len(contents) == 2  # the widget, then the text stays
        text = contents[1]["text/plain"]
        assert text.startswith(f"Epoch {epoch}/2: 100%|") and "train_loss=" in text


def test_a_cell_line_is_what_a_terminal_would_show(cell):
    line = CellLine()
    assert line.write("\rEpoch 1:  50%|     | 1/2  ") == 27
    line.write("\n")  # ends the line: no change
    line.write("\rEpoch 1: 100%|#####| 2/2")
    line.show("Epoch 1: 100%|#####| 2/2")  # unchanged: nothing sent
    line.flush()
    shown = ["", "Epoch 1:  50%|     | 1/2", "Epoch 1: 100%|#####| 2/2"]
    assert cell.outputs == [[{"text/plain": text} for text in shown]]


# -- a real notebook, executed headlessly ------------------------------------------------------------

NOTEBOOK = """
import torch
from tqdm import notebook

assert (notebook.IProgress is not None) == WIDGETS
from torch import nn
from fitforge import Estimator
from fitforge.handlers import ProgressBarHandler

torch.manual_seed(0)
x = torch.rand(64, 1)
data = [(x[i : i + 16], 2 * x[i : i + 16] + 3) for i in range(0, 64, 16)]
net = nn.Linear(1, 1)
estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
estimator.fit(data, val_data=data[:1], epochs=3, event_handlers=[ProgressBarHandler(refresh_seconds=0)])
print("after fit")
"""

QUIET = """
import logging

logging.getLogger("fitforge").setLevel(logging.WARNING)  # no log lines: each bar is its epoch's line
estimator.fit(data, epochs=2, event_handlers=[ProgressBarHandler(refresh_seconds=0)])
print("after the quiet fit")
"""


def kernel(tmp_path):
    """A kernel spec running this Python (so the kernel imports the fitforge under test), found
    through JUPYTER_PATH; no `ipykernel install`, and no user kernel named python3 can stand in."""
    spec = tmp_path / "jupyter" / "kernels" / "fitforge-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "fitforge", "language": "python"}))
    source = str(Path(fitforge.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])]),
        "IPYTHONDIR": str(tmp_path / "ipython"),  # no startup files of the user's profile
        "OMP_NUM_THREADS": "1",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    }
    return "fitforge-test", str(tmp_path / "jupyter"), env


def texts(outputs):
    """Each output as ``(kind, text)``: a stream's name, or ``display`` for a display's text."""
    return [
        (out["name"], out["text"]) if out["output_type"] == "stream" else ("display", out["data"]["text/plain"])
        for out in outputs
    ]


@pytest.mark.integration  # a notebook kernel
@pytest.mark.parametrize("widgets", [False, True], ids=["without ipywidgets", "with ipywidgets"])
def test_a_notebook_run_headlessly_stores_every_epoch_as_text(tmp_path, monkeypatch, widgets):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    if widgets:
        pytest.importorskip("ipywidgets")  # not in the test extra: runs where it is installed
    # Without: as if it were not installed, wherever the test runs.
    hide = "" if widgets else 'import sys\nsys.modules["ipywidgets"] = None\n'
    name, jupyter_path, env = kernel(tmp_path)
    monkeypatch.setenv("JUPYTER_PATH", jupyter_path)
    notebook = nbformat.v4.new_notebook()
    source = f"{hide}WIDGETS = {widgets}\n{NOTEBOOK}"
    notebook.cells = [nbformat.v4.new_code_cell(source), nbformat.v4.new_code_cell(QUIET)]
    resources = {"metadata": {"path": str(tmp_path)}}  # the kernel's working folder
    client = nbclient.NotebookClient(notebook, kernel_name=name, timeout=120, resources=resources)
    client.execute(env=env)
    nbformat.validate(notebook)

    first, quiet = (texts(cell.outputs) for cell in notebook.cells)
    everything = json.dumps([first, quiet])
    assert "IProgress" not in everything and "\\r" not in everything and "Traceback" not in everything
    logged = "".join(text for kind, text in first if kind == "stderr")
    for epoch in (1, 2, 3):
        assert logged.count(f"[Epoch {epoch}/3] train_loss=") == 1 and f"(Epoch {epoch}/3" not in logged
    assert len(first) <= 2 * 3 + 3  # a bar and a line per epoch at most, the first lines, the print
    assert first[-1] == ("stdout", "after fit\n") and "Finished: 3 epochs" in first[-2][1]
    assert [text for kind, text in first if kind == "display"] == ["", "", ""]  # emptied for the log lines

    bars = [text for kind, text in quiet if kind == "display"]
    assert [bar.split(":")[0] for bar in bars] == ["Epoch 4/5", "Epoch 5/5"]
    assert all("100%|" in bar and "train_loss=" in bar and "train_mae=" in bar for bar in bars)
    assert quiet[-1] == ("stdout", "after the quiet fit\n") and len(quiet) == 3

"""LivePlotHandler: a PNG replaced each epoch when headless, an in-place display in a notebook."""

import sys
import types

import pytest

from fitforge.events import EpochEnd
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import LivePlotHandler, ValidationHandler
from fitforge.handlers import live_plot as live_plot_module
from helpers import make_estimator, regression_batches

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


class FileEachEpoch(EpochEnd):
    """The PNG's bytes after each epoch (runs after the live plot)."""

    priority = 2000

    def __init__(self, path):
        self.path, self.seen = path, []

    def epoch_end(self, state):
        self.seen.append(self.path.read_bytes())


@pytest.fixture
def drawn(monkeypatch):
    """(epochs in the history, panel titles, points per curve) of every drawing."""
    calls = []
    draw = live_plot_module.draw_history

    def recording(figure, history, names):
        draw(figure, history, names)
        points = [len(line.get_xdata()) for ax in figure.axes for line in ax.get_lines()]
        calls.append((history.epochs, [ax.get_title() for ax in figure.axes], points))

    monkeypatch.setattr(live_plot_module, "draw_history", recording)
    return calls


def test_headless_writes_and_replaces_a_png_each_epoch(tmp_path, monkeypatch, drawn):
    import matplotlib
    import matplotlib.pyplot as plt

    monkeypatch.chdir(tmp_path)
    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    spy = FileEachEpoch(tmp_path / "fitforge-live.png")
    make_estimator().fit(
        regression_batches(2), val_data=regression_batches(1), epochs=3, event_handlers=[LivePlotHandler(), spy]
    )
    assert [png[:8] for png in spy.seen] == [PNG] * 3 and len(set(spy.seen)) == 3  # a new image each epoch
    assert [path.name for path in tmp_path.iterdir()] == ["fitforge-live.png"]  # no temporary file left
    assert drawn == [(1, ["loss", "mae"], [1] * 4), (2, ["loss", "mae"], [2] * 4), (3, ["loss", "mae"], [3] * 4)]
    assert matplotlib.get_backend() == backend and plt.get_fignums() == figures  # pyplot untouched


def test_a_path_and_keys(tmp_path, drawn):
    path = tmp_path / "plots" / "curves.png"
    handlers = [LivePlotHandler(path, keys=["loss"]), ValidationHandler(regression_batches(1), epoch_period=2)]
    make_estimator().fit(regression_batches(2), epochs=2, event_handlers=handlers, check_access=True)
    assert path.read_bytes()[:8] == PNG
    assert [(epochs, titles) for epochs, titles, _ in drawn] == [(1, ["loss"]), (2, ["loss"])]
    assert drawn[-1][2] == [2, 2]  # train and val curves (val nan in epoch 1)


def test_an_unknown_key_fails_at_fit_start(tmp_path):
    est = make_estimator()
    before = est.net.weight.detach().clone()
    with pytest.raises(FitforgeValueError, match=r"LivePlotHandler: keys \['acc'\] are no metric this fit records; "):
        est.fit(regression_batches(2), epochs=1, event_handlers=[LivePlotHandler(tmp_path / "x.png", keys=["acc"])])
    assert est.net.weight.detach().equal(before)


class FakeDisplay:
    """IPython.display's ``display``, ``Image`` and handles, recording what a notebook would show."""

    def __init__(self):
        self.shown, self.updates = [], []

    def module(self):
        owner = self

        class Handle:
            def update(self, obj, raw=False):
                if not raw:
                    owner.updates.append(obj)

        def display(obj, display_id=None, raw=False):
            assert display_id is True
            if not raw:  # raw text: the progress bar's output (a notebook gets one by default)
                owner.shown.append(obj)
            return Handle()

        return types.SimpleNamespace(display=display, Image=lambda data, format: (format, data))


def test_a_notebook_redraws_in_place(tmp_path, monkeypatch, drawn):
    class ZMQInteractiveShell:
        pass

    fake = FakeDisplay()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
    monkeypatch.setitem(sys.modules, "IPython.display", fake.module())
    monkeypatch.chdir(tmp_path)
    handler = LivePlotHandler()
    make_estimator().fit(regression_batches(2), epochs=3, event_handlers=[handler])
    assert len(fake.shown) == 1 and len(fake.updates) == 2  # shown once, then replaced
    assert all(kind == "png" and data[:8] == PNG for kind, data in fake.shown + fake.updates)
    assert list(tmp_path.iterdir()) == []  # no file unless a path is given
    make_estimator().fit(regression_batches(2), epochs=1, event_handlers=[handler])
    assert len(fake.shown) == 2  # the next fit (the next cell) shows its own


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"path": 3}, FitforgeTypeError, "path must be a file path or None, got"),
        ({"keys": "loss"}, FitforgeTypeError, "keys must be a list of metric names or None, got 'loss'"),
        ({"keys": []}, FitforgeValueError, r"keys must name at least one metric, got \[\]"),
    ],
)
def test_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=f"LivePlotHandler: {message}"):
        LivePlotHandler(**kwargs)


def test_needs_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"LivePlotHandler needs matplotlib: pip install 'fitforge\[plot\]'"):
        LivePlotHandler()

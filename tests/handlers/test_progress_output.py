"""What the progress bar leaves on screen: one line per epoch on a terminal, no redraws in a file
(notebooks: test_notebook_output.py)."""

import io
import logging
import re
import sys
import types

import pytest

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import LoggingHandler, ProgressBarHandler, progress_bar
from helpers import make_estimator, regression_batches

METRICS = ["mae", "mse", "rmse"]  # a postfix longer than 80 columns


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def every_batch_refreshes(monkeypatch):
    clock = iter(range(100_000))
    monkeypatch.setattr(progress_bar.time, "monotonic", lambda: float(next(clock)))


def screen(text):
    """The lines a terminal shows once ``text`` is drawn: each line is what its last carriage
    return left (tqdm clears a bar with spaces); blank lines dropped."""
    lines = [line.split("\r")[-1].rstrip() for line in text.split("\n")]
    return [line for line in lines if line]


def terminal(monkeypatch):
    """Make this an unconfigured process whose stderr is a ``FakeTerminal`` (where fitforge's own
    console output prints), from the test's body: pytest's capture resets sys.stderr after fixtures."""
    stream = FakeTerminal()
    logger = logging.getLogger("fitforge")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    monkeypatch.setattr(sys, "stderr", stream)
    every_batch_refreshes(monkeypatch)
    return stream


def fit(handlers, epochs=3, **kwargs):
    est = make_estimator(train_metrics=METRICS, **kwargs)
    return est.fit(regression_batches(4), epochs=epochs, event_handlers=handlers)


def test_a_terminal_shows_one_line_per_epoch(monkeypatch):
    console = terminal(monkeypatch)
    fit([ProgressBarHandler(refresh_seconds=0.5, ncols=80)])
    shown = screen(console.getvalue())
    assert len(shown) == 6
    assert shown[:2] == [
        "Model: Linear, 2 parameters (2 trainable), 8 B, on cpu, float32",
        "Training for 3 epochs, 4 batches per epoch",
    ]
    assert [line.split("]")[0] for line in shown[2:5]] == ["[Epoch 1/3", "[Epoch 2/3", "[Epoch 3/3"]
    assert shown[5].startswith("Finished: 3 epochs, 12 batches")
    assert "Epoch 1/3:" in console.getvalue()  # the bar was drawn, then replaced by the line


def test_running_values_never_squeeze_the_bar(monkeypatch):
    console = terminal(monkeypatch)
    fit([ProgressBarHandler(refresh_seconds=0.5, ncols=80)], epochs=1)
    draws = [d for d in re.split(r"[\r\n]", console.getvalue()) if d.startswith("Epoch 1/1:")]
    assert len(draws) >= 4  # a refresh per batch
    for draw in draws:
        assert len(draw) <= 80
        cells = re.search(r"\|(.*)\|", draw).group(1)
        assert len(cells) >= 10, draw
    assert any(re.search(r"train_loss=\S+ .*…\]$", draw) for draw in draws)  # whole pairs, then the mark
    assert not any(re.search(r"=\S*…", draw) for draw in draws)  # never a cut value


def test_leave_keeps_the_bar_beside_the_line(monkeypatch):
    console = terminal(monkeypatch)
    fit([ProgressBarHandler(refresh_seconds=0.5, ncols=80, leave=True)], epochs=2)
    shown = screen(console.getvalue())
    assert sum(line.startswith("Epoch ") for line in shown) == 2
    assert sum(line.startswith("[Epoch ") for line in shown) == 2
    kinds = [line[:8] for line in shown if line.startswith(("Epoch ", "[Epoch "))]
    assert kinds == ["Epoch 1/", "[Epoch 1", "Epoch 2/", "[Epoch 2"]  # each bar ends above its line


def test_without_epoch_lines_the_finished_bar_is_the_epochs_line(monkeypatch):
    console = terminal(monkeypatch)
    logging.getLogger("fitforge").setLevel(logging.WARNING)  # the log's epoch lines are off
    fit([ProgressBarHandler(refresh_seconds=0.5, ncols=80)])
    shown = screen(console.getvalue())
    assert [line[:10] for line in shown] == ["Epoch 1/3:", "Epoch 2/3:", "Epoch 3/3:"]


def test_a_file_gets_no_redraws(monkeypatch):
    every_batch_refreshes(monkeypatch)
    file = io.StringIO()
    reads = []
    monkeypatch.setattr(
        "fitforge.core.state.TrainState.running_metrics", lambda self: reads.append(1) or {"train_loss": 1.0}
    )
    fit([ProgressBarHandler(refresh_seconds=0.5, file=file)])
    text = file.getvalue()
    assert "\r" not in text and not reads  # nothing is drawn mid-epoch, so no running value is read
    lines = text.splitlines()  # the tests' log is at WARNING: the bar is the epoch's line, once
    assert [line[:10] for line in lines] == ["Epoch 1/3:", "Epoch 2/3:", "Epoch 3/3:"]
    assert all(re.search(r"4/4 .*train_loss=\S+ train_mae=\S+ train_mse=\S+ train_rmse=\S+\]$", x) for x in lines)


def test_a_file_beside_epoch_lines_gets_nothing(caplog):
    file = io.StringIO()
    with caplog.at_level(logging.INFO, logger="fitforge"):
        fit([ProgressBarHandler(file=file), LoggingHandler()])
    assert file.getvalue() == ""
    assert len([r for r in caplog.records if r.getMessage().startswith("[Epoch")]) == 3


class ZMQInteractiveShell:
    config = frozenset()


def fake_ipython(shell):
    return types.SimpleNamespace(get_ipython=lambda: shell)


def test_notebook_detection(monkeypatch):
    class Shell:
        config = frozenset({"IPKernelApp"})  # a kernel whose shell has another name (Colab's)

    class TerminalInteractiveShell:
        config = frozenset()

    for shell, expected in [(Shell(), True), (TerminalInteractiveShell(), False), (None, False)]:
        monkeypatch.setitem(sys.modules, "IPython", fake_ipython(shell))
        assert progress_bar.in_notebook() is expected


def test_fitted_values_whole_pairs(monkeypatch):
    from tqdm.std import tqdm

    bar = tqdm(total=10, desc="Epoch 1/3", file=io.StringIO(), ncols=80)
    values = {"train_loss": 0.6931, "train_accuracy": 0.5, "val_loss": 0.7}
    assert progress_bar.fitted(bar, values, None) == "train_loss=0.6931 train_accuracy=0.5000 val_loss=0.7000"
    assert progress_bar.fitted(bar, values, 200) == "train_loss=0.6931 train_accuracy=0.5000 val_loss=0.7000"
    assert progress_bar.fitted(bar, values, 80) == "train_loss=0.6931 …"
    assert progress_bar.fitted(bar, values, 40) == ""
    bar.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"leave": 1}, FitforgeTypeError, "leave must be True, False or None, got"),
        ({"file": "out.txt"}, FitforgeTypeError, "file must be a text stream or None, got"),
        ({"ncols": 0}, FitforgeValueError, "ncols must be a positive int or None, got 0"),
        ({"ncols": 80.0}, FitforgeTypeError, "ncols must be a positive int or None, got"),
    ],
)
def test_progress_bar_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=f"ProgressBarHandler: {message}"):
        ProgressBarHandler(**kwargs)


def test_the_reporting_handlers_keep_to_their_declared_access(monkeypatch, caplog):
    every_batch_refreshes(monkeypatch)
    est = make_estimator(train_metrics=METRICS)
    with caplog.at_level(logging.INFO, logger="fitforge"):
        est.fit(
            regression_batches(2),
            val_data=regression_batches(1),
            epochs=2,
            event_handlers=[ProgressBarHandler(file=FakeTerminal(), ncols=80), LoggingHandler(log_interval=1)],
            check_access=True,
        )
        est.evaluate(regression_batches(1), event_handlers=[ProgressBarHandler(file=FakeTerminal()), LoggingHandler()])
    assert "[Validate]" in caplog.text


@pytest.mark.parametrize("validation", [False, True])
def test_redirected_stderr_gets_one_line_per_epoch_from_an_explicit_bar(monkeypatch, validation):
    """A script that adds ProgressBarHandler() itself, its stderr a file or a CI log (no terminal):
    no carriage return, and one line per epoch: the log's (the bar draws nothing beside it)."""
    stream = io.StringIO()  # not a terminal, as a redirected sys.stderr
    logger = logging.getLogger("fitforge")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.NOTSET)  # an unconfigured script: fitforge prints itself
    monkeypatch.setattr(sys, "stderr", stream)
    every_batch_refreshes(monkeypatch)
    est = make_estimator(train_metrics=METRICS)
    val = regression_batches(2) if validation else None
    est.fit(regression_batches(4), val_data=val, epochs=3, event_handlers=[ProgressBarHandler()])
    est.evaluate(regression_batches(2), event_handlers=[ProgressBarHandler()])  # its bar draws nothing either
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split("]")[0] for line in lines if line.startswith("[")] == ["[Epoch 1/3", "[Epoch 2/3", "[Epoch 3/3"]
    assert len(lines) == 6 and lines[-1].startswith("Finished: 3 epochs")  # the model, the length, 3 epochs, the end

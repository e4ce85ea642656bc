"""What the user reads: value formatting, non-finite losses, and log lines in a fresh process."""

import logging
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from fitforge.events import BatchEnd, EpochBegin
from fitforge.handlers import CheckpointHandler, LoggingHandler, NaNGuardHandler, ValidationHandler
from fitforge.handlers import logging as logging_module
from fitforge.handlers.defaults import fit_services
from fitforge.reporting.formatting import format_value, format_values
from helpers import make_estimator, regression_batches

SRC = Path(logging_module.__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.69314718, "0.6931"),
        (0.5, "0.5000"),
        (0.0123456, "0.01235"),
        (12.3456, "12.35"),
        (1234.5, "1234"),
        (12345.6, "12346"),
        (1.234e-5, "1.234e-05"),
        (4e-5, "4.000e-05"),
        (2.5e7, "2.500e+07"),
        (-0.6931, "-0.6931"),
        (0.0, "0"),
        (1.0, "1.000"),  # an accuracy of 1 lines up with 0.9979
        (3.0, "3.000"),
        (3, "3"),  # an int a handler recorded (a count) shows as one
        (120_000, "120000"),
        (1200.0, "1200"),
        (math.nan, "nan"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
    ],
)
def test_values_show_four_significant_digits(value, text):
    assert format_value(value) == text


def test_small_losses_do_not_read_as_zero_and_nan_is_kept():
    assert format_values({"train_loss": 4.2e-5, "val_loss": math.nan}) == "train_loss=4.200e-05 val_loss=nan"


class NanFrom(EpochBegin):
    """Poison the weights at the start of epoch ``epoch`` (0-based): its loss and every later one are nan."""

    def __init__(self, epoch):
        self.epoch = epoch

    def epoch_begin(self, state):
        if state.epoch == self.epoch:
            with torch.no_grad():
                state.estimator.net.weight.fill_(math.nan)


def test_a_nan_loss_shows_in_the_line_and_summary_with_one_warning(caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        make_estimator().fit(regression_batches(2), epochs=3, event_handlers=[NanFrom(1)])
    lines = [r.getMessage() for r in caplog.records]
    epoch_lines = [line for line in lines if line.startswith("[Epoch")]
    assert re.match(r"\[Epoch 1/3\] train_loss=\d\S* train_mae=\S+ train_samples_per_s=\d+ \(", epoch_lines[0])
    assert epoch_lines[1].startswith("[Epoch 2/3] train_loss=nan train_mae=nan train_samples_per_s=")
    assert epoch_lines[2].startswith("[Epoch 3/3] train_loss=nan train_mae=nan train_samples_per_s=")
    assert lines[-1].endswith("Final: train_loss=nan train_mae=nan")  # not epoch 1's finite value
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once a fit, at the first epoch it happens
    assert warnings[0].getMessage() == (
        "epoch 2: train_loss=nan is not finite; training may have diverged. Lower the learning rate, or add "
        "NaNGuardHandler() to stop at the first nan/inf batch loss (or skip such batches)"
    )


def test_the_warning_does_not_point_to_a_guard_the_fit_has(caplog):
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        make_estimator().fit(
            regression_batches(2), val_data=regression_batches(1), epochs=2, event_handlers=[NanFrom(0)]
        )
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "epoch 1: train_loss=nan and val_loss=nan are not finite; training may have diverged. Lower the learning "
        "rate, or add NaNGuardHandler() to stop at the first nan/inf batch loss (or skip such batches)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        make_estimator().fit(
            regression_batches(2),
            val_data=regression_batches(1),
            epochs=1,
            event_handlers=[NanFrom(0), NaNGuardHandler(policy="skip")],
        )
    diverged = [r.getMessage() for r in caplog.records if "diverged" in r.getMessage()]
    assert diverged == [  # every batch skipped: no training loss either
        "epoch 1: train_loss=nan and val_loss=nan are not finite; training may have diverged. Lower the learning rate"
    ]


def test_an_epoch_without_validation_leaves_its_keys_out_not_as_nan(caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        make_estimator().fit(
            regression_batches(2), epochs=2, event_handlers=[ValidationHandler(regression_batches(1), epoch_period=2)]
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[Epoch")]
    assert "val_loss" not in lines[0] and "val_loss=" in lines[1]
    assert not any(r.levelno == logging.WARNING for r in caplog.records)


def test_the_line_for_a_loss_below_5e_5_is_not_zero(caplog):
    net = nn.Linear(1, 1)
    with torch.no_grad():
        net.weight.fill_(2.0)
        net.bias.fill_(3.0 + 0.005)  # an mse of 2.5e-05
    est = make_estimator(net=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0))
    with caplog.at_level(logging.INFO, logger="fitforge"):
        est.fit(regression_batches(2), epochs=1)
    assert "train_loss=2.500e-05" in caplog.text and "0.0000" not in caplog.text


# -- lines logged before the LoggingHandler's train_begin, in a fresh process ----------------------
SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from fitforge.handlers import CheckpointHandler, EarlyStoppingHandler
from helpers import make_estimator, regression_batches
est = make_estimator()
handlers = [CheckpointHandler({model_dir!r}, epoch_period=1, resume_from_checkpoint=True),
            EarlyStoppingHandler("val_loss")]
est.fit(regression_batches(2), val_data=regression_batches(1), epochs={epochs}, event_handlers=handlers)
"""


def fresh_fit(tmp_path, epochs):
    """Run a fit in a new interpreter in which no logging is configured; its stderr."""
    script = SCRIPT.format(tests=str(TESTS), model_dir=str(tmp_path / "ckpt"), epochs=epochs)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.integration  # a fresh interpreter's logging
def test_the_resume_line_shows_in_a_fresh_process(tmp_path):
    first = fresh_fit(tmp_path, epochs=1)
    assert "no checkpoint in" in first and "training from scratch" in first
    assert "EarlyStoppingHandler monitors val_loss: mode min" in first
    assert first.index("training from scratch") < first.index("Training for 1 epoch")
    second = fresh_fit(tmp_path, epochs=2)
    assert "CheckpointHandler: resuming from model-epoch1batch2.pt (1 epoch(s)" in second
    assert "[Epoch 2/2]" in second and "[Epoch 1/2]" not in second


def test_console_output_is_set_up_for_a_fit_with_a_logging_handler_only(monkeypatch, capsys):
    logger = logging.getLogger("fitforge")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", False)  # nothing configured anywhere
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    logging_module.console_output_for(fit_services([NaNGuardHandler()], None))
    assert logger.handlers == []
    logging_module.console_output_for(fit_services([NaNGuardHandler(), LoggingHandler()], None))
    assert len(logger.handlers) == 1 and logger.level == logging.INFO
    logger.info("CheckpointHandler: resuming from x")
    assert "resuming from x" in capsys.readouterr().err


def test_evaluate_alone_prints_its_line_in_an_unconfigured_process(monkeypatch, capsys):
    logger = logging.getLogger("fitforge")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    make_estimator().evaluate(regression_batches(1), event_handlers=[LoggingHandler()])
    assert re.search(r"^\[Validate\] val_loss=\S+ val_mae=\S+$", capsys.readouterr().err, re.M)


def test_epochs_are_numbered_across_fits_in_the_log_and_the_bar(caplog):
    est = make_estimator()
    with caplog.at_level(logging.INFO, logger="fitforge"):
        est.fit(regression_batches(2), epochs=2)
        caplog.clear()
        est.fit(regression_batches(2), epochs=2, event_handlers=[LoggingHandler(log_interval=2)])
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1] == "Training for 2 epochs, 2 batches per epoch (2 epochs trained before)"
    assert [line.split("]")[0] for line in lines if line.startswith("[")] == [
        "[Epoch 3/4 Batch 2",
        "[Epoch 3/4",
        "[Epoch 4/4 Batch 2",
        "[Epoch 4/4",
    ]


def test_an_interrupted_epoch_is_marked_partial(caplog, tmp_path):
    saver = CheckpointHandler(tmp_path)

    class Interrupt(BatchEnd):
        def batch_end(self, state):
            if state.epoch == 1 and state.batch_idx == 0:
                os.kill(os.getpid(), signal.SIGINT)  # fit stops after this batch, then raises KeyboardInterrupt

    class Stop(BatchEnd):
        def batch_end(self, state):
            if state.epoch == 0 and state.batch_idx == 1:
                state.run.stop("enough")

    with caplog.at_level(logging.INFO, logger="fitforge"):
        with pytest.raises(KeyboardInterrupt):
            make_estimator().fit(regression_batches(4), epochs=3, event_handlers=[Interrupt(), saver])
        with pytest.raises(KeyboardInterrupt):
            make_estimator().fit(regression_batches(4), epochs=3, event_handlers=[Interrupt()])  # nothing resumes
        make_estimator().fit(regression_batches(4), epochs=3, event_handlers=[Stop()])
        make_estimator().fit(regression_batches(4), epochs=1)
    heads = [r.getMessage().split("]")[0] for r in caplog.records if r.getMessage().startswith("[")]
    assert heads == [
        "[Epoch 1/3",
        "[Epoch 2/3, partial: 1 of 4 batches; interrupted, a resumed run finishes it",
        "[Epoch 1/3",
        "[Epoch 2/3, partial: 1 of 4 batches; interrupted",
        "[Epoch 1/3, partial: 2 of 4 batches",
        "[Epoch 1/1",
    ]

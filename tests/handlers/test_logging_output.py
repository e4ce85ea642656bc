"""What the user reads: value formatting, non-finite losses, and log lines in a fresh process."""

import logging
import math
import re

import pytest
import torch
from torch import nn

from fitforge.events import EpochBegin
from fitforge.handlers import NaNGuardHandler, ValidationHandler
from fitforge.handlers.formatting import format_value, format_values
from helpers import make_estimator, regression_batches


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
        (3.0, "3"),
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
    assert re.match(r"\[Epoch 1/3\] train_loss=\d\S* train_mae=\S+ \(", epoch_lines[0])
    assert epoch_lines[1].startswith("[Epoch 2/3] train_loss=nan train_mae=nan (")
    assert epoch_lines[2].startswith("[Epoch 3/3] train_loss=nan train_mae=nan (")
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

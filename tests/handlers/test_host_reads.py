"""Built-in handlers read nothing to the host per training batch: the count of reads over an epoch
does not grow with the number of batches (invariant 1 of DESIGN.md)."""

import pytest
import torch

import fitforge.handlers.progress_bar as progress_bar
from fitforge.handlers import ProgressBarHandler
from fitforge.testing import HostReadCounter, linear_data, linear_problem


def reads_in_one_epoch(batches, handlers):
    estimator, _, val = linear_problem()
    train = linear_data(n=4 * batches, batch_size=4)
    with HostReadCounter() as reads:
        estimator.fit(train, val_data=val, epochs=1, event_handlers=handlers())
    return reads.count


@pytest.mark.parametrize(
    "handlers",
    [
        lambda: [],  # the defaults: metrics, validation, logging, stopping
        lambda: [ProgressBarHandler()],  # and the progress bar
    ],
    ids=["defaults", "progress bar"],
)
def test_no_host_read_per_training_batch(handlers, monkeypatch):
    # A frozen clock: the bar's time-throttled refresh (a read) never comes due mid-epoch, whatever
    # the machine's speed; what is left are the reads every epoch makes once.
    monkeypatch.setattr(progress_bar.time, "monotonic", lambda: 0.0)
    few, many = reads_in_one_epoch(8, handlers), reads_in_one_epoch(64, handlers)
    assert few == many > 0  # > 0: the counter sees the epoch-end reads, so it would see per-batch ones


def test_the_counter_sees_item_float_and_bool():
    t = torch.tensor([1.5, 2.0])
    with HostReadCounter() as reads:
        t[0].item(), float(t[1]), bool(t[0] > 1)
    assert reads.count == 3


def test_a_handler_reading_every_batch_is_caught(monkeypatch):
    from fitforge.handlers import LoggingHandler

    monkeypatch.setattr(progress_bar.time, "monotonic", lambda: 0.0)
    every_batch = lambda: [LoggingHandler(log_interval=1)]  # noqa: E731 - asks for a read per batch
    assert reads_in_one_epoch(64, every_batch) > reads_in_one_epoch(8, every_batch)

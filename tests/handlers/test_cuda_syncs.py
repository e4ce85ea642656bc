"""On a GPU a fit with the default handlers makes no host sync in a training step: after the first,
checked batch, every CUDA call that would make the host wait for the device raises, from each
batch's start to the epoch's end (torch's sync debug mode). Runs where CUDA exists."""

import importlib.util

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.events import BatchBegin, EpochEnd, Stage, TrainEnd

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class SyncsRaise(BatchBegin, EpochEnd, TrainEnd):
    """Sync debug mode "error" from the start of every training batch after the first to the end
    of its epoch's batches: the step, every batch_end hook and the loading of the next batch."""

    priority = Stage.GUARD - 1  # at epoch_end first: the epoch's values are read after it

    def __init__(self) -> None:
        self.guarded = 0

    def batch_begin(self, state):
        if state.global_step >= 1:  # the first batch is checked before its step: a read or two, once
            torch.cuda.set_sync_debug_mode("error")
            self.guarded += 1

    def epoch_end(self, state):
        torch.cuda.set_sync_debug_mode("default")

    def train_end(self, state):
        torch.cuda.set_sync_debug_mode("default")


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def loader(samples: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(samples, 3, 16, 16, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, pin_memory=True)


def test_the_guard_turns_a_host_read_into_an_error():
    try:
        torch.cuda.set_sync_debug_mode("error")
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.ones(1, device="cuda").item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize(
    "precision, compiled",
    [(None, False), ("bf16-mixed", False), (None, True)],
    ids=["fp32", "bf16", "compiled"],
)
def test_no_host_sync_in_a_training_step_with_the_default_handlers(precision, compiled, optimizer, monkeypatch):
    # The defaults as under CI or a pipe: on a terminal (pytest -s) they add a progress bar, whose
    # refresh reads running values every half second, as asked.
    monkeypatch.setattr("fitforge.handlers.defaults.interactive", lambda: False)
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    if compiled and importlib.util.find_spec("triton") is None:
        pytest.skip("torch.compile on CUDA needs triton")
    torch.manual_seed(0)
    estimator = Estimator(
        cnn(),
        nn.CrossEntropyLoss(),
        optimizer=optimizer,
        train_metrics="accuracy",
        device="cuda",
        precision=precision,
        compile=compiled,
    )
    guard = SyncsRaise()
    try:
        history = estimator.fit(loader(256), val_data=loader(64), epochs=2, event_handlers=[guard])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.guarded == 2 * 8 - 1  # every training batch after the first ran guarded
    assert len(history["val_loss"]) == 2


@pytest.mark.parametrize("precision", [None, "bf16-mixed"], ids=["fp32", "bf16"])
def test_no_host_sync_in_a_training_step_with_an_ema_of_the_weights(precision, monkeypatch):
    from fitforge.handlers import EMAHandler, GradientUpdateHandler

    monkeypatch.setattr("fitforge.handlers.defaults.interactive", lambda: False)
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    torch.manual_seed(0)
    estimator = Estimator(cnn(), nn.CrossEntropyLoss(), optimizer="adam", device="cuda", precision=precision)
    guard, ema = SyncsRaise(), EMAHandler(decay=0.99, every=2)
    handlers = [guard, ema, GradientUpdateHandler(accumulate=2)]
    try:
        history = estimator.fit(loader(256), val_data=loader(64), epochs=2, event_handlers=handlers)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.guarded == 2 * 8 - 1 and ema.updates == 4  # 8 optimizer steps, every second one averaged
    assert len(history["val_loss"]) == 2

"""Device transfer on the hot path: inputs already on the device pass through untouched, copies to
CUDA are non-blocking, channels-last layout on request, and a processor's own autocast is entered."""

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch import nn

from fitforge import BatchProcessor
from fitforge.exceptions import FitforgeTypeError
from helpers import make_estimator


def images(n=2, batch=4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 2, (batch,), generator=g)) for _ in range(n)]


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)
    )


class Layout(nn.Module):
    """Records whether each input arrives channels-last, then runs the CNN."""

    def __init__(self):
        super().__init__()
        self.body, self.seen = cnn(), []

    def forward(self, x):
        self.seen.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return self.body(x)


def test_inputs_already_on_the_device_are_passed_through_without_a_copy():
    estimator = make_estimator()
    x, y = torch.randn(4, 1), torch.randn(4, 1)
    inputs, label = estimator.batch_processor.to_device(SimpleNamespace(estimator=estimator), (x, y))
    assert inputs[0] is x and label is y
    assert estimator.non_blocking is False  # CPU: nothing to overlap


def test_copies_to_cuda_are_non_blocking():
    # A stand-in estimator on another device records how the processor asks tensors to move.
    estimator = SimpleNamespace(device=torch.device("meta"), non_blocking=True, channels_last=False, loss=nn.MSELoss())
    calls = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("non_blocking"))
        return real_to(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "to", spy):
        inputs, label = BatchProcessor().to_device(
            SimpleNamespace(estimator=estimator), (torch.ones(2, 1), torch.ones(2))
        )
    assert inputs[0].device.type == "meta" and label.device.type == "meta"
    assert calls == [True, True]


def test_channels_last_converts_the_net_and_four_d_inputs_with_equal_results():
    data = images()
    plain, last = Layout(), Layout()
    last.load_state_dict(plain.state_dict())
    make_estimator(net=plain, loss=nn.CrossEntropyLoss(), optimizer="sgd").fit(data, epochs=1, event_handlers=[])
    estimator = make_estimator(net=last, loss=nn.CrossEntropyLoss(), optimizer="sgd", channels_last=True)
    assert estimator.channels_last and last.body[0].weight.is_contiguous(memory_format=torch.channels_last)
    estimator.fit(data, epochs=1, event_handlers=[])
    assert last.seen and all(last.seen) and not any(plain.seen)
    for a, b in zip(plain.state_dict().values(), last.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert estimator.predict([x for x, _ in data]).shape == (8, 2)


def test_channels_last_must_be_a_bool():
    with pytest.raises(FitforgeTypeError, match="Estimator: channels_last must be True or False, got int 1"):
        make_estimator(channels_last=1)


def test_a_processor_that_overrides_autocast_has_it_entered_in_float32():
    entered = []

    class Traced(BatchProcessor):
        def autocast(self, state):
            entered.append(state.phase)
            return contextlib.nullcontext()

    make_estimator(batch_processor=Traced()).fit([(torch.randn(4, 1), torch.randn(4, 1))], epochs=1, event_handlers=[])
    assert entered == ["train"]

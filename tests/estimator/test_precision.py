"""Mixed precision: bf16 autocast in fit, evaluate and predict; fp16 with a GradScaler that skips
steps on inf gradients and whose state rides in checkpoints; precision errors."""

import pytest
import torch
from torch import nn

from fitforge.checkpoint.files import load_checkpoint
from fitforge.events import BatchEnd
from fitforge.exceptions import FitforgeValueError
from fitforge.handlers import CheckpointHandler, GradientUpdateHandler
from helpers import make_estimator


class Recording(nn.Linear):
    """A Linear(1, 1) that records the autocast state and its output dtype at each forward."""

    def __init__(self):
        super().__init__(1, 1)
        self.seen = []

    def forward(self, x):
        out = super().forward(x)
        self.seen.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return out.float()


def batches(n=2):
    x = torch.rand(4 * n, 1)
    return [(x[i : i + 4], 2 * x[i : i + 4] + 3) for i in range(0, 4 * n, 4)]


def test_bf16_autocast_is_used_in_fit_evaluate_and_predict():
    net = Recording()
    estimator = make_estimator(net=net, precision="bf16-mixed")
    assert estimator.scaler is None  # bfloat16 has float32's range: nothing to scale
    data = batches()
    estimator.fit(data, epochs=1, event_handlers=[])
    estimator.evaluate(data)
    estimator.predict(data)
    assert net.seen and all(seen == (True, torch.bfloat16) for seen in net.seen)


def test_float32_by_default():
    net = Recording()
    make_estimator(net=net).fit(batches(), epochs=1)
    assert set(net.seen) == {(False, torch.float32)}


class InfGradient(BatchEnd):
    priority = -3000  # after backward, before GradientUpdateHandler's step

    def batch_end(self, state):
        if state.global_step == 0:
            state.estimator.net.weight.grad.fill_(float("inf"))


@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_fp16_scaler_skips_a_step_on_inf_gradients(clip_norm):
    estimator = make_estimator(net=nn.Linear(1, 1), precision="16-mixed")
    scale = estimator.scaler.get_scale()
    before = [p.detach().clone() for p in estimator.net.parameters()]
    estimator.fit(batches(1), epochs=1, event_handlers=[InfGradient(), GradientUpdateHandler(clip_norm=clip_norm)])
    assert all(torch.equal(a, b) for a, b in zip(before, estimator.net.parameters()))  # the step was skipped
    assert estimator.scaler.get_scale() < scale  # and the scale backed off


def test_fp16_trains_and_its_scaler_state_is_checkpointed(tmp_path):
    estimator = make_estimator(net=nn.Linear(1, 1), precision="16-mixed")
    before = estimator.net.weight.detach().clone()
    # The first steps overflow at the initial scale of 2**16 and are skipped while the scale backs off.
    estimator.fit(batches(10), epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    assert not torch.equal(before, estimator.net.weight) and estimator.scaler.get_scale() < 2.0**16
    saved = load_checkpoint(tmp_path / "model-epoch1batch10.pt")["scaler"]
    assert saved["scale"] == estimator.scaler.get_scale()
    fresh = make_estimator(net=nn.Linear(1, 1), precision="16-mixed")
    assert fresh.scaler.get_scale() == 2.0**16  # the initial scale, which loading replaces
    fresh.load_checkpoint(tmp_path / "model-epoch1batch10.pt")
    assert fresh.scaler.get_scale() == estimator.scaler.get_scale()


def test_an_unknown_precision_is_a_clear_error():
    with pytest.raises(
        FitforgeValueError,
        match="precision must be None or one of '32', '32-true', 'bf16-mixed', '16-mixed', got 'fp8'",
    ):
        make_estimator(precision="fp8")

"""The generators' states kept around a block (the check before training draws nothing for fit)."""

import pytest
import torch

from fitforge.core.rng import restore_rng_states, rng_states, torch_rng_kept


def test_the_cpu_generator_is_as_before_after_the_block_even_when_it_raises():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with pytest.raises(KeyError), torch_rng_kept(torch.device("cpu")):
        torch.rand(100)
        raise KeyError("inside")
    assert torch.equal(torch.rand(4), expected)


def test_a_val_check_draws_nothing_from_the_training_stream():
    from torch import nn

    from fitforge import Estimator
    from fitforge.handlers import ValidationHandler
    from helpers import regression_batches

    class Drawing(nn.Linear):  # draws from the global generator in every forward, eval mode too
        def forward(self, x):
            return super().forward(x) + 0 * torch.rand(1)

    def after_fit(check_first):
        torch.manual_seed(0)
        est = Estimator(Drawing(1, 1), nn.MSELoss(), optimizer="sgd", device="cpu")
        handler = ValidationHandler(regression_batches(), check_first=check_first)
        est.fit(regression_batches(), epochs=1, event_handlers=[handler])
        return torch.rand(3)  # what the global generator gives after the fit

    assert torch.equal(after_fit(True), after_fit(False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_generator_is_kept_too():
    device = torch.device("cuda")
    saved = rng_states()
    try:
        torch.cuda.manual_seed(5)
        expected = torch.rand(4, device=device)
        torch.cuda.manual_seed(5)
        with torch_rng_kept(device):
            torch.rand(100, device=device)
        assert torch.equal(torch.rand(4, device=device), expected)
    finally:
        restore_rng_states(saved)


def test_torch_rng_kept_is_entered_once():
    kept = torch_rng_kept(torch.device("cpu"))
    with kept:
        state = torch.get_rng_state()
        with pytest.raises(RuntimeError, match="entered once"), kept:
            pass
        torch.rand(3)
    assert torch.equal(torch.get_rng_state(), state)

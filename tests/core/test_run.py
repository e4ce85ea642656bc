"""fitforge.core.run.inference: eval mode and no autograd for a block, the modes put back after."""

import pytest
import torch
from torch import nn

from fitforge.core.run import inference


def test_inference_sets_eval_mode_and_inference_mode_and_restores_both():
    net = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    net[1].eval()  # a module in its own mode keeps it
    with inference(net):
        assert not net.training and not net[0].training
        assert torch.is_inference_mode_enabled()
    assert net.training and net[0].training and not net[1].training
    assert not torch.is_inference_mode_enabled()


def test_inference_restores_the_modes_after_an_exception():
    net = nn.Linear(2, 2)
    with pytest.raises(ValueError), inference(net, inference_mode=False):
        assert not torch.is_grad_enabled()
        raise ValueError
    assert net.training and torch.is_grad_enabled()


def test_an_inference_block_is_entered_once():
    net = nn.Linear(2, 2)
    block = inference(net)
    with block, pytest.raises(RuntimeError, match="entered once"), block:
        pass
    assert net.training and not torch.is_inference_mode_enabled()

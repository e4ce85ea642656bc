"""parameter_counts and parameter_bytes: shared weights once, frozen ones apart, buffers in bytes."""

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.exceptions import FitforgeTypeError
from fitforge.reporting.summary import model_name, model_summary, parameter_bytes, parameter_counts


def test_counts_total_and_trainable():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))  # 16 + 10
    assert parameter_counts(net) == (26, 26)
    net[0].requires_grad_(False)
    assert parameter_counts(net) == (26, 10)


def test_a_shared_parameter_counts_once():
    embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embed.weight  # tied weights, as in a language model
    net = nn.ModuleDict({"embed": embed, "head": head, "again": embed})
    assert parameter_counts(net) == (40, 40)
    assert parameter_bytes(net) == 40 * 4


def test_bytes_count_buffers_at_their_dtype():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).to(torch.float64)
    # 6 + 4 parameters and 2 + 2 running statistics in float64, one int64 batch counter
    assert parameter_bytes(net) == (6 + 4 + 4) * 8 + 8
    assert parameter_bytes(nn.Linear(4, 4).to(torch.bfloat16)) == 20 * 2


def test_a_lazy_module_counts_nothing_before_its_first_forward():
    net = nn.LazyLinear(3)
    assert parameter_counts(net) == (0, 0) and parameter_bytes(net) == 0
    net(torch.zeros(1, 5))
    assert parameter_counts(net) == (18, 18)


def test_a_model_with_no_parameter():
    assert parameter_counts(nn.ReLU()) == (0, 0) and parameter_bytes(nn.ReLU()) == 0


@pytest.mark.parametrize("function", [parameter_counts, parameter_bytes])
def test_not_a_module_is_a_clear_error(function):
    with pytest.raises(FitforgeTypeError, match=rf"{function.__name__}: net must be a torch.nn.Module, got list"):
        function([nn.Linear(1, 1)])


def test_model_summary_is_one_line_with_thousands_separators_size_device_and_precision():
    net = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
    net[0].requires_grad_(False)
    est = Estimator(net, nn.CrossEntropyLoss(), device="cpu", precision="bf16-mixed")
    assert model_summary(est) == (
        "Model: Sequential, 1,011,010 parameters (10,010 trainable), 3.9 MiB, on cpu, bf16-mixed"
    )
    small = Estimator(nn.Linear(3, 2).double(), nn.MSELoss(), device="cpu")
    assert model_summary(small) == "Model: Linear, 8 parameters (8 trainable), 64 B, on cpu, float64"
    assert model_summary(Estimator(nn.Linear(300, 4), nn.MSELoss(), device="cpu")).endswith(
        ", 4.7 KiB, on cpu, float32"
    )


def test_model_summary_names_the_users_module_and_notes_lazy_parameters():
    class Wrapper(nn.Module):  # as torch.compile's OptimizedModule keeps the module
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    assert model_name(Wrapper(nn.Linear(2, 2))) == "Linear"
    lazy = Estimator(nn.Sequential(nn.Linear(2, 3), nn.LazyLinear(4)), nn.MSELoss(), device="cpu", optimizer="sgd")
    assert model_summary(lazy).startswith("Model: Sequential, 9 parameters (and lazy ones not built yet) (9 trainable)")

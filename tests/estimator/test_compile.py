"""Estimator(compile=...): the net's forward runs through torch.compile, or falls back to eager
with a warning where it cannot compile; state_dict keys stay those of the eager net."""

import pytest
import torch
from torch import nn

from fitforge.exceptions import FitforgeTypeError
from helpers import make_estimator


def batches():
    x = torch.rand(8, 1)
    return [(x[:4], 2 * x[:4] + 3), (x[4:], 2 * x[4:] + 3)]


def test_compiled_forward_trains_and_keeps_state_dict_keys():
    calls = []

    def backend(graph, example_inputs):  # a backend that records what torch.compile hands it
        calls.append(graph)
        return graph.forward

    net = nn.Linear(1, 1)
    keys = list(net.state_dict())
    estimator = make_estimator(net=net, compile={"backend": backend})
    before = net.weight.detach().clone()
    estimator.fit(batches(), epochs=2)
    estimator.predict([torch.rand(4, 1)])
    assert calls  # the forward went through torch.compile
    assert not torch.equal(before, net.weight) and list(net.state_dict()) == keys


def test_a_net_that_cannot_compile_falls_back_to_eager_with_a_warning():
    def broken(graph, example_inputs):
        raise RuntimeError("no compiler here")

    net = nn.Linear(1, 1)
    estimator = make_estimator(net=net, compile={"backend": broken})
    with pytest.warns(UserWarning, match="torch.compile could not compile Linear .*running it eagerly"):
        history = estimator.fit(batches(), epochs=1)
    assert history.epochs == 1 and "forward" not in vars(net)  # eager from now on: no second warning


def test_compile_argument_errors():
    with pytest.raises(
        FitforgeTypeError, match="compile must be True, False or a dict of torch.compile arguments, got str 'yes'"
    ):
        make_estimator(compile="yes")


def test_a_copy_of_a_compiled_net_runs_its_own_weights_and_the_net_pickles(tmp_path):
    import copy

    net = nn.Linear(3, 2)
    make_estimator(net=net, compile={"backend": "eager"})
    x = torch.randn(4, 3)
    net(x)  # compiled
    twin = copy.deepcopy(net)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    assert torch.equal(twin(x), torch.zeros(4, 2)) and not torch.equal(net(x), twin(x))
    torch.save(net, tmp_path / "net.pt")
    assert torch.equal(torch.load(tmp_path / "net.pt", weights_only=False)(x), net(x))

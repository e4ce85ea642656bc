"""fitforge.core.modules: the cheap walks give what torch's own do."""

from __future__ import annotations

import torch
from torch import nn

from fitforge.core.modules import set_training, switch_training, tensors_of, walk


def net_with_everything() -> nn.Module:
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Dropout(), nn.Linear(4, 2)))
    net.register_module("absent", None)  # a None child, as a model may register for an optional part
    return net


def test_walk_finds_every_module_as_torch_does() -> None:
    net = net_with_everything()
    assert {id(m) for m in walk(net)} == {id(m) for m in net.modules()}


def test_tensors_of_gives_every_parameter_and_buffer() -> None:
    net = net_with_everything()
    expected = {id(t) for t in [*net.parameters(), *net.buffers()]}
    assert {id(t) for t in tensors_of(net)} == expected


def test_set_training_sets_every_module_both_ways() -> None:
    net = net_with_everything()
    set_training(net, False)
    assert not any(m.training for m in net.modules())
    set_training(net, True)
    assert all(m.training for m in net.modules())


class FrozenNorm(nn.Module):
    """Keeps its BatchNorm in eval mode whatever the mode asked: the usual fine-tuning override."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(3, 3), nn.BatchNorm1d(3)

    def train(self, mode: bool = True) -> FrozenNorm:
        super().train(mode)
        self.norm.eval()
        return self


def test_set_training_honours_a_train_override_anywhere_in_the_net() -> None:
    net = nn.Sequential(nn.Linear(3, 3), FrozenNorm())
    set_training(net, False)
    set_training(net, True)
    assert net.training and net[1].fc.training
    assert not net[1].norm.training  # the override ran


def test_set_training_goes_through_a_training_property() -> None:
    class Wrapper(nn.Module):  # as torch.compile's OptimizedModule: training is the wrapped net's
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        @property  # type: ignore[override]
        def training(self) -> bool:
            return self.inner.training

        @training.setter
        def training(self, value: bool) -> None:
            if "inner" in self.__dict__.get("_modules", {}):
                self.inner.training = value

    net = Wrapper(nn.Linear(2, 2))
    set_training(net, False)
    assert net.training is False and net.inner.training is False
    set_training(net, True)
    assert net.training is True


def test_set_training_on_a_compiled_net() -> None:
    net = torch.compile(nn.Sequential(nn.Linear(2, 2), nn.Dropout()))
    set_training(net, False)
    assert not net.training and not any(m.training for m in net.modules())


def test_walk_visits_a_shared_module_once() -> None:
    shared = nn.Linear(2, 2)
    net = nn.Sequential(shared, nn.Sequential(shared, nn.ReLU()))
    assert len(walk(net)) == len(list(net.modules())) == 4


def test_set_training_honours_a_train_set_on_the_instance() -> None:
    import types

    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    norm = net[1]

    def frozen(self: nn.Module, mode: bool = True) -> nn.Module:
        return nn.Module.train(self, False)  # this norm stays in eval mode

    norm.train = types.MethodType(frozen, norm)  # type: ignore[method-assign]
    set_training(net, False)
    set_training(net, True)
    assert net.training and net[0].training and not norm.training


def test_set_training_sees_a_class_patched_after_an_earlier_call() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(2)

    net = Block()
    set_training(net, True)  # a first call, before the patch
    original = Block.train

    def frozen(self: nn.Module, mode: bool = True) -> nn.Module:
        original(self, mode)
        self.norm.eval()
        return self

    Block.train = frozen  # type: ignore[method-assign]
    set_training(net, True)
    assert net.training and not net.norm.training


def test_switch_training_puts_each_module_s_own_mode_back():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Dropout())
    net[1].eval()
    restore = switch_training(net, False)
    assert not any(m.training for m in net.modules())
    restore()
    assert [m.training for m in net.modules()] == [True, True, False, True]


def test_switch_training_of_a_net_customising_train_restores_through_train():
    class Frozen(nn.Sequential):
        def train(self, mode=True):
            super().train(mode)
            self[1].eval()  # keeps its statistics
            return self

    net = Frozen(nn.Linear(2, 2), nn.BatchNorm1d(2))
    restore = switch_training(net, False)
    assert not net.training
    restore()
    assert net.training and not net[1].training

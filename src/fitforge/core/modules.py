"""Walking a net's modules cheaply, for what every fit does a few times: switching train/eval mode,
checking where the tensors live, looking at which parameters train.

torch's own walks build every qualified name and set ``training`` through ``Module.__setattr__``:
on a small net they cost more than a batch. Here children are read from ``_modules``, and
``training`` is written straight into modules that do not customise how it is set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

_TRAIN, _SETATTR = nn.Module.train, nn.Module.__setattr__
_CLASS_TRAINING: dict[type, bool] = {}  # module class -> it defines a class attribute "training" (a property)


def walk(net: nn.Module) -> list[nn.Module]:
    """``net`` and every module below it, each once (no names built)."""
    found, seen = [net], {id(net)}
    for module in found:  # the list grows as the loop goes: breadth first
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
    return found


def tensors_of(net: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of ``net`` (one shared by two modules comes twice)."""
    for module in walk(net):
        for parameter in module._parameters.values():
            if parameter is not None:
                yield parameter
        for buffer in module._buffers.values():
            if buffer is not None:
                yield buffer


def _plain(module: nn.Module) -> bool:
    """Whether ``module`` sets its mode as ``nn.Module`` does: torch's ``train`` and ``__setattr__``,
    no ``training`` property (``torch.compile``'s wrapper has one). Looked up at each call: dynamo
    may patch ``__setattr__`` after a fit."""
    cls = type(module)
    if cls.train is not _TRAIN or cls.__setattr__ is not _SETATTR or "train" in module.__dict__:
        return False
    attribute = _CLASS_TRAINING.get(cls)
    if attribute is None:
        attribute = _CLASS_TRAINING[cls] = hasattr(cls, "training")
    return not attribute


def _plain_modules(net: nn.Module) -> list[nn.Module] | None:
    """``net``'s modules when none customises how its mode is set (:func:`_plain`), else None."""
    modules = walk(net)
    return modules if all(_plain(module) for module in modules) else None


def switch_training(net: nn.Module, mode: bool) -> Callable[[], None]:
    """:func:`set_training`, returning what puts the modes back: each module's own flag where none
    customises ``train``, else ``net.train`` of the mode ``net`` was in."""
    modules = _plain_modules(net)
    if modules is None:
        was_training = net.training
        net.train(mode)

        def restore_root() -> None:
            net.train(was_training)

        return restore_root
    before = [module.__dict__["training"] for module in modules]
    for module in modules:
        module.__dict__["training"] = mode

    def restore() -> None:
        for module, flag in zip(modules, before):
            module.__dict__["training"] = flag

    return restore


def set_training(net: nn.Module, mode: bool) -> None:
    """``net.train(mode)``, setting the flags directly when no module customises ``train``."""
    modules = _plain_modules(net)
    if modules is None:
        net.train(mode)
        return
    for module in modules:
        module.__dict__["training"] = mode

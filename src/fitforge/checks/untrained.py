"""Trainable parameters that no optimizer holds, named once at fit start (a backbone unfrozen after the
optimizer was built over the head: docs/fine-tuning.md). A frozen one outside every optimizer is no mistake.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from fitforge.checkpoint.folder import describe_tensors
from fitforge.core.modules import walk

log = logging.getLogger("fitforge")
SHOWN = 5  # names in the warning; the count covers the rest
_ATTRIBUTE = re.compile(r"[A-Za-z_]\w*")


def _held(optimizers: Sequence[torch.optim.Optimizer]) -> set[int]:
    return {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}


def untrained_names(net: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[str]:
    """The qualified names of ``net``'s parameters that require grad but are in no optimizer's
    parameter groups (compared by identity; several optimizers count together, a GAN's)."""
    held = _held(optimizers)
    # The usual case, at every fit: one walk over the modules' own parameters, no names built.
    if all(p is None or id(p) in held or not p.requires_grad for m in walk(net) for p in m._parameters.values()):
        return []
    return [name for name, p in net.named_parameters() if p.requires_grad and id(p) not in held]


def warn_untrained(net: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """One warning through the ``fitforge`` logger when some trainable parameters of ``net`` are in
    no optimizer: their count, the first names and the fixes."""
    names = untrained_names(net, optimizers)
    if not names:
        return
    parameters = dict(net.named_parameters())
    lazy = any(is_lazy(parameters[name]) for name in names)
    values = sum(parameters[name].numel() for name in names if not is_lazy(parameters[name]))
    size = "" if lazy and not values else f" ({values:,} value{'' if values == 1 else 's'})"
    shown = describe_tensors(names, SHOWN)
    one = len(names) == 1
    counted = f"1 trainable parameter of net{size} is" if one else f"{len(names)} trainable parameters of net{size} are"
    it = "it" if one else "them"
    holder = "estimator.optimizer" if len(optimizers) == 1 else "estimator.optimizers[i]"
    log.warning(
        f"fit: {counted} in no optimizer, so training leaves {it} unchanged: {shown}. To train {it}, add {it} to "
        f'the optimizer: {holder}.add_param_group({{"params": {_parameters_of(net, names, _held(optimizers))}}}), '
        "then estimator.set_lr(...) sets every group's rate; or build the optimizer over every parameter, "
        "torch.optim.Adam(net.parameters(), ...), which skips frozen ones until they are unfrozen. Parameters that "
        "should not train: requires_grad_(False)."
    )


def _parameters_of(net: nn.Module, names: list[str], held: set[int]) -> str:
    """Code for the parameters ``names``: their smallest module when no optimizer holds any of its
    parameters (``estimator.net.backbone.parameters()``), else them by name, or for many, a filter."""
    levels = zip(*(name.split(".")[:-1] for name in names))  # the module names at each depth
    prefix = [parts[0] for parts in itertools.takewhile(lambda parts: len(set(parts)) == 1, levels)]
    module = net.get_submodule(".".join(prefix))
    if any(id(p) in held for p in module.parameters()):
        if len(names) <= SHOWN:  # no module holds just them: the parameters by name
            return f"[estimator.net.get_parameter(name) for name in {tuple(names)!r}]"
        return (  # too many to list: those trainable and in no group, computed
            "[p for p in estimator.net.parameters() if p.requires_grad and not any(p is q for o in "
            'estimator.optimizers for g in o.param_groups for q in g["params"])]'
        )
    path, parent = "", net
    for part in prefix:  # attributes, and indices into a Sequential or ModuleList; else get_submodule
        indexed = part.isdigit() and isinstance(parent, (nn.Sequential, nn.ModuleList))
        if not (indexed or _ATTRIBUTE.fullmatch(part)):
            return f"estimator.net.get_submodule({'.'.join(prefix)!r}).parameters()"
        path += f"[{part}]" if indexed else f".{part}"
        parent = parent.get_submodule(part)
    return f"estimator.net{path}.parameters()"

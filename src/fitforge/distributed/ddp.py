"""DistributedDataParallel's wrapper of the net: made with the options given, made anew when the
parameters that train change between fits, or the user's own."""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError

log = logging.getLogger("fitforge")


def adopt_wrapper(net: nn.Module) -> tuple[nn.Module, DistributedDataParallel | None]:
    """The module inside a DDP wrapper the user made, and that wrapper; ``net`` and None for any other."""
    if not isinstance(net, DistributedDataParallel):
        return net, None
    _SYNCED[net] = (_trainable_ids(net.module), None)
    return net.module, net


def wrap_ddp(net: nn.Module, device: torch.device, options: dict) -> nn.Module:
    """``net`` in a new DDP wrapper; ``net`` itself while nothing in it trains (DDP refuses such a net)."""
    if not any(p.requires_grad for p in net.parameters()):
        _SYNCED[net] = (frozenset(), options)
        return net
    return _ddp(net, device, options)


def _ddp(net: nn.Module, device: torch.device, options: dict) -> DistributedDataParallel:
    if any(parameter.is_meta for parameter in net.parameters()):
        raise FitforgeValueError(
            "strategy='ddp' copies rank 0's weights to every rank as it starts, and the net is on the meta device: "
            "build it on a real device, or use strategy='fsdp' and estimator.load_weights(path) to load it sharded"
        )
    device_ids = [device.index] if device.type == "cuda" else None
    try:
        wrapper = DistributedDataParallel(net, device_ids=device_ids, **options)
    except TypeError as err:
        raise FitforgeTypeError(
            f"strategy_options {options!r} are not all arguments of DistributedDataParallel: {err}"
        ) from err
    _SYNCED[wrapper] = (_trainable_ids(net), options)
    return wrapper


# DDP synchronises the gradients of the parameters that required grad when it was made, and only
# those. Per wrapper: their ids, and the options fitforge made it with (None: the user's wrapper).
_SYNCED: weakref.WeakKeyDictionary[nn.Module, tuple[frozenset[int], dict | None]] = weakref.WeakKeyDictionary()


def _trainable_ids(net: nn.Module) -> frozenset[int]:
    return frozenset(id(p) for p in net.parameters() if p.requires_grad)


def follow_trainable(train_net: nn.Module, net: nn.Module, device: torch.device) -> nn.Module:
    """The module fit's forward goes through, for the parameters that train now: a DDP wrapper syncs those
    that trained when it was made, so fitforge's is made anew (without the old one's comm hook)."""
    made = _SYNCED.get(train_net)
    if made is None:
        return train_net  # one process, FSDP (which follows requires_grad itself), or no strategy
    synced, options = made
    trainable = _trainable_ids(net)
    if trainable == synced or not trainable:  # nothing to train: fit's own error follows
        return train_net
    changed = [name for name, p in net.named_parameters() if (id(p) in trainable) != (id(p) in synced)]
    if options is None:
        raise FitforgeValueError(
            f"the DistributedDataParallel wrapper given as net synchronises the gradients of the parameters that "
            f"required grad when it was made, and {len(changed)} changed since ({', '.join(changed[:5])}): wrap the "
            "net again after changing requires_grad and build a new Estimator with it, or give the Estimator the net "
            "itself: it wraps it again when they change"
        )
    log.info(
        "%d parameter(s) were frozen or unfrozen since the net was prepared for several processes (%s): "
        "wrapping it in DistributedDataParallel anew, so that their gradients are averaged over the ranks",
        len(changed),
        ", ".join(changed[:5]),
    )
    return _ddp(net, device, options)

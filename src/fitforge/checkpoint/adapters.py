"""Checkpoints of a net that trains an adapter on a frozen base (a ``peft`` model: LoRA...): they hold the adapter's
weights (the trainable parameters) and a fingerprint of the frozen base, not the base itself, which the resumed
fit already has. Loading one onto another base (another model, other pretrained weights) is refused by name.

The fingerprint is computed on the device (:func:`weights_fingerprint`: the bits of each weight summed exactly,
weighted by its place) once per net, and read with the checkpoint's other values.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fitforge.exceptions import CheckpointError

_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32}  # a float's bits, by its size (8 and more: int64)
_BASES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()  # a net's base fingerprint


def weights_fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The bits of every tensor (its values viewed as integers) summed row by row in int64, each row weighted by
    its place, each tensor by its own: exact whatever order a device reduces in, changed by any bit of any value
    and by a transposed matrix; on the device."""
    sums, device = [], None
    for tensor in tensors:
        values = tensor.detach()
        values = values.to_local() if hasattr(values, "to_local") else values  # a DTensor: this rank's shard
        device = device or values.device
        rows = values.reshape(values.shape[0] if values.dim() else 1, -1)
        bits = rows.view(_INTEGERS.get(rows.element_size(), torch.int64)).sum(dim=1, dtype=torch.int64)
        places = torch.arange(1, 2 * len(bits), 2, dtype=torch.int64, device=bits.device)
        sums.append((bits * places).sum().to(device, non_blocking=True))
    if not sums:
        return torch.zeros((), dtype=torch.int64)
    weights = torch.arange(1, 2 * len(sums), 2, dtype=torch.int64, device=device)
    return (torch.stack(sums) * weights).sum()


def is_adapted(net: nn.Module) -> bool:
    """Whether ``net`` is a ``peft`` model (an adapter on a frozen base)."""
    return hasattr(net, "peft_config") and callable(getattr(net, "get_base_model", None))


def adapter_state(net: nn.Module, model: dict[str, Any]) -> dict[str, Any]:
    """For an adapted ``net``, the checkpoint's ``model`` (``net``'s ``state_dict``) trimmed to the adapter's
    weights, and ``frozen_base``: the base's fingerprint; else ``{"model": model}``."""
    if not is_adapted(net):
        return {"model": model}
    trained = _trained(net)
    return {"model": {key: value for key, value in model.items() if key in trained}, "frozen_base": base_of(net)}


def base_of(net: nn.Module, fresh: bool = False) -> str:
    """The fingerprint of ``net``'s frozen weights and buffers, in hex: computed once per net (again if
    ``fresh``: a load, after which other base weights may have been loaded into the same net)."""
    known = None if fresh else _BASES.get(net)
    if known is None:
        trained = _trained(net)
        frozen = [value for key, value in net.state_dict().items() if key not in trained]
        known = _BASES[net] = f"{int(weights_fingerprint(frozen)) & 0xFFFF_FFFF_FFFF_FFFF:016x}"
    return known


def _trained(net: nn.Module) -> set[str]:
    return {name for name, parameter in net.named_parameters() if parameter.requires_grad}


def check_base(net: nn.Module, checkpoint: dict, source: str) -> set[str] | None:
    """The keys ``checkpoint`` must hold for ``net`` when it is an adapter's (None: every key); a clear error
    when the adapter was trained on another base than ``net``'s."""
    saved = checkpoint.get("frozen_base")
    if saved is None:
        return None
    if not is_adapted(net):
        raise CheckpointError(
            f"{source} holds an adapter's weights (a peft model's), and this net is {type(net).__name__}: load it "
            "into the same peft model (get_peft_model(base, config)) built on the base it was trained on"
        )
    here = base_of(net, fresh=True)
    if saved != here:
        raise CheckpointError(
            f"{source} holds an adapter trained on another base model: the frozen weights it was trained on have "
            f"the fingerprint {saved}, this net's {here}; build the peft model on the same pretrained base (the "
            "same model and weights, in the same dtype) to resume or load it"
        )
    return _trained(net)

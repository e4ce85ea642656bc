"""Sizes of a model: how many parameters it has (and trains), and how many bytes they take.

Shared (tied) parameters count once, as ``net.parameters()`` yields them once. A lazy module's
parameters that are not yet initialised (before its first forward) count as 0. Under FSDP the
figures are those of this rank's shards.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from fitforge.exceptions import FitforgeTypeError, describe


def _unique(tensors: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each tensor once (tied weights are one object), skipping uninitialised lazy parameters."""
    seen: set[int] = set()
    for tensor in tensors:
        if id(tensor) in seen or nn.parameter.is_lazy(tensor):
            continue
        seen.add(id(tensor))
        yield tensor


def _module(net: object, caller: str) -> nn.Module:
    if not isinstance(net, nn.Module):
        raise FitforgeTypeError(f"{caller}: net must be a torch.nn.Module, got {describe(net)}")
    return net


def parameter_counts(net: nn.Module) -> tuple[int, int]:
    """``(total, trainable)``: the number of parameter elements of ``net``, and of those with
    ``requires_grad``.

    Args:
        net: any ``torch.nn.Module``.

    Raises:
        FitforgeTypeError: ``net`` is not a module.

    Example:
        >>> parameter_counts(nn.Linear(3, 2))
        (8, 8)
    """
    total = trainable = 0
    for parameter in _unique(_module(net, "parameter_counts").parameters()):
        total += parameter.numel()
        if parameter.requires_grad:
            trainable += parameter.numel()
    return total, trainable


def parameter_bytes(net: nn.Module) -> int:
    """The bytes held by ``net``'s parameters and buffers (BatchNorm's running statistics...), each
    tensor once, at its own dtype; gradients and optimizer state are not counted.

    Args:
        net: any ``torch.nn.Module``.

    Raises:
        FitforgeTypeError: ``net`` is not a module.

    Example:
        >>> parameter_bytes(nn.Linear(3, 2))  # 8 float32 values
        32
    """
    module = _module(net, "parameter_bytes")
    tensors = _unique(iter([*module.parameters(), *module.buffers()]))
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


__all__ = ["parameter_bytes", "parameter_counts"]

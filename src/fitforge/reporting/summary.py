"""Sizes of a model: how many parameters it has (and trains), and how many bytes they take; tied ones
count once, a lazy module's before its first forward as 0 (under FSDP: this rank's shards)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from fitforge.core.state import EstimatorLike
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
    """``(total, trainable)``: the number of parameter elements of ``net``, and of those with ``requires_grad``."""
    total = trainable = 0
    for parameter in _unique(_module(net, "parameter_counts").parameters()):
        total += parameter.numel()
        if parameter.requires_grad:
            trainable += parameter.numel()
    return total, trainable


def parameter_bytes(net: nn.Module) -> int:
    """The bytes held by the module ``net``'s parameters and buffers, without gradients and optimizer state."""
    module = _module(net, "parameter_bytes")
    tensors = _unique(iter([*module.parameters(), *module.buffers()]))
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def model_summary(estimator: EstimatorLike) -> str:
    """One line about the estimator's net: ``Model: Sequential, 1,290 parameters (1,290 trainable), 5.0 KiB, on
    cpu, float32``."""
    net = estimator.net
    total, trainable = parameter_counts(net)
    dtype = next((p.dtype for p in net.parameters()), torch.get_default_dtype())
    precision = estimator.precision or str(dtype).removeprefix("torch.")
    lazy = " (and lazy ones not built yet)" if any(nn.parameter.is_lazy(p) for p in net.parameters()) else ""
    return (
        f"Model: {model_name(net)}, {total:,} parameters{lazy} ({trainable:,} trainable), "
        f"{_readable(parameter_bytes(net))}, on {estimator.device}, {precision}"
    )


def model_name(net: nn.Module) -> str:
    """The class name of the user's module, also through ``torch.compile``'s wrapper."""
    return type(getattr(net, "_orig_mod", net)).__name__


def _readable(num_bytes: int) -> str:
    """``512 B``, ``5.0 KiB``, ``44.7 MiB``..."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{num_bytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


__all__ = ["model_name", "model_summary", "parameter_bytes", "parameter_counts"]

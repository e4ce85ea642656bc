"""Non-finite (nan, inf) values in gradients (:class:`GradientCheck`, every batch, for NaNGuardHandler),
weights and optimizer states (:func:`non_finite_state`, at each checkpoint save)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fitforge.core.state import EstimatorLike


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (FSDP); any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class GradientCheck:
    """Whether any gradient of ``params`` holds a nan or an inf, decided on the device with GradScaler's
    primitive (a scale of 1: no host read, one fused kernel per device and dtype)."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for param in params:
            if param.is_floating_point():
                groups.setdefault((param.device, param.dtype), []).append(param)
        self._groups = list(groups.values())  # the primitive takes tensors of one device (and dtype) per call
        self._one = {device: torch.ones((), device=device) for device, _ in groups}

    def update(self, found: torch.Tensor) -> None:
        """Set ``found`` (a float32 0-d tensor on the estimator's device) to 1 if a gradient is not finite."""
        for params in self._groups:
            grads = [_local(p.grad._values() if p.grad.is_sparse else p.grad) for p in params if p.grad is not None]
            if not grads:
                continue
            device = grads[0].device
            if device == found.device:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self._one[device])
            else:  # parameters on another device than the estimator's (rare): its own flag, added
                own = torch.zeros((), device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, own, self._one[device])
                found.add_(own.to(found.device)).clamp_(max=1)


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _bad(value: torch.Tensor, strict: bool) -> torch.Tensor:
    """0-d: whether ``value`` holds a nan, or with ``strict`` also an inf (a buffer may hold one on purpose)."""
    if value.dtype in _EXTREMES_DTYPES and value.numel():
        # The extremes judge the whole tensor in one pass with no tensor-sized temporary (a nan makes
        # both nan, an inf is one of them): ~20x faster than isfinite(value).all() on a CPU, and this
        # runs at every checkpoint save, while training waits.
        value = torch.stack(torch.aminmax(value))
    return ~torch.isfinite(value).all() if strict else torch.isnan(value).any()


_EXTREMES_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def non_finite_state(estimator: EstimatorLike) -> list[str]:
    """The names of the net's parameters and optimizer states holding a nan or an inf, and buffers holding
    a nan (an inf in a buffer can be meant: a causal mask), in this process (under FSDP: its shards)."""
    net = estimator.net
    param_names: dict[torch.Tensor, str] = {param: name for name, param in net.named_parameters()}
    params = set(param_names.values())
    names, flags = [], []
    for name, value in net.state_dict().items():
        if _floating(value):
            names.append(name)
            flags.append(_bad(_local(value), name in params))
    for i, optimizer in enumerate(estimator.optimizers):
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if _floating(value):
                    names.append(f"optimizer {i}: {param_names.get(param, '?')} {key}")
                    flags.append(_bad(_local(value), True))
    if not flags:
        return []
    if len({flag.device for flag in flags}) > 1:  # a net spread over devices (rare): one read per tensor
        flags = [flag.cpu() for flag in flags]
    return [name for name, bad in zip(names, torch.stack(flags).tolist()) if bad]


def non_finite_checkpoint(checkpoint: dict, net: torch.nn.Module | None = None) -> list[str]:
    """As :func:`non_finite_state` for a loaded checkpoint dict (not a sharded one); ``net`` tells
    parameters from buffers (without it every tensor is judged as a parameter)."""
    params = None if net is None else {name for name, _ in net.named_parameters()}
    found = [
        name
        for name, value in checkpoint.get("model", {}).items()
        if _floating(value) and bool(_bad(value, params is None or name in params))
    ]
    for i, saved in enumerate(checkpoint.get("optimizers", [])):
        for index, state in saved.get("state", {}).items():
            found += [
                f"optimizer {i}: parameter {index} {key}"
                for key, value in state.items()
                if _floating(value) and bool(_bad(value, True))
            ]
    return found

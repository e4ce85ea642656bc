"""Non-finite (nan, inf) values in gradients, weights and optimizer states.

Two uses with two costs. :class:`GradientCheck` runs every batch for NaNGuardHandler: it ORs
"some gradient is not finite" into a device flag with the primitive GradScaler uses
(``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1: no host read, one fused
kernel per device and dtype). :func:`non_finite_state` runs when a checkpoint is saved, which
reads the host anyway: it names every weight, buffer and optimizer-state tensor holding a nan or
an inf (one host read of a flag per tensor, stacked).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (FSDP); any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class GradientCheck:
    """Whether any gradient of ``params`` holds a nan or an inf, decided on the device."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for param in params:
            if param.is_floating_point():
                groups.setdefault((param.device, param.dtype), []).append(param)
        self._groups = list(groups.values())  # the primitive takes tensors of one device (and dtype) per call
        self._one = {device: torch.ones((), device=device) for device, _ in groups}

    def update(self, found: torch.Tensor) -> None:
        """Set ``found`` (a float32 0-d tensor on the estimator's device) to 1 if a gradient is not
        finite; leave it otherwise. Gradients are multiplied by 1 in place: unchanged."""
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


def non_finite_state(estimator: Any) -> list[str]:
    """The names of the net's weights and buffers and the optimizers' state tensors that hold a
    nan or an inf (``"0.weight"``, ``"optimizer 0: 0.weight exp_avg"``), in this process (under
    FSDP: its shards). Reads one flag per tensor to the host."""
    names, tensors = [], []
    for name, value in estimator.net.state_dict().items():
        if _floating(value):
            names.append(name)
            tensors.append(_local(value))
    param_names = {param: name for name, param in estimator.net.named_parameters()}
    for i, optimizer in enumerate(estimator.optimizers):
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if _floating(value):
                    names.append(f"optimizer {i}: {param_names.get(param, '?')} {key}")
                    tensors.append(_local(value))
    if not tensors:
        return []
    flags = [torch.isfinite(t).all() for t in tensors]
    if len({flag.device for flag in flags}) > 1:  # a net spread over devices (rare): one read per tensor
        flags = [flag.cpu() for flag in flags]
    return [name for name, finite in zip(names, torch.stack(flags).tolist()) if not finite]


def non_finite_checkpoint(checkpoint: dict) -> list[str]:
    """As :func:`non_finite_state` for a loaded checkpoint dict (its ``model`` and ``optimizers``);
    a sharded checkpoint keeps its weights elsewhere and is not judged here."""
    found = [name for name, value in checkpoint.get("model", {}).items()
             if _floating(value) and not bool(torch.isfinite(value).all())]
    for i, saved in enumerate(checkpoint.get("optimizers", [])):
        for index, state in saved.get("state", {}).items():
            found += [f"optimizer {i}: parameter {index} {key}" for key, value in state.items()
                      if _floating(value) and not bool(torch.isfinite(value).all())]
    return found

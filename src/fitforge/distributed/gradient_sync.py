"""Gradient accumulation under DDP: only a group's last batch all-reduces (docs/distributed.md)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fitforge.distributed.ranks import flat_collective


def synced_parameters(ddp: DistributedDataParallel) -> tuple[list[nn.Parameter], bool]:
    """The parameters whose gradients ``ddp`` all-reduces (each once), and whether any gets sparse ones."""
    seen: set[int] = set()
    params, sparse = [], False
    for module_name, module in ddp.module.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{name}" if module_name else name
            if not param.requires_grad or full_name in ddp.parameters_to_ignore or id(param) in seen:
                continue
            seen.add(id(param))
            params.append(param)
            sparse = sparse or (isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse)
    return params, sparse


def deferrable(net: nn.Module) -> GradientSync | None:
    """A :class:`GradientSync` for a DDP wrapper without sparse gradients; None otherwise (every batch syncs)."""
    if not isinstance(net, DistributedDataParallel):
        return None
    params, sparse = synced_parameters(net)
    return None if sparse or not params else GradientSync(net, params)


class GradientSync:
    """Switches one DDP wrapper's all-reduce per batch (no device sync), and averages what it left local
    (``local``: whether the gradients hold this rank's share only)."""

    def __init__(self, ddp: DistributedDataParallel, params: list[nn.Parameter]) -> None:
        self._ddp, self._params = ddp, params
        self._restore = ddp.require_backward_grad_sync
        self.local = False

    def before_batch(self, sync: bool) -> None:
        """Before a training batch's forward: whether its backward all-reduces."""
        self._ddp.require_backward_grad_sync = sync
        self.local = not sync

    def average(self) -> None:
        """Average the local gradients over the ranks (a collective); nothing when none are local."""
        if self.local:
            average_gradients(self._params, self._ddp.process_group)
            self.local = False

    def restore(self) -> None:
        """Give the wrapper back its flag as training found it (so evaluate and later fits sync)."""
        self._ddp.require_backward_grad_sync = self._restore


def average_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Replace each gradient by its mean over the ranks of ``group``, as DDP's reducer does: a parameter
    with a gradient on some rank gets one on every rank (zeros where it had none), else keeps None."""
    if not params:
        return
    held = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(held, op=dist.ReduceOp.MAX, group=group)
    anywhere = [param for param, flag in zip(params, held.tolist()) if flag]
    for param in anywhere:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    world = dist.get_world_size(group)

    def mean(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=group)
        flat.div_(world)

    flat_collective([param.grad for param in anywhere], mean)  # type: ignore[misc]

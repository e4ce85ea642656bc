"""Schedule-free optimizers (the ``schedulefree`` package's ``AdamWScheduleFree``...): they train one sequence of
weights and evaluate another, switched by their ``train()`` and ``eval()``. :class:`ScheduleFreeWeights` makes the
switch for fit's validations, ``evaluate``, ``predict`` and the best checkpoint, as an average of the weights.

``eval()`` moves each weight towards the optimizer's ``z``, and ``train()`` back: in floating point, not exactly.
So the training weights are copied aside while the evaluated ones are in the net, and put back bitwise: a
training with validations goes on exactly as one without. Checkpoints hold the training weights and the
optimizer's state, so a resume continues bitwise; the best checkpoint holds the evaluated ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fitforge.core.services import WeightAveraging


def switches_modes(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` trains and evaluates different weights (a schedule-free one: ``train()``,
    ``eval()`` and a ``train_mode`` in its parameter groups)."""
    return callable(getattr(optimizer, "eval", None)) and all("train_mode" in g for g in optimizer.param_groups)


def to_train_mode(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Before a fit's first step: each schedule-free optimizer training (a step in eval mode is refused)."""
    for optimizer in optimizers:
        if switches_modes(optimizer) and not all(g["train_mode"] for g in optimizer.param_groups):
            optimizer.train()  # type: ignore[attr-defined]  # a schedule-free optimizer's method


class ScheduleFreeWeights(WeightAveraging):
    """The evaluated weights of the schedule-free ``optimizers`` of ``net``, as ``estimator.weight_average``.
    Built by :func:`schedule_free_weights`."""

    def __init__(self, net: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.net, self.optimizers = net, list(optimizers)
        self._kept: list[tuple[torch.optim.Optimizer, list[torch.Tensor]]] = []
        self._swapped = 0  # nested swaps (an evaluate run from a handler during a validation): the outer one acts

    @torch.no_grad()
    def swap_in(self) -> None:
        """The evaluated weights into the net (those of optimizers in train mode), the training ones copied aside."""
        self._swapped += 1
        if self._swapped > 1:
            return
        training = [o for o in self.optimizers if all(g["train_mode"] for g in o.param_groups)]
        self._kept = [(o, [p.detach().clone() for p in _parameters(o)]) for o in training]
        for optimizer in training:
            optimizer.eval()  # type: ignore[attr-defined]

    @torch.no_grad()
    def swap_out(self) -> None:
        """The training weights back, bitwise, and the optimizers in train mode."""
        self._swapped = max(0, self._swapped - 1)
        if self._swapped:
            return
        kept, self._kept = self._kept, []
        for optimizer, copies in kept:
            for parameter, copy in zip(_parameters(optimizer), copies):
                parameter.copy_(copy)
            for group in optimizer.param_groups:
                group["train_mode"] = True

    def averaged_net(self) -> nn.Module:
        return self.net

    def load_averaged(self, weights: dict[str, Any]) -> None:
        """``weights`` (evaluated ones: the best epoch's) into the net, the optimizers left in eval mode: they
        evaluate as they are; a later fit switches them to train mode first."""
        self.net.load_state_dict(weights)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["train_mode"] = False

    def __repr__(self) -> str:
        return f"ScheduleFreeWeights({', '.join(type(o).__name__ for o in self.optimizers)})"


def schedule_free_weights(net: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> ScheduleFreeWeights | None:
    """The :class:`ScheduleFreeWeights` of ``net`` when one of ``optimizers`` is schedule-free, else None."""
    switching = [optimizer for optimizer in optimizers if switches_modes(optimizer)]
    return ScheduleFreeWeights(net, switching) if switching else None


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [parameter for group in optimizer.param_groups for parameter in group["params"]]

"""Named values a step or a handler logs with :meth:`TrainState.log <fitforge.TrainState.log>`, kept in
the state's :class:`PendingValues` until the run's MetricHandler (a layer above) averages them per epoch.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any

import torch

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

log = logging.getLogger("fitforge")


class PendingValues(list):
    """The ``(name, value)`` pairs logged and not yet taken by a MetricHandler.

    Attributes:
        collected: a MetricHandler takes the values (set at its first ``epoch_begin``); until then
            ``state.log`` drops them.
        dropping: the drop was reported (or needs no report): later values are dropped silently.
    """

    __slots__ = ("collected", "dropping")

    def __init__(self) -> None:
        super().__init__()
        self.collected = False
        self.dropping = False


def checked_value(name: Any, value: Any) -> torch.Tensor | float:
    """``value`` as ``state.log`` keeps it: a detached 0-d tensor (on its device: nothing is read
    to the host) or a float; a bad ``name`` or ``value`` raises naming the fix."""
    if not isinstance(name, str) or not name:
        raise FitforgeTypeError(
            f"state.log: name must be a non-empty str such as 'g_loss' (it becomes train_<name>/val_<name>), "
            f"got {describe(name)}"
        )
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise FitforgeValueError(
                f"state.log({name!r}, ...): value must be a tensor with one element, got one of shape "
                f"{tuple(value.shape)}; reduce it first, e.g. value.mean()"
            )
        if value.dtype == torch.bool or value.is_complex():
            kind = "a bool" if value.dtype == torch.bool else "a complex"
            raise FitforgeTypeError(
                f"state.log({name!r}, ...): value is {kind} tensor, which has no mean to log; "
                + ("log value.float() to average it as 0/1" if value.dtype == torch.bool else "log its .abs() or .real")
            )
        value = value.detach().reshape(())
        return value if value.is_floating_point() else value.to(torch.get_default_dtype())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = "log float(value) to average it as 0/1" if isinstance(value, bool) else "log a number or a tensor"
        raise FitforgeTypeError(
            f"state.log({name!r}, ...): value must be a real number or a tensor with one element, "
            f"got {describe(value)}; {hint}"
        )
    return float(value)


def dropped(pending: PendingValues, name: str, warn: bool) -> None:
    """Report once that logged values are dropped because no MetricHandler takes them."""
    pending.dropping = True
    if warn:
        log.warning(
            "state.log(%r, ...): no MetricHandler runs in this fit, so logged values are dropped; add "
            "fitforge.handlers.MetricHandler() to event_handlers (default_handlers=False leaves it out) "
            "to record them as train_<name>",
            name,
        )

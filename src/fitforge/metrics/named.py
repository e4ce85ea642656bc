"""The per-epoch means of named values (``state.log(name, value)``): each call counts once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.metrics.base import merge_metric_state
from fitforge.metrics.builtin import Mean


def declared_names(processor: Any) -> tuple[str, ...]:
    """The names a batch processor declares in its ``logs`` attribute, checked."""
    names = processor.logs
    if isinstance(names, str) or not isinstance(names, (tuple, list)):
        raise FitforgeTypeError(
            f"{type(processor).__name__}.logs must be a tuple of the names its steps give state.log, "
            f"e.g. ('d_loss', 'g_loss'), got {describe(names)}"
        )
    for name in names:
        if not isinstance(name, str) or not name:
            raise FitforgeTypeError(
                f"{type(processor).__name__}.logs must hold non-empty strs (names), got {describe(name)} in {names!r}"
            )
    return tuple(dict.fromkeys(names))


class NamedMeans:
    """The running means of the named values of one phase.

    Args:
        prefix: ``"train_"`` or ``"val_"``, for the keys and the messages.
        declared: names with a mean from the start.
        reserved: ``{name: what records it}`` for names the phase's loss and metrics use (refused).
    """

    def __init__(self, prefix: str, declared: Iterable[str] = (), reserved: Mapping[str, str] | None = None) -> None:
        self.prefix = prefix
        self.reserved = dict(reserved or {})
        self.means: dict[str, Mean] = {}
        for name in declared:
            self.add(name, declared=True)

    def add(self, name: str, declared: bool = False) -> Mean:
        """A mean for a new name; a name the loss or a metric records is refused."""
        if name in self.reserved:
            where = "declared in BatchProcessor.logs" if declared else f"given to state.log({name!r}, ...)"
            raise FitforgeValueError(
                f"the name {name!r} {where} would record {self.prefix}{name}, which {self.reserved[name]} "
                f"records already; log the value under another name, e.g. {name + '_extra'!r}"
            )
        mean = self.means[name] = Mean()
        return mean

    def check(self, pending: Iterable[tuple[str, Any]]) -> None:
        """Refuse the names among ``pending`` the loss or a metric records (before any is taken)."""
        for name, _ in pending:
            if name not in self.means and name in self.reserved:
                self.add(name)

    def take(self, pending: list[tuple[str, Any]], device: torch.device) -> None:
        """Add the pending ``(name, value)`` pairs to their means (on ``device``) and empty the list."""
        means = self.means
        for name, value in pending:
            mean = means.get(name) or self.add(name)
            if type(value) is float:  # a Python number: a 0-d tensor filled on the device (no host copy to wait on)
                value = torch.full(
                    (), value, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device
                )
            elif value.device != device:
                value = value.to(device)
            mean.update(value)
        pending.clear()

    def reset(self) -> None:
        for mean in self.means.values():
            mean.reset()

    def in_order(self) -> list[Mean]:
        """The means sorted by name: the same order on every rank (for one ``all_reduce``)."""
        return [self.means[name] for name in sorted(self.means)]

    def values(self) -> dict[str, float]:
        """The means as floats keyed ``<prefix><name>``; a name without a value this epoch is left out."""
        return {self.prefix + name: mean.value() for name, mean in self.means.items() if mean._count}

    def state_dict(self) -> dict[str, dict]:
        return {name: mean.state_dict() for name, mean in self.means.items()}

    def load(self, saved: list[dict[str, dict]], device: torch.device) -> None:
        """Continue from the :meth:`state_dict` of one rank, or the total of several."""
        for states in saved:
            for name, state in states.items():
                mean = self.means.get(name) or self.add(name)
                if mean._sum is None and not mean._count:
                    mean.load_state_dict(state)
                else:
                    merge_metric_state(mean, state)
                mean.to(device)

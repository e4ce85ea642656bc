"""What a handler may ask of the other processes of a fit: ``state.run.ranks``.

A handler whose decision must be the same on every process (a checkpoint written once, a batch
skipped everywhere) asks here, and holds no rank logic itself. :class:`OneProcess` answers at once;
under torch.distributed (:class:`fitforge.distributed.stop_agreement.StopAgreement` in a fit,
:class:`fitforge.distributed.ranks.Collective` in a pass) the answers are collectives, which every
rank must reach at the same point (an evaluation's shares may differ in length: ask at its epoch ends).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class Processes(Protocol):
    """The processes of a fit, as a handler sees them: ``rank`` (0 alone), ``main`` (rank 0, which reports
    and writes for all), ``several`` (more than one process) and ``size``."""

    rank: int
    main: bool
    several: bool
    size: int

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on at least one process (a collective)."""

    def min_int(self, value: int) -> int:
        """The smallest of every process's ``value`` (a collective)."""

    def max_(self, tensor: torch.Tensor) -> None:
        """Every process's ``tensor`` replaced by the elementwise largest, on its device (a collective)."""

    def sum_(self, tensor: torch.Tensor) -> None:
        """Every process's ``tensor`` replaced by the elementwise sum, on its device (a collective)."""

    def on_main(self, fn: Callable[[], T], error_type: type[Exception] = RuntimeError) -> T | None:
        """``fn()`` run by the main process, its result (or its error) on every process (a collective)."""


class OneProcess:
    """The processes of a fit in one process: every answer is this process's own."""

    rank, main, several, size = 0, True, False, 1

    def any(self, flag: bool) -> bool:
        return flag

    def min_int(self, value: int) -> int:
        return value

    def max_(self, tensor: torch.Tensor) -> None:
        pass

    def sum_(self, tensor: torch.Tensor) -> None:
        pass

    def on_main(self, fn: Callable[[], Any], error_type: type[Exception] = RuntimeError) -> Any:
        return fn()


ONE_PROCESS = OneProcess()

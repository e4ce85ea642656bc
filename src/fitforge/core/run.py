"""The machinery of one fit that handlers do not read: a :class:`RunContext`.

The Estimator assembles it; the loop only calls it. ``state._loop`` points to it during fit, for
fitforge's own checkpointing (which saves and restores the data order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fitforge.core.coordinator import Alone, Coordinator, PassWatch
from fitforge.core.dispatch import Dispatcher
from fitforge.core.events import EventHandler
from fitforge.core.modules import switch_training
from fitforge.core.state import TrainState

Step = Callable[[TrainState, Any], Any]  # (state, batch) -> the batch's output


class EpochData(Protocol):
    """The data of each epoch (:class:`fitforge.inputs.order.DataOrder` in fit,
    :class:`fitforge.inputs.order.OnePass` in evaluate and predict)."""

    def epoch(self, state: TrainState) -> tuple[Iterable, int]:
        """The data of ``state.epoch`` and the position of its first batch (0 unless resumed)."""
        ...

    def close(self) -> None:
        """Called once the run is over."""


@dataclass(eq=False)
class RunContext:
    """One run of the loop (a fit, or an evaluate or predict pass).

    Attributes:
        name: what the data is called in errors (``"train_data"``...).
        check: the step of the run's first batch, with its checks (:mod:`fitforge.checks.first_batch`),
            called instead of ``step`` while the state holds no output (no batch completed a step);
            ``step`` itself where nothing is checked.
        prepare: called once after every ``train_begin`` and before the first epoch (a resume).
        resume_from: the checkpoint the run resumes from, weights loaded, as a checkpoint handler's
            ``train_begin`` picked it (of several, the last); ``prepare`` restores the rest.
        allow_empty: a pass of no batch is no error (a rank's share of evaluation data may be empty).
        watch: in a pass within a fit (a validation), asked between batches whether a signal abandons it.
    """

    dispatcher: Dispatcher
    step: Step
    data: EpochData
    name: str
    check: Step
    coordinator: Coordinator = field(default_factory=Alone)
    prepare: Sequence[Callable[[TrainState], None]] = ()
    resume_from: dict[str, Any] | None = None
    allow_empty: bool = False
    watch: PassWatch | None = None

    @property
    def handlers(self) -> list[EventHandler]:
        """The run's handlers in dispatch order."""
        return self.dispatcher.handlers


class inference:
    """Eval mode under ``torch.inference_mode`` for a block (``no_grad`` with ``inference_mode=False``:
    FSDP keeps the parameters it gathers for the next forward, which must not be inference tensors);
    the modules' modes are restored after. With ``average`` (a
    :class:`~fitforge.core.roles.WeightAveraging` handler) that evaluates averaged, the block runs
    with its averaged weights. Entered once. A class, not a generator (half the cost, at every
    validation)."""

    __slots__ = ("average", "grad", "net", "restore")

    def __init__(self, net: nn.Module, inference_mode: bool = True, average: Any = None) -> None:
        self.net = net
        self.grad = torch.inference_mode() if inference_mode else torch.no_grad()  # inference_mode: no version counters
        self.restore: Callable[[], None] | None = None
        self.average = average if average is not None and average.evaluates_averaged else None

    def __enter__(self) -> None:
        if self.restore is not None:
            raise RuntimeError("inference(...) is entered once: make a new one for each block")
        self.restore = switch_training(self.net, False)
        try:
            if self.average is not None:  # outside inference_mode: the net's own tensors are written
                self.average.swap_in()
            self.grad.__enter__()
        except BaseException:
            if self.average is not None:
                self.average.swap_out()
            self.restore()
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.grad.__exit__(*exc_info)
            if self.average is not None:
                self.average.swap_out()
        finally:
            assert self.restore is not None  # set by __enter__
            self.restore()

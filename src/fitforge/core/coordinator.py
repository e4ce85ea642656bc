"""How the loop learns about stops that other processes decided: the :class:`Coordinator` interface,
which also answers what handlers ask of the other processes (:class:`~fitforge.core.processes.Processes`).

The loop calls the coordinator at fixed points of a fit: after ``train_begin``, ``epoch_begin`` and
``epoch_end`` (:meth:`~Coordinator.agree_on_stop`) and after each training batch
(:meth:`~Coordinator.after_batch`, which says whether training stops there); fit's signal handler
calls it when SIGTERM, SIGUSR1 or SIGINT asks the fit to stop (:meth:`~Coordinator.signal_received`,
see :mod:`fitforge.core.preemption`). In one process there is nobody to agree with:
:class:`Alone` turns a signal into a stop and stops where this process asked. Under
torch.distributed, :class:`fitforge.distributed.stop_agreement.StopAgreement` makes every rank stop
at the same batch.

A pass run within the fit (a validation, an evaluate a handler calls) asks the fit's coordinator
through a :class:`PassWatch` between its batches whether a signal abandons it
(:meth:`~Coordinator.abandons_pass`), and at its end whether any process abandoned it
(:meth:`~Coordinator.end_pass`): then it raises :class:`~fitforge.exceptions.PassAbandoned`
instead of reporting a partial result, and the fit saves without waiting for the rest of the pass.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import Protocol

from fitforge.core.processes import OneProcess, Processes
from fitforge.core.state import TrainState
from fitforge.exceptions import CancelFit, PassAbandoned

log = logging.getLogger("fitforge")


class Coordinator(Processes, Protocol):
    """Agreement on stops between the processes that run one fit.

    ``holds_cancels``: a CancelFit raised at a batch end is held until the processes agree (the
    loop then runs the batch's remaining ``batch_end`` hooks and counts the batch, so that this
    process stays in step with the others); False: it ends the fit at once."""

    holds_cancels: bool

    def agree_on_stop(self, state: TrainState) -> None:
        """Make a stop that any process requested (or a signal any received) hold for all, now."""

    def after_batch(self, state: TrainState, cancel: CancelFit | None = None) -> bool:
        """After a training batch (also a cancelled one): whether training stops here, on every
        process. ``cancel``: the CancelFit this batch raised; raised from here when the fit ends
        with it now (otherwise held until the processes agree, and this returns False)."""
        ...

    def signal_received(self, state: TrainState, signum: int) -> None:
        """SIGTERM, SIGUSR1 or SIGINT reached this process during fit (called from the signal handler)."""

    def abandons_pass(self, state: TrainState) -> bool:
        """Between two batches of a pass within the fit (``state``: the fit's): whether a signal
        asks this process to leave the pass now (cheap: a pass asks after every batch)."""
        ...

    def end_pass(self, state: TrainState, abandoned: bool) -> bool:
        """At the end of a pass within the fit, on every process (whether it ran all its batches or
        ``abandoned`` it): whether any process abandoned it. Then ``state.preempted`` is set on
        every process and the pass is dropped everywhere, at the same point."""
        ...


@dataclass(frozen=True, eq=False)
class PassWatch:
    """What a pass run within a fit asks the fit's coordinator: the pair of them, bound."""

    coordinator: Coordinator
    fit_state: TrainState

    def abandons(self) -> bool:
        return self.coordinator.abandons_pass(self.fit_state)

    def end(self, abandoned: bool) -> None:
        """Raise PassAbandoned when any process abandoned the pass (see :meth:`Coordinator.end_pass`)."""
        if self.coordinator.end_pass(self.fit_state, abandoned):
            raise PassAbandoned


class Alone(OneProcess):
    """The coordinator of a fit in one process: nothing to agree on; a signal stops at once."""

    holds_cancels = False

    def agree_on_stop(self, state: TrainState) -> None:
        pass

    def after_batch(self, state: TrainState, cancel: CancelFit | None = None) -> bool:
        if cancel is not None:
            raise cancel
        return state.stop_requested

    def abandons_pass(self, state: TrainState) -> bool:
        return state.preempted is not None

    def end_pass(self, state: TrainState, abandoned: bool) -> bool:
        return abandoned

    def signal_received(self, state: TrainState, signum: int) -> None:
        name = signal.Signals(signum).name
        state.preempted = signum
        state.request_stop(f"preempted by {name}")
        log.warning(
            "received %s: training stops at the end of this batch, or of this validation batch (saved by a "
            "CheckpointHandler, if any); send it again to stop at once",
            name,
        )

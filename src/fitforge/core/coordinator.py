"""How the loop learns about stops that other processes decided: the :class:`Coordinator` interface,
which also answers what handlers ask of the other processes (:class:`~fitforge.core.processes.Processes`).

The loop calls it at fixed points of a fit, and fit's signal handler when a signal asks the fit to
stop (:mod:`fitforge.signals.preemption`). :class:`Alone` serves one process; under torch.distributed,
:class:`fitforge.distributed.stop_agreement.StopAgreement` makes every rank stop at the same batch. A
validation within the fit asks it through a :class:`PassWatch` whether a signal abandons the pass.
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
    loop finishes and counts the batch, in step with the others); False: it ends the fit at once."""

    holds_cancels: bool

    def agree_on_stop(self, state: TrainState) -> None:
        """Make a stop that any process requested (or a signal any received) hold for all, now."""

    def after_batch(self, state: TrainState, cancel: CancelFit | None = None) -> bool:
        """After a training batch (also a cancelled one): whether training stops here, on every
        process. ``cancel``, the CancelFit this batch raised, is raised here once the fit ends with it."""

    def signal_received(self, state: TrainState, signum: int) -> None:
        """SIGTERM, SIGUSR1 or SIGINT reached this process during fit (called from the signal handler)."""

    def abandons_pass(self, state: TrainState) -> bool:
        """Between two batches of a pass within the fit (``state``: the fit's): whether a signal
        asks this process to leave the pass now (cheap: asked after every batch)."""

    def end_pass(self, state: TrainState, abandoned: bool) -> bool:
        """At the end of a pass within the fit, on every process: whether any process abandoned it
        (then ``state.run.preempted`` is set, and the pass dropped, on every process)."""


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
        return state.run.stop_requested

    def abandons_pass(self, state: TrainState) -> bool:
        return state.run.preempted is not None

    def end_pass(self, state: TrainState, abandoned: bool) -> bool:
        return abandoned

    def signal_received(self, state: TrainState, signum: int) -> None:
        name = signal.Signals(signum).name
        state.run.preempted = signum
        state.run.stop(f"preempted by {name}")
        log.warning(
            "received %s: training stops at the end of this batch, or of this validation batch (saved by a "
            "CheckpointHandler, if any); send it again to stop at once",
            name,
        )

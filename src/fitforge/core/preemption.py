"""Preemption: SIGTERM or SIGINT during ``fit`` stops training cleanly at the next batch boundary.

The signal only sets ``state.preempted`` and requests a stop, so the batch under way finishes
(its optimizer step included). A CheckpointHandler then writes the state whatever its periods,
``train_end`` runs, and :func:`raise_if_preempted` ends ``fit``: SIGTERM with ``SystemExit(143)``
(128 + 15, the exit status schedulers such as SLURM and Kubernetes expect), SIGINT with
``KeyboardInterrupt``. A second signal while stopping acts at once. Signals can be caught only in
the main thread; ``fit`` in another thread leaves them alone.

Under torch.distributed a signal may reach one rank only, or the ranks in different batches, and a
rank that stops alone leaves the others waiting in a collective. So the signal goes to the fit's
coordinator: in one process it stops at once; under torch.distributed the
:class:`~fitforge.distributed.stop_agreement.StopAgreement` reduces it across ranks at its next
agreement (within a few batches) and sets ``preempted`` on every rank at the same batch end.
"""

from __future__ import annotations

# signal.signal and signal.getsignal wrap _signal's and turn every int into an enum member on the way
# (most of their cost, at every fit); the raw functions take and give the same handlers as ints.
import _signal  # type: ignore[import-not-found]  # CPython's C module under signal; typeshed has no stub
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fitforge.core.coordinator import Coordinator
from fitforge.core.state import TrainState

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_NUMBERS = tuple(int(signum) for signum in SIGNALS)


def _act_now(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _pass_on(signum: int, handler: Any, frame: Any) -> None:
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:  # the default action (None: a handler not installed from Python)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


@contextmanager
def preemptible(state: TrainState, coordinator: Coordinator) -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT go to ``coordinator.signal_received`` (which stops
    training at the next batch boundary, on every rank); a second signal acts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    pid = os.getpid()
    received: list[int] = []

    def handle(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # a forked DataLoader worker inherited this handler: act as before fit
            _pass_on(signum, previous[signum], frame)
            return
        if received:
            _act_now(signum)
        received.append(signum)
        coordinator.signal_received(state, signum)

    previous = {signum: _signal.getsignal(signum) for signum in _NUMBERS}
    for signum in _NUMBERS:
        _signal.signal(signum, handle)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            _signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def raise_if_preempted(state: TrainState) -> None:
    """End ``fit`` as the signal asked, once training stopped cleanly."""
    if state.preempted is not None:
        _act_now(state.preempted)

"""Preemption: SIGTERM, SIGUSR1 or SIGINT during ``fit`` stops training after the current batch, with a
checkpoint and the exit status the scheduler expects (docs/checkpoints.md, "Preemption"). A signal may
reach one rank only, so it goes to the fit's coordinator, which stops every rank at the same point.
"""

from __future__ import annotations

# signal.signal and signal.getsignal wrap _signal's and turn every int into an enum member on the way
# (most of their cost, at every fit); the raw functions take and give the same handlers as ints.
import _signal  # type: ignore[import-not-found]  # CPython's C module under signal; typeshed has no stub
import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fitforge.core.coordinator import Coordinator
from fitforge.core.state import TrainState
from fitforge.signals.worker_shield import shielding

log = logging.getLogger("fitforge")
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_NUMBERS = tuple(int(signum) for signum in SIGNALS)
REQUEUED = 0  # the exit status after SIGUSR1 once the job is requeued: the job did what it should
REQUEUE_TIMEOUT = 60  # seconds scontrol may take (the controller may be busy; the grace time is longer)


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


class Preemption:
    """The signals one fit received, passed on to its coordinator (held until :meth:`attach`)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._target: tuple[TrainState, Coordinator] | None = None

    def attach(self, state: TrainState, coordinator: Coordinator) -> None:
        self._target = (state, coordinator)
        if self.received:
            coordinator.signal_received(state, self.received[0])

    def receive(self, signum: int) -> None:
        if self.received:
            _act_now(signum)
        self.received.append(signum)
        if self._target is not None:
            state, coordinator = self._target
            coordinator.signal_received(state, signum)


@contextmanager
def preemptible(preemption: Preemption) -> Iterator[None]:
    """Within the block, SIGTERM, SIGUSR1 and SIGINT go to ``preemption``; a second signal acts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    pid = os.getpid()

    def handle(signum: int, frame: Any) -> None:
        if os.getpid() != pid:  # a forked DataLoader worker inherited this handler: act as before fit
            _pass_on(signum, previous[signum], frame)
            return
        preemption.receive(signum)

    previous = {signum: _signal.getsignal(signum) for signum in _NUMBERS}
    for signum in _NUMBERS:
        _signal.signal(signum, handle)
    try:
        with shielding():  # the loaders' workers leave the signals to this process
            yield
    finally:
        for signum, handler in previous.items():
            _signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def raise_if_preempted(state: TrainState) -> None:
    """End ``fit`` as the signal asked, once training stopped cleanly (see the module docstring)."""
    if state.run.preempted == signal.SIGUSR1 and os.environ.get("SLURM_JOB_ID"):
        raise SystemExit(REQUEUED if _requeued(state) else 128 + signal.SIGUSR1)
    if state.run.preempted is not None:
        _act_now(state.run.preempted)


def _requeued(state: TrainState) -> bool:
    """Whether the SLURM job is requeued: the main process asks ``scontrol`` (the others trust it)."""
    job, scontrol = os.environ["SLURM_JOB_ID"], shutil.which("scontrol")
    if scontrol is None:
        log.warning("received SIGUSR1 under SLURM job %s, but scontrol is not on the PATH: not requeued", job)
        return False
    if not state.run.ranks.main:
        return True
    try:
        done = subprocess.run(
            [scontrol, "requeue", job], capture_output=True, text=True, timeout=REQUEUE_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("scontrol requeue %s failed (%s): the job is not requeued", job, error)
        return False
    if done.returncode != 0:
        log.warning(
            "scontrol requeue %s failed (exit status %d): %s; the job is not requeued",
            job,
            done.returncode,
            done.stderr.strip(),
        )
        return False
    log.warning("SLURM job %s requeued after SIGUSR1: it resumes from the checkpoint when it runs again", job)
    return True

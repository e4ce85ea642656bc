"""Under torch.distributed, every rank stops training at the same point.

A rank that stops alone leaves the others waiting in a collective (the next backward, a metric
reduction, a checkpoint): a deadlock. Stops come from per-rank sources (a signal that reached one
rank, ``max_time`` on one rank's clock, a handler judging this rank's values), so the loop agrees
on them: after every training batch (also a cancelled one), after ``train_begin`` and after every
``epoch_end``, one ``MAX`` all-reduce of three host integers over a gloo group (no GPU is synced)
carries this rank's received signal, whether it requested a stop and whether it raised CancelFit. When
any rank got a signal, every rank sets ``state.preempted`` and stops; when any rank requested a
stop, every rank stops. A CheckpointHandler then saves that state at the epoch end that follows.
A CancelFit raised in a batch on one rank is raised on the others at the same point.

After a batch that this rank does not stop at, the all-reduce runs while the next batch is read
from the data (``after_batch`` starts it, ``stopped_elsewhere`` waits for it before that batch trains): its
latency hides behind the data loading, and an agreed stop still falls after the same batch on
every rank (the batch read meanwhile is not trained).

After the first batch it also checks once that the replicas' weights are still identical: a
custom ``fit_batch`` that calls ``estimator.net`` instead of ``estimator.train_net`` bypasses DDP,
and its ranks would silently train apart.
"""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

from fitforge.core.state import TrainState
from fitforge.distributed.ranks import cpu_group, reduce_ints
from fitforge.exceptions import CancelFit, FitforgeValueError

log = logging.getLogger("fitforge")


class StopAgreement:
    """The coordinator of one fit on several ranks (see the module docstring and
    :class:`fitforge.core.coordinator.Coordinator`)."""

    def __init__(self, check_replicas: bool) -> None:
        self._group = cpu_group()
        self._check_replicas = check_replicas
        self._flags = torch.zeros(3, dtype=torch.int64)  # signal, stop requested, CancelFit raised
        self._work: dist.Work | None = None  # an all-reduce under way, started after a batch
        self._signalled = 0  # the signal this rank received, until every rank knows it

    def signal_received(self, state: TrainState, signum: int) -> None:
        """Remember the signal for the next agreement, which stops every rank at the same batch."""
        self._signalled = signum
        log.warning(
            "received %s: every rank stops at the end of the next batch (saved by a CheckpointHandler, if any); "
            "send it again to stop at once",
            signal.Signals(signum).name,
        )

    def agree_on_stop(self, state: TrainState, cancel_fit: bool = False) -> None:
        """Reduce this rank's signal and stop request now; stop every rank if any rank asked."""
        self.stopped_elsewhere(state)
        flags = [self._signalled, int(state.stop_requested), int(cancel_fit)]
        self._apply(state, reduce_ints(flags, "max"), cancel_fit)

    def after_batch(self, state: TrainState, cancel_fit: bool = False) -> None:
        """After a training batch (the first: also the replicas check): agree at once when this
        rank stops here, else start the reduction for :meth:`stopped_elsewhere` to apply before
        the next batch. ``cancel_fit``: this rank raised CancelFit in the batch (the others raise it too)."""
        if self._check_replicas and state.optimizer_steps > 0:
            self._check_replicas = False
            _check_replicas(state)
        if state.stop_requested or cancel_fit:
            self.agree_on_stop(state, cancel_fit)
            return
        self.stopped_elsewhere(state)
        self._flags[0], self._flags[1], self._flags[2] = self._signalled, 0, 0
        self._work = dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def stopped_elsewhere(self, state: TrainState) -> bool:
        """Apply the reduction :meth:`after_batch` started, if any; whether it stopped training."""
        if self._work is None:
            return False
        self._work.wait()
        self._work = None
        stopped = state.stop_requested
        self._apply(state, self._flags.tolist(), False)
        return state.stop_requested and not stopped

    @staticmethod
    def _apply(state: TrainState, flags: list[int], cancelled_here: bool) -> None:
        signum, stop, cancel_fit = flags
        if signum not in (0, *(int(s) for s in signal.Signals)) or stop not in (0, 1) or cancel_fit not in (0, 1):
            raise FitforgeValueError(
                "the ranks got out of step (their collectives no longer pair up): a CancelBatch or CancelEpoch "
                "raised on some ranks only, or a handler that skips work on some ranks, is the usual cause; "
                "decide such things alike on every rank (from values reduced across ranks)"
            )
        if cancel_fit and not cancelled_here:
            raise CancelFit("CancelFit raised on another rank")
        if signum and state.preempted is None:
            state.preempted = signum
            state.request_stop(f"preempted by {signal.Signals(signum).name} (on at least one rank)")
        elif stop and not state.stop_requested:
            state.request_stop("another rank requested a stop")


def _check_replicas(state: TrainState) -> None:
    """Every rank's weights must be equal after an optimizer step under DDP (one all-reduce)."""
    params = [p.detach() for p in state.estimator.net.parameters()]
    if not params:
        return
    checksum = torch.stack([p.double().sum() for p in params]).sum().cpu()
    bounds = torch.stack([checksum, -checksum])  # one MAX all-reduce gives the largest and the smallest
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=cpu_group())
    if not bool(torch.isfinite(bounds).all()):
        return  # weights already nan or inf: a NaNGuardHandler's business, not a bypass
    if bool(bounds[0] != -bounds[1]):
        raise FitforgeValueError(
            "the ranks' weights differ after the first optimizer step, so their gradients were not averaged: a "
            "BatchProcessor.fit_batch that calls state.estimator.net bypasses DistributedDataParallel; forward "
            "through state.estimator.train_net (or override forward(net, ...), which receives it)"
        )

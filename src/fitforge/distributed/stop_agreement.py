"""Under torch.distributed, every rank stops training at the same point (docs/distributed.md#preemption):
a rank that stopped alone would leave the others waiting in a collective. After the first optimizer step
the replicas' weights are checked once to be equal: a ``fit_batch`` that calls ``estimator.net`` bypasses DDP.
"""

from __future__ import annotations

import logging
import signal
import time

import torch
import torch.distributed as dist

from fitforge.core.state import TrainState
from fitforge.distributed.ranks import Collective, cpu_group, reduce_ints
from fitforge.distributed.signal_notice import SignalNotice
from fitforge.exceptions import CancelFit, FitforgeValueError

log = logging.getLogger("fitforge")
_SIGNALS = frozenset((0, *(int(s) for s in signal.Signals)))


class StopAgreement(Collective):
    """The :class:`~fitforge.core.coordinator.Coordinator` of one fit on several ranks."""

    holds_cancels = True
    max_interval = 64  # batches between two agreements, at most
    max_latency = 0.25  # seconds of batches between two agreements, at most (one batch, if longer)

    def __init__(self, check_replicas: bool) -> None:
        super().__init__()
        self._check_replicas = check_replicas
        self._signalled = 0  # the signal this rank received, until every rank knows it
        self._held: CancelFit | None = None  # a CancelFit this rank raised, until every rank knows it
        self._interval = 1  # batches between agreements, agreed by every rank
        self._proposal = 1  # this rank's proposal for the next interval
        self._since = 0  # training batches since the last agreement
        self._agreed_at = time.perf_counter()  # when the last agreement ended
        self._notice = SignalNotice()  # a signal told to the other ranks in a validation

    def signal_received(self, state: TrainState, signum: int) -> None:
        """Remember the signal for the next agreement, which stops every rank at the same batch."""
        self._signalled = signum
        log.warning(
            "received %s: every rank stops at the next stop agreement, within %d batches or at the next "
            "validation batch (saved by a CheckpointHandler, if any); send it again to stop at once",
            signal.Signals(signum).name,
            self._interval,
        )

    def abandons_pass(self, state: TrainState) -> bool:
        if state.run.preempted is not None:  # agreed already, on every rank: all leave at once
            return True
        if state.estimator.strategy.collective_forward:  # every rank runs each forward: all leave at one batch
            return bool(reduce_ints([self._signalled], "max")[0])  # (its shares are padded to equal lengths)
        if self._signalled:
            self._notice.post()
            return True
        return self._notice.seen()

    def end_pass(self, state: TrainState, abandoned: bool) -> bool:
        if state.run.preempted is not None:  # every rank left at its first look: no collective needed
            return True
        signum, left = reduce_ints([self._signalled, int(abandoned)], "max")
        if signum not in _SIGNALS or left not in (0, 1) or (left and not signum):
            raise _out_of_step()
        if signum:  # a pass every rank finished (the signal came after its last batch) is kept
            self._preempt(state, signum)
            state.run.stop(state.run.stop_reason or "preempted", every_rank=True)  # agreed: stop at this batch
        return bool(left)

    def agree_on_stop(self, state: TrainState) -> None:
        """Reduce this rank's signal, stop request and held CancelFit now; stop every rank if any asked."""
        flags = [self._signalled, int(state.run.stop_requested), int(self._held is not None), -self._proposal]
        flags = reduce_ints(flags, "max")
        self._since, self._agreed_at = 0, time.perf_counter()
        self._apply(state, flags)

    def after_batch(self, state: TrainState, cancel: CancelFit | None = None) -> bool:
        """After a training batch (also a cancelled one): agree when the interval is reached or every rank
        requested this stop; whether training stops here. ``cancel``: a CancelFit this rank raised, held."""
        if cancel is not None and self._held is None:
            self._held = cancel
        if self._check_replicas and state.optimizer_steps > 0:
            self._check_replicas = False
            _check_replicas(state)
        self._since += 1
        if self._since < self._interval and not state.run.stop_every_rank:
            return False
        self._proposal = self._propose((time.perf_counter() - self._agreed_at) / self._since)
        self.agree_on_stop(state)
        return state.run.stop_requested

    def _propose(self, batch_seconds: float) -> int:
        """The batches that fit in ``max_latency`` seconds at this pace, within ``[1, max_interval]``."""
        return max(1, min(self.max_interval, int(self.max_latency / max(batch_seconds, 1e-9))))

    def _apply(self, state: TrainState, flags: list[int]) -> None:
        signum, stop, cancel_fit, interval = flags[0], flags[1], flags[2], -flags[3]
        if signum not in _SIGNALS or stop not in (0, 1) or cancel_fit not in (0, 1) or interval < 1:
            raise _out_of_step()
        self._interval = interval
        if cancel_fit:
            held, self._held = self._held, None
            raise held if held is not None else CancelFit("CancelFit raised on another rank")
        if signum:
            self._preempt(state, signum)
        elif stop and not state.run.stop_requested:
            state.run.stop("another rank requested a stop")

    @staticmethod
    def _preempt(state: TrainState, signum: int) -> None:
        if state.run.preempted is None:
            state.run.preempted = signum
            state.run.stop(f"preempted by {signal.Signals(signum).name} (on at least one rank)")


def _out_of_step() -> FitforgeValueError:
    return FitforgeValueError(
        "the ranks got out of step (their collectives no longer pair up): a CancelBatch or CancelEpoch "
        "raised on some ranks only, or a handler that skips work on some ranks, is the usual cause; "
        "decide such things alike on every rank (from values reduced across ranks)"
    )


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

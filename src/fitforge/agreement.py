"""Under torch.distributed, every rank stops training at the same point.

A rank that stops alone leaves the others waiting in a collective (the next backward, a metric
reduction, a checkpoint): a deadlock. Stops come from per-rank sources (a signal that reached one
rank, ``max_time`` on one rank's clock, a handler judging this rank's values), so the loop agrees
on them: after every training batch (also a cancelled one), after ``train_begin`` and after every
``epoch_end``, one ``MAX`` all-reduce of two host integers over a gloo group (no GPU is synced)
carries this rank's received signal (``state.signalled``) and whether it requested a stop. When
any rank got a signal, every rank sets ``state.preempted`` and stops; when any rank requested a
stop, every rank stops. A CheckpointHandler then saves that state at the epoch end that follows.

After the first batch it also checks once that the replicas' weights are still identical: a
custom ``fit_batch`` that calls ``estimator.net`` instead of ``estimator.train_net`` bypasses DDP,
and its ranks would silently train apart.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from .distributed import cpu_group, reduce_ints
from .exceptions import FitforgeValueError
from .state import TrainState


class StopAgreement:
    """The agreement of one fit on several ranks (see the module docstring)."""

    def __init__(self, check_replicas: bool) -> None:
        self._group = cpu_group()
        self._check_replicas = check_replicas

    def settle(self, state: TrainState) -> None:
        """Reduce this rank's signal and stop request; stop every rank if any rank asked."""
        signum, stop = reduce_ints([state.signalled or 0, int(state.stop_requested)], "max")
        if signum and state.preempted is None:
            state.preempted = signum
            state.request_stop(f"preempted by {signal.Signals(signum).name} (on at least one rank)")
        elif stop and not state.stop_requested:
            state.request_stop("another rank requested a stop")

    def after_batch(self, state: TrainState) -> None:
        """:meth:`settle` after a training batch; after the first, the replicas check."""
        if self._check_replicas and state.optimizer_steps > 0:
            self._check_replicas = False
            _check_replicas(state)
        self.settle(state)


def _check_replicas(state: TrainState) -> None:
    """Every rank's weights must be equal after an optimizer step under DDP (one all-reduce)."""
    params = [p.detach() for p in state.estimator.net.parameters()]
    if not params:
        return
    checksum = torch.stack([p.double().sum() for p in params]).sum().reshape(1).cpu()
    low, high = checksum.clone(), checksum.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=cpu_group())
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=cpu_group())
    if not torch.equal(low, high):
        raise FitforgeValueError(
            "the ranks' weights differ after the first optimizer step, so their gradients were not averaged: a "
            "BatchProcessor.fit_batch that calls state.estimator.net bypasses DistributedDataParallel; forward "
            "through state.estimator.train_net (or override forward(net, ...), which receives it)")

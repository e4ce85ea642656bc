"""PreemptionSyncHandler: under torch.distributed, all ranks agree to stop on a signal any rank got."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from ..distributed import cpu_group
from ..events import BatchBegin, BatchEnd, TrainBegin, TrainEnd
from ..state import TrainState


class PreemptionSyncHandler(TrainBegin, BatchBegin, BatchEnd, TrainEnd):
    """Reduce every rank's received signal (``state.signalled``) with a ``MAX`` all-reduce each
    batch, and when any rank got one set ``state.preempted`` and request a stop on every rank at
    the same batch end: the CheckpointHandler then saves that batch's state, and all ranks exit.

    The reduction of a host integer over a gloo group starts at ``batch_begin`` and is waited for
    at ``batch_end``, so it overlaps the batch and never syncs a GPU. A signal that arrives after a
    batch began acts at the next one's end. fit adds this handler when it runs on several ranks.
    """

    priority = -3000  # first at batch_end: every later handler sees the agreed stop
    reads = ("signalled", "failed")
    writes = ("preempted", "stop_requested")

    def train_begin(self, state: TrainState) -> None:
        self._group = cpu_group()
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._work = None

    def batch_begin(self, state: TrainState) -> None:
        self._settle(state)  # a batch cancelled before its batch_end left one under way
        self._flag.fill_(state.signalled or 0)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def batch_end(self, state: TrainState) -> None:
        self._settle(state)

    def train_end(self, state: TrainState) -> None:
        if state.failed:
            return  # the other ranks may be inside another collective: a failing rank joins none
        self._settle(state)
        if state.preempted is None:  # a signal after the last batch began: the ranks agree once more
            self._flag.fill_(state.signalled or 0)
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
            self._agree(state)

    def _settle(self, state: TrainState) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._agree(state)

    def _agree(self, state: TrainState) -> None:
        signum = int(self._flag.item())  # a host tensor: reading it syncs no device
        if signum and state.preempted is None:
            state.preempted = signum
            state.request_stop(f"preempted by {signal.Signals(signum).name} (on at least one rank)")

"""The epoch/batch loop: runs the processor, dispatches events, honours stops and cancels.

It reads like the pseudocode it implements; everything optional lives in handlers. The loop never
reads a device value: handlers decide when values reach the host.

A cancel raised outside its own scope acts on the nearest enclosing one: ``CancelBatch`` in
``epoch_begin`` ends the epoch, any cancel in ``train_begin`` ends training — but only after every
``train_begin`` hook ran, so every handler that gets ``train_end`` was initialised. In
``epoch_end`` a ``CancelEpoch``/``CancelBatch`` ends only the hook that raised it (the epoch is
ending anyway, and the other handlers, stopping included, must still see it); in ``train_end``
every cancel does. In ``evaluate``/``predict``, which are one pass, ``CancelFit`` ends the pass like
``CancelEpoch``. None escapes. A cancel that ends a batch, an epoch or training before the
optimizer step clears the gradients that batch made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from fitforge.checkpoint.data_order import DataOrder
from fitforge.checkpoint.resume import resume
from fitforge.core.dispatch import Dispatcher
from fitforge.core.events import Event
from fitforge.core.first_batch import first_step
from fitforge.core.state import TrainState
from fitforge.exceptions import CancelBatch, CancelEpoch, CancelFit, FitforgeValueError

log = logging.getLogger("fitforge")
_CANCELS = (CancelBatch, CancelEpoch, CancelFit)


def run_fit(state: TrainState, dispatcher: Dispatcher, data: Iterable) -> None:
    """Train until a stop is requested; ``train_end`` runs however training ends. A checkpoint
    that a handler put in ``state.restore`` during ``train_begin`` is resumed from after it."""
    step = state.estimator.batch_processor.fit_batch
    order = state.data_order = DataOrder(data)
    try:
        cancelled = dispatcher.fire(Event.TRAIN_BEGIN, state, _CANCELS)
        if cancelled:
            state.request_stop("cancelled in train_begin")
        if state.agreement is not None:
            state.agreement.settle(state)
        if not cancelled and state.restore is not None:
            checkpoint, state.restore = state.restore, None
            resume(state, checkpoint)
        while not state.stop_requested:
            completed, start = state.global_step, state.start_batch
            run_epoch(
                state, dispatcher, order.epoch(state.epoch, start), step, "train_data", check_first=completed == 0
            )
            state.start_batch = 0
            if (
                state.global_step == completed
                and not start
                and state.max_batches is not None
                and not state.stop_requested
            ):
                # batches=N counts completed batches only: an epoch that completes none would repeat forever.
                log.warning(
                    "epoch %d completed no batch (every batch, or the epoch, was cancelled); "
                    "stopping, since batches=%d could never be reached",
                    state.epoch,
                    state.max_batches,
                )
                state.request_stop(f"epoch {state.epoch} completed no batch")
            if state.agreement is not None:
                state.agreement.settle(state)
            if not state.stop_requested:
                state.epoch += 1
    except _CANCELS as signal:
        _clear_gradients(state)
        state.request_stop(f"{type(signal).__name__} raised" + (f": {signal}" if str(signal) else ""))
    except BaseException as error:
        state.request_stop(f"failed: {type(error).__name__}")
        state.preempted = None  # a failure (a second signal included) is no clean stop to checkpoint
        dispatcher.fire_teardown(Event.TRAIN_END, state, _CANCELS)
        order.close()
        raise
    failure = dispatcher.fire_teardown(Event.TRAIN_END, state, _CANCELS, failing=False)
    order.close()
    if failure is not None:
        raise failure


def run_epoch(
    state: TrainState,
    dispatcher: Dispatcher,
    data: Iterable,
    step: Callable[[TrainState, Any], Any],
    name: str,
    check_first: bool = False,
    allow_empty: bool = False,
) -> None:
    """One pass over ``data`` (called ``name`` in errors): ``epoch_begin``, then per batch
    ``batch_begin``, ``step``, ``batch_end``, then ``epoch_end`` (also for a partial epoch).
    ``check_first``: the first batch goes through :func:`~fitforge.core.first_batch.first_step`.

    In training, ``state.start_batch`` is the position ``data`` starts at (a resumed epoch's data
    holds only the batches from there): batches are numbered from it, and the epoch's history row,
    already open, is continued. ``allow_empty``: a pass of no batch is no error (a rank's share of
    evaluation data may be empty under torch.distributed)."""
    batch_begin = dispatcher.hooks[Event.BATCH_BEGIN]
    batch_end = dispatcher.hooks[Event.BATCH_END]
    training = state.phase == "train"
    agreement = state.agreement if training else None
    ends_pass = (CancelEpoch, CancelBatch) if training else _CANCELS
    start = state.start_batch if training else 0
    if training and not start:
        state.history.new_epoch()
        state.epoch_start_step = state.global_step
    state.batch_idx = start - 1
    started = time.perf_counter()
    seen = 0
    cancelled = False
    state.epoch_complete = state.epoch_cancelled = False
    try:
        dispatcher.fire(Event.EPOCH_BEGIN, state)
        if agreement is not None:  # a stop requested in epoch_begin on one rank holds for all
            agreement.settle(state)
        for batch_idx, batch in enumerate(() if state.stop_requested else data, start):
            if agreement is not None and agreement.finish(state):
                break  # another rank stopped after the previous batch: this one is not trained
            state.batch_idx, state.batch = batch_idx, batch
            seen += 1
            try:
                for hook in batch_begin:
                    hook(state)
                if check_first:  # the sanity check, before any batch_end hook (the optimizer step is one)
                    state.output = first_step(state, step, batch, dispatcher.handlers, name)
                    check_first = False
                else:
                    state.output = step(state, batch)
                for hook in batch_end:
                    if hook(state):
                        state.request_stop(dispatcher.stop_reason(Event.BATCH_END, hook))
            except CancelBatch:
                if training:
                    _clear_gradients(state)
                if agreement is not None:
                    agreement.after_batch(state)
                if state.stop_requested:
                    break
                continue
            except CancelFit:
                if agreement is not None:  # the other ranks raise it too, at the same point
                    agreement.after_batch(state, cancel_fit=True)
                raise
            if training:
                state.global_step += 1
                if agreement is not None:  # several ranks: every rank stops at the same batch
                    agreement.after_batch(state)
            if state.stop_requested:
                break
        else:
            # A stop agreed after the last batch cuts the epoch short, as one requested there does;
            # so does one requested before the first (epoch_begin): a resumed epoch read no batch.
            stopped = agreement is not None and agreement.finish(state)
            state.epoch_complete = (seen > 0 or start > 0) and not stopped and not (seen == 0 and state.stop_requested)
    except ends_pass:
        cancelled = state.epoch_cancelled = True
        if training:
            _clear_gradients(state)
    if seen == 0 and not (start or cancelled or state.stop_requested or allow_empty):
        raise FitforgeValueError(
            f"{name} yielded no batch ({state.phase}, epoch {state.epoch}): it is empty, or a one-shot "
            "iterator that was already consumed; pass a non-empty re-iterable such as a DataLoader or a list"
        )
    if training:
        state.history.record("epoch_time", time.perf_counter() - started)
        _record_lr(state)
    dispatcher.fire(Event.EPOCH_END, state, ends_pass)


def _clear_gradients(state: TrainState) -> None:
    for optimizer in state.estimator.optimizers:
        optimizer.zero_grad(set_to_none=True)
    state.accumulated_batches = 0  # an accumulated group's gradients are gone with them


def _record_lr(state: TrainState) -> None:
    for i, optimizer in enumerate(state.estimator.optimizers):
        state.history.record("lr" if i == 0 else f"lr_{i}", float(optimizer.param_groups[0]["lr"]))

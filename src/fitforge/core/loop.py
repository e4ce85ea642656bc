"""The loop: fit, epoch and batch scopes, each catching only its own cancel.

    fit:    train_begin; prepare (resume); epochs until a stop; train_end (always)
    epoch:  epoch_begin; batches; epoch_end (also for a partial epoch)
    batch:  batch_begin; step (forward, loss, backward); batch_end

Everything optional lives in handlers, everything about other processes behind the run's
coordinator. The loop never reads a device value: handlers decide when values reach the host.

A cancel raised outside its own scope acts on the nearest enclosing one: ``CancelBatch`` in
``epoch_begin`` ends the epoch; any cancel in ``train_begin`` ends training once every
``train_begin`` hook ran (every handler that gets ``train_end`` was initialised). In ``epoch_end``
a ``CancelEpoch``/``CancelBatch`` ends only its hook (the other handlers must still see the
epoch end); in ``train_end`` every cancel does. In evaluate and predict ``CancelFit`` ends the pass
like ``CancelEpoch``. None escapes. A cancel before the optimizer step clears the batch's gradients.

Preemption (:mod:`fitforge.signals.preemption`): a signal sets ``state.run.preempted`` and requests a stop.
An epoch a signal ended (after its last batch too) is suspended: its ``epoch_end`` hooks leave it
to the resumed run. A pass within the fit (a validation) stops at its next batch
(:class:`~fitforge.exceptions.PassAbandoned`): in a ``batch_end`` hook the batch's other hooks
still run (a checkpoint saves the batch's state); in an ``epoch_end`` hook the epoch becomes
suspended for the hooks after it; elsewhere the event's other hooks run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any

from fitforge.core.clock import compiled
from fitforge.core.coordinator import PassWatch
from fitforge.core.events import Event
from fitforge.core.history import numbered_key
from fitforge.core.rng import torch_rng_snapshot
from fitforge.core.roles import Accumulating, role_of
from fitforge.core.run import RunContext
from fitforge.core.state import TrainState
from fitforge.exceptions import CancelBatch, CancelEpoch, CancelFit, FitforgeValueError, PassAbandoned, RetryBatch

log = logging.getLogger("fitforge")
_CANCELS = (CancelBatch, CancelEpoch, CancelFit)
_ENDS_EPOCH = (CancelEpoch, CancelBatch)
_ENDS_HOOK = (*_CANCELS, PassAbandoned)  # in train_end: an abandoned pass ends its hook only


def _go_on(state: TrainState) -> None:
    """After a pass abandoned in a hook: the stop is requested already, the other hooks run."""


def _suspend_epoch(state: TrainState) -> None:
    """After a pass abandoned in an ``epoch_end`` hook: the epoch is not over (its validation is
    not), so the hooks after it leave it to the resumed run, which runs its end again."""
    state.run.epoch_finished = False


def run_fit(state: TrainState, run: RunContext) -> None:
    """Train until a stop is requested; ``train_end`` runs however training ends."""
    dispatcher = run.dispatcher
    try:
        _begin_training(state, run)
        while not state.run.stop_requested:
            stalled = run_train_epoch(state, run)
            if stalled and state.run.max_batches is not None and not state.run.stop_requested:
                # batches=N counts completed batches only: an epoch that completes none would repeat forever.
                log.warning(
                    "epoch %d completed no batch (every batch, or the epoch, was cancelled); "
                    "stopping, since batches=%d could never be reached",
                    state.epoch,
                    state.run.max_batches,
                )
                state.run.stop(f"epoch {state.epoch} completed no batch")
            run.coordinator.agree_on_stop(state)
            if not state.run.stop_requested:
                state.epoch += 1
    except (*_CANCELS, PassAbandoned) as signal:  # PassAbandoned: in batch_begin or a step (rare)
        _clear_gradients(state)
        state.run.stop(f"{type(signal).__name__} raised" + (f": {signal}" if str(signal) else ""))
    except BaseException as error:
        state.run.error = error
        state.run.stop(f"failed: {type(error).__name__}")
        state.run.preempted = None  # a failure (a second signal included) is no clean stop to checkpoint
        dispatcher.fire_teardown(Event.TRAIN_END, state, _ENDS_HOOK)
        run.data.close()
        raise
    state.run.training_over = True
    failure = dispatcher.fire_teardown(Event.TRAIN_END, state, _ENDS_HOOK, failing=False)
    run.data.close()
    if failure is not None:
        raise failure


def _begin_training(state: TrainState, run: RunContext) -> None:
    """``train_begin``, then the run's preparation (a resume), also after a stop requested in ``train_begin``
    (a signal: a save then holds the resumed state), not after a cancel there."""
    with state.run.clock.hooks():  # the handlers' set-up (a tracker's run opened): theirs, a checkpoint's load not
        cancelled = run.dispatcher.fire(Event.TRAIN_BEGIN, state, _CANCELS, _go_on)
    if cancelled:
        state.run.stop("cancelled in train_begin")
    run.coordinator.agree_on_stop(state)
    started = time.perf_counter()
    for prepare in () if cancelled else run.prepare:
        prepare(state)
    if state.run.resumed:  # restoring a checkpoint (its loading, in a handler's train_begin, is timed there)
        state.run.clock.add("replay", time.perf_counter() - started)


def run_train_epoch(state: TrainState, run: RunContext) -> bool:
    """One training epoch (``state.run.epoch_finished`` set for ``epoch_end``). Returns whether it
    stalled: it read batches (or was cancelled) and completed none."""
    clock = state.run.clock
    started = time.perf_counter()
    data, first = run.data.epoch(state)
    if first:  # resumed mid-epoch: data without positions reads and discards the batches before it here
        clock.add("replay", time.perf_counter() - started)
    state.history.open_epoch(state.epoch)
    state.batch_idx, state.run.epoch_finished = first - 1, False
    steps_before, began = state.global_step, time.perf_counter()
    ran_out = cancelled = False
    try:
        with clock.hooks():
            run.dispatcher.fire(Event.EPOCH_BEGIN, state, abandoned=_go_on)
            run.coordinator.agree_on_stop(state)  # a stop requested in epoch_begin on one rank holds for all
        ran_out = not state.run.stop_requested and _train_batches(state, run, data, first)
    except _ENDS_EPOCH:
        cancelled = True
        _clear_gradients(state)
    read = state.batch_idx + 1  # the epoch's batches read so far, by this fit and a resumed one
    if read == 0 and not (cancelled or state.run.stop_requested):
        raise _empty(run.name, state)
    # Preempted, even after the epoch's last batch, the epoch is suspended: a signal's save must not
    # wait for its end (a long validation), which the resumed run does.
    state.run.epoch_finished = state.run.preempted is None and (
        cancelled or (ran_out and read > 0) or (state.num_batches is not None and read >= state.num_batches)
    )
    state.history.record("epoch_time", time.perf_counter() - began)
    for i, optimizer in enumerate(state.estimator.optimizers):
        state.history.record(numbered_key("lr", i), float(optimizer.param_groups[0]["lr"]))
    clock.record_epoch(state.history)
    with clock.hooks():  # a validation's and a checkpoint's seconds are theirs, the rest the handlers'
        run.dispatcher.fire(Event.EPOCH_END, state, _ENDS_EPOCH, _suspend_epoch)
    return state.global_step == steps_before and (cancelled or read > first)


def _train_batches(state: TrainState, run: RunContext, data: Iterable, first: int) -> bool:
    """The batches of a training epoch from position ``first``; whether the data ran out (False:
    a stop cut the epoch short). Each batch is timed on the host's clock, for ``state.run.clock``."""
    clock, now, hooks = state.run.clock, time.perf_counter, run.dispatcher.hooks
    # The clock's marks between the hooks and the step (the processor's, backward_end's, the update's).
    marked = ([*hooks[Event.BATCH_BEGIN], clock.to_step], hooks[Event.BACKWARD_END], _marked_ends(run, clock))
    checked = state.output is None  # the run's first step is this epoch's: a compiled net compiles in it
    first_step, mark = None, clock.open_batches()
    try:
        for batch in data:  # state.batch_idx starts at first - 1; a retried batch does not move it
            got = clock.last = now()
            clock.waited += got - mark  # on the clock as they come: a checkpoint's totals hold them
            state.batch_idx += 1
            state.batch = batch
            try:
                stop = run.coordinator.after_batch(state, _train_batch(state, run, marked))
            finally:  # a batch that raised (a CancelEpoch) is timed too
                mark = now()
                clock.end_batch(mark)
            if first_step is None:
                first_step = clock.stepping  # the pass's steps so far: its first
            if stop:  # the coordinator raised a CancelFit the ranks agreed on, or agreed on a stop
                return False
        return True
    finally:
        clock.close_batches()
        if checked and first_step is not None:
            clock.first_step(first_step, state.batch_idx + 1 - first, compiled(state.estimator.net))


def _train_batch(state: TrainState, run: RunContext, marked: tuple[Sequence[Callable], ...]) -> CancelFit | None:
    """One training batch (``marked``: its hook lists, as :func:`run_batch` takes them); a CancelFit it raised,
    for the coordinator (None: none)."""
    try:
        run_batch(state, run, marked[1], marked[2], marked[0])
        state.global_step += 1
    except CancelBatch as cancel:
        _clear_gradients(state)
        if isinstance(cancel, RetryBatch):  # the data yields its position again: it was not read
            state.batch_idx -= 1
    except CancelFit as error:
        if run.coordinator.holds_cancels:  # held until the ranks agree: this rank trains on in step with them
            state.global_step += 1
        return error
    return None


def _marked_ends(run: RunContext, clock: Any) -> list[Callable]:
    """``batch_end``'s hooks with the clock's marks around the optimizer's update (GradientUpdateHandler's
    hook; where a batch processor updates in its step, a mark first): the step ends with the update."""
    owners = run.dispatcher.owners[Event.BATCH_END]
    steppers = [i for i, owner in enumerate(owners) if role_of(owner, Accumulating) is not None]
    hooks = run.dispatcher.hooks[Event.BATCH_END]
    if not steppers:
        return [clock.to_hooks, *hooks]
    at = steppers[-1]  # the hooks before the update are the handlers'
    return [clock.to_hooks, *hooks[:at], clock.to_step, hooks[at], clock.to_hooks, *hooks[at + 1 :]]


def run_batch(
    state: TrainState,
    run: RunContext,
    after_step: Sequence[Callable] = (),
    ends: Sequence[Callable] | None = None,
    begins: Sequence[Callable] | None = None,
) -> None:
    """``batch_begin``'s hooks (``begins``: those, marked by the loop), the step, ``after_step`` (``backward_end``'s
    hooks in training), ``batch_end``'s hooks (``ends``: likewise; a truthy return requests a stop)."""
    hooks = run.dispatcher.hooks
    for hook in hooks[Event.BATCH_BEGIN] if begins is None else begins:
        hook(state)
    # No output yet: no batch of this run completed its step, so this one is checked before its
    # optimizer step (a batch cancelled before its step leaves the checks to the next).
    state.output = (run.step if state.output is not None else run.check)(state, state.batch)
    for hook in after_step:
        hook(state)
    if ends is None:
        ends = hooks[Event.BATCH_END]
    try:
        for hook in ends:
            if hook(state):
                state.run.stop(run.dispatcher.stop_reason(Event.BATCH_END, hook))
    except CancelFit:
        if not run.coordinator.holds_cancels:
            raise
        _end_batch(state, run, ends[ends.index(hook) + 1 :], CancelFit)  # held: the batch ends as on the other ranks
        raise
    except PassAbandoned:  # a signal abandoned a pass (a validation): the batch ends, its save included
        _end_batch(state, run, ends[ends.index(hook) + 1 :], PassAbandoned)


def _end_batch(state: TrainState, run: RunContext, hooks: Sequence[Callable], quiet: type[BaseException]) -> None:
    """The ``batch_end`` hooks after one that raised ``quiet``, which ends only its own hook there."""
    for later in hooks:
        with contextlib.suppress(quiet):
            if later(state):
                state.run.stop(run.dispatcher.stop_reason(Event.BATCH_END, later))


def run_pass(state: TrainState, run: RunContext) -> None:
    """One evaluate or predict pass: ``epoch_begin``, the batches, ``epoch_end``. Any cancel ends
    the pass; a cancelled batch is skipped."""
    for _ in pass_batches(state, run):
        pass


def pass_batches(state: TrainState, run: RunContext) -> Generator[None, None, None]:
    """:func:`run_pass`, pausing after each batch (``predict_batches`` hands its outputs over
    there); closed early, it ends without ``epoch_end``. Within a fit (``run.watch``), a signal
    abandons the pass before its next batch: PassAbandoned before ``epoch_end``, with torch's random
    generators as they were at its start (the resumed run redoes the pass)."""
    data, _ = run.data.epoch(state)
    state.batch_idx, cancelled = -1, False
    watch = run.watch
    kept = None if watch is None else torch_rng_snapshot()
    abandoned = False
    batches: Iterator[Any] = iter(())
    try:
        run.dispatcher.fire(Event.EPOCH_BEGIN, state)
        abandoned = watch is not None and watch.abandons()
        batches = iter(() if state.run.stop_requested or abandoned else data)
        for batch_idx, batch in enumerate(batches):
            state.batch_idx, state.batch = batch_idx, batch
            with contextlib.suppress(CancelBatch):
                run_batch(state, run)
            yield
            if state.run.stop_requested:
                break
            if watch is not None and watch.abandons():
                abandoned = True
                break
    except _CANCELS:
        cancelled = True
    if watch is not None and kept is not None:
        _end_watched_pass(watch, abandoned, kept, batches)
    if state.batch_idx < 0 and not (cancelled or state.run.stop_requested or run.allow_empty):
        raise _empty(run.name, state)
    state.run.epoch_finished = cancelled or (state.batch_idx >= 0 and not state.run.stop_requested)
    run.dispatcher.fire(Event.EPOCH_END, state, _CANCELS)


def _end_watched_pass(watch: PassWatch, abandoned: bool, kept: torch_rng_snapshot, batches: Iterator) -> None:
    """Every process, at the same point: the pass is dropped by all (PassAbandoned, torch's random
    generators put back as ``kept`` them) or by none."""
    try:
        watch.end(abandoned)
    except PassAbandoned as abandoning:
        kept.restore()
        # The data's iterator goes with the error, past the save that handles it: a loader's workers
        # are shut down once it is dropped, which waits for the batches they are reading.
        abandoning.unread = batches
        raise


def _empty(name: str, state: TrainState) -> FitforgeValueError:
    return FitforgeValueError(
        f"{name} yielded no batch ({state.phase}, epoch {state.epoch}): it is empty, or a one-shot "
        "iterator that was already consumed; pass a non-empty re-iterable such as a DataLoader or a list"
    )


def _clear_gradients(state: TrainState) -> None:
    for optimizer in state.estimator.optimizers:
        optimizer.zero_grad(set_to_none=True)
    state.accumulated_batches = 0  # an accumulated group's gradients are gone with them

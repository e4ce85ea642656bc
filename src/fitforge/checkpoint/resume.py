"""The training state a checkpoint holds besides weights, optimizers and scaler, and resuming from it.

:func:`training_state` collects the counters (completed epochs, batch position in the epoch,
global and optimizer steps), the gradients of an unfinished accumulation group (made the same on
every rank first by the :class:`~fitforge.core.roles.Accumulating` handler: rank 0's are saved), the history, the
random generators (every rank's, under torch.distributed), the data order, every stateful
handler's state, and the config of a run started from one (``config``:
``estimator.run_config``, plain values; read back by :func:`fitforge.cli.recorded_config`).
:func:`resume` puts them back. It runs once every handler's ``train_begin`` has run and before
the first ``epoch_begin``, so restored state wins over fresh state whatever the priorities.
"""

from __future__ import annotations

import logging
from typing import Any

from fitforge.core.events import EventHandler, handler_name, numbered_names
from fitforge.core.rng import restore_rng_states, rng_states
from fitforge.core.roles import Accumulating, Checkpointing, Stopping, players, role_of
from fitforge.core.state import TrainState
from fitforge.distributed.ranks import gather_to_main, rank, world_size
from fitforge.exceptions import FitforgeValueError
from fitforge.inputs.order import DataOrder

log = logging.getLogger("fitforge")


def stateful_handlers(handlers: tuple[object, ...]) -> dict[str, EventHandler]:
    """The handlers (each has ``state_dict``/``load_state_dict``, ``{}`` when stateless), keyed by
    class name (``#2``, ``#3``... for the second and later of one class, in dispatch order)."""
    stateful = [h for h in handlers if isinstance(h, EventHandler)]
    return dict(zip(numbered_names(stateful), stateful))


def fit_data_order(state: TrainState) -> DataOrder | None:
    """The fit's data order (None in evaluate and predict)."""
    data = None if state.run is None else state.run.data
    return data if isinstance(data, DataOrder) else None


def training_state(state: TrainState, epochs: int, batches: int) -> dict[str, Any]:
    """Everything but weights, optimizers and scaler, after ``epochs`` completed epochs and
    ``batches`` completed batches. When the current epoch is not complete, ``position`` is the
    number of its batches already read (cancelled ones included), where a resume continues.
    Every rank calls it at the same point: it may average an open group's gradients over them."""
    net, order = state.estimator.net, fit_data_order(state)
    if state.accumulated_batches:
        for accumulating in players(state.handlers, Accumulating):  # its open group may differ per rank (DDP)
            accumulating.share_open_group(state)
    epoch_start_step = 0 if order is None else order.epoch_start_step
    return {
        "epochs_completed": epochs,
        "global_step": batches,
        "position": 0 if epochs > state.epoch else state.batch_idx + 1,
        "epoch_start_step": epoch_start_step if epochs <= state.epoch else batches,
        "optimizer_steps": state.optimizer_steps,
        "accumulated_batches": state.accumulated_batches,
        "grads": (
            {name: p.grad for name, p in net.named_parameters() if p.grad is not None}
            if state.accumulated_batches
            else {}
        ),
        "history": state.history.state_dict(),
        "rng": rng_states(),
        **({} if world_size() == 1 else {"rank_rngs": gather_to_main(rng_states())}),
        "data_order": {} if order is None else order.state_dict(),
        "handlers": {key: handler.state_dict() for key, handler in stateful_handlers(state.handlers).items()},
        **_config_entry(state),
    }


def _config_entry(state: TrainState) -> dict[str, Any]:
    """``{"config": ...}`` for a run started from a config; nothing for others (and test doubles)."""
    config = getattr(state.estimator, "run_config", None)
    return {} if config is None else {"config": config}


def _order_changed(order: DataOrder | None, saved: dict[str, Any]) -> bool:
    """Whether a shuffled epoch's order differs from the checkpoint's: written by another number of
    ranks (a DistributedSampler's order depends on it, a RandomSampler's is another one)."""
    shuffled = saved.get("shuffled", False) or (order is not None and order.shuffled)
    return shuffled and saved.get("world", 1) != world_size()


def _rebatched(order: DataOrder, saved: dict[str, Any], position: int, epoch: int, quiet: bool = False) -> int:
    """The position, in this fit's batches, of a checkpoint written ``position`` batches into epoch
    ``epoch`` with batches of another size (per rank; all ranks' batches together count): the same
    sample, when this fit's batches can end there (the sampler's order does not depend on the batch
    size), else a FitforgeValueError (raised by :func:`check_resumable` before anything is loaded)."""
    old, new = saved.get("batch_size"), order.batch_size
    old_step, new_step = (old or 0) * saved.get("world", 1), (new or 0) * world_size()  # samples per step
    if old is None or new is None or old_step == new_step:
        return position
    samples = position * old_step
    if samples % new_step:
        raise FitforgeValueError(
            f"the checkpoint stopped {position} batch(es) of {old_step} (sample {samples}) into epoch {epoch + 1}, "
            f"but train_data now has batches of {new_step}, which cannot continue at that sample: resume with "
            f"batch_size={old} (or one that divides {samples}) to finish the epoch, or resume from a checkpoint "
            "written at an epoch's end"
        )
    if not quiet:
        log.info(
            "train_data's batch size changed from %d to %d since the checkpoint: epoch %d continues after its first "
            "%d samples (%d batches of %d)",
            old_step,
            new_step,
            epoch + 1,
            samples,
            samples // new_step,
            new_step,
        )
    return samples // new_step


def check_resumable(state: TrainState, checkpoint: dict[str, Any]) -> None:
    """Refuse, before its weights are loaded, a checkpoint this fit cannot continue exactly: one
    written part-way through an epoch, with batches this fit's cannot end at (see :func:`_rebatched`)."""
    order, position = fit_data_order(state), checkpoint.get("position", 0)
    if position and order is not None and not _order_changed(order, checkpoint.get("data_order", {})):
        _rebatched(order, checkpoint.get("data_order", {}), position, checkpoint["epochs_completed"], quiet=True)


def resume(state: TrainState, checkpoint: dict[str, Any]) -> None:
    """Continue from ``checkpoint`` (whose weights and optimizer states are already loaded): the
    counters, history, generators, data order and handler states; a stop when its target is reached."""
    order = fit_data_order(state)
    state.epoch, state.global_step = checkpoint["epochs_completed"], checkpoint["global_step"]
    state.resumed, state.epochs_before = True, 0  # the checkpoint's history counts the run's epochs
    state.resumed_at = (state.epoch, state.global_step)
    position = checkpoint.get("position", 0)
    epoch_start_step = checkpoint.get("epoch_start_step", state.global_step - position)
    state.optimizer_steps = checkpoint.get("optimizer_steps", 0)
    state.accumulated_batches = checkpoint.get("accumulated_batches", 0)
    grads = checkpoint.get("grads", {})
    if position and _order_changed(order, checkpoint.get("data_order", {})):
        log.warning(
            "the checkpoint was written by %d rank(s) %d batch(es) into epoch %d of a shuffled order; on %d "
            "rank(s) the epoch's order is another one, so its position cannot be found: epoch %d starts "
            "again (its %d trained batch(es) are trained twice)",
            checkpoint["data_order"].get("world", 1),
            position,
            state.epoch + 1,
            world_size(),
            state.epoch + 1,
            state.global_step - epoch_start_step,
        )
        state.global_step = epoch_start_step
        position = 0
        state.accumulated_batches, grads = 0, {}
    if position and order is not None:  # batches of another size: the same sample, counted in the new batches
        rebatched = _rebatched(order, checkpoint.get("data_order", {}), position, state.epoch)
        state.global_step, position = state.global_step + rebatched - position, rebatched
    # The restored state is the one after the checkpoint's last batch: a stop before any batch of
    # this fit (a signal while restoring) then saves that same state, or nothing, never another.
    state.batch_idx = position - 1
    for name, parameter in state.estimator.net.named_parameters():
        parameter.grad = grads[name].to(parameter.device) if name in grads else None
    history = checkpoint["history"]
    if history["epochs"] > state.epoch and not position:  # a row of an epoch that reruns from its start
        history = {
            **history,
            "epochs": state.epoch,
            "recorded": [],
            "columns": {key: values[: state.epoch] for key, values in history["columns"].items()},
        }
    state.history.load_state_dict({**history, "stop_reason": None})
    rank_rngs = checkpoint.get("rank_rngs")  # every rank's generators, in a checkpoint of several ranks
    same_ranks = isinstance(rank_rngs, list) and len(rank_rngs) == world_size()
    restore_rng_states(rank_rngs[rank()] if same_ranks else checkpoint.get("rng", {}))  # type: ignore[index]
    if order is not None:
        order.load_state_dict(checkpoint.get("data_order", {}), mid_epoch=position > 0)
        order.resume_at(position, epoch_start_step)
    saved = checkpoint.get("handlers", {})
    for key, handler in stateful_handlers(state.handlers).items():
        if key in saved:
            handler.load_state_dict(saved[key])
    finished = [h for h in state.handlers if (s := role_of(h, Stopping)) is not None and s.ended_run()]  # e.g. early
    if finished:
        state.request_stop(f"already stopped: {history.get('stop_reason') or handler_name(finished[0])}")
    elif state.max_epochs is not None and state.epoch >= state.max_epochs:
        state.request_stop(f"already trained: {state.epoch} of epochs={state.max_epochs} completed")
    elif state.max_batches is not None and state.global_step >= state.max_batches:
        state.request_stop(f"already trained: {state.global_step} of batches={state.max_batches} completed")


def resume_picked(state: TrainState) -> None:
    """Run between ``train_begin`` and the first epoch: resume from the checkpoint a handler picked
    (of several resuming handlers, the last one's, whose weights its train_begin loaded last)."""
    picked = None
    for source in players(state.handlers, Checkpointing):
        checkpoint = source.take_resume_checkpoint()
        picked = checkpoint if checkpoint is not None else picked
    if picked is not None:
        resume(state, picked)

"""The training state a checkpoint holds besides weights, optimizers and scaler, and resuming from it
(after every handler's ``train_begin``, so restored state wins over fresh state whatever the priorities).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from fitforge.checkpoint.files import restore_weights
from fitforge.checkpoint.folder import CheckpointFolder
from fitforge.checkpoint.locations import Location
from fitforge.core.events import EventHandler, handler_name, numbered_names
from fitforge.core.rng import restore_rng_states, rng_states
from fitforge.core.roles import Stopping, role_of
from fitforge.core.state import TrainState
from fitforge.distributed.ranks import gather_to_main, rank, world_size
from fitforge.exceptions import CheckpointError, FitforgeValueError
from fitforge.inputs.order import DataOrder

log = logging.getLogger("fitforge")


def stateful_handlers(handlers: Sequence[object]) -> dict[str, EventHandler]:
    """The handlers (their state dicts are ``{}`` when stateless), keyed by class name (``#2``... after the first)."""
    stateful = [h for h in handlers if isinstance(h, EventHandler)]
    return dict(zip(numbered_names(stateful), stateful))


def fit_data_order(state: TrainState) -> DataOrder | None:
    """The fit's data order (None in evaluate and predict)."""
    data = None if state._loop is None else state._loop.data
    return data if isinstance(data, DataOrder) else None


def epoch_position(state: TrainState, epochs: int) -> int:
    """The batches of the current epoch a state after ``epochs`` completed epochs has read (0 at its end)."""
    return 0 if epochs > state.epoch else state.batch_idx + 1


def training_state(state: TrainState, epochs: int, batches: int) -> dict[str, Any]:
    """Everything but weights, optimizers and scaler, after ``epochs`` epochs and ``batches`` batches (an open
    epoch's position counts the batches read, cancelled ones included); on every rank at the same point (it
    may average an open group's gradients over them)."""
    net, order, config = state.estimator.net, fit_data_order(state), state.estimator.run_config
    if state.accumulated_batches and state.services.steps is not None:  # its open group may differ per rank (DDP)
        state.services.steps.share_open_group(state)
    epoch_start_step = 0 if order is None else order.epoch_start_step
    return {
        "epochs_completed": epochs,
        "global_step": batches,
        "position": epoch_position(state, epochs),
        "epoch_start_step": epoch_start_step if epochs <= state.epoch else batches,
        "optimizer_steps": state.optimizer_steps,
        "accumulated_batches": state.accumulated_batches,
        "grads": {
            name: p.grad for name, p in net.named_parameters() if state.accumulated_batches and p.grad is not None
        },
        "history": state.history.state_dict(),
        "clock": state.run.clock.state_dict(),  # the run's seconds by cause so far, across resumes
        "rng": rng_states(),
        **({} if world_size() == 1 else {"rank_rngs": gather_to_main(rng_states())}),
        "data_order": {} if order is None else order.state_dict(state.batch_idx),
        "handlers": {key: handler.state_dict() for key, handler in stateful_handlers(_handlers(state)).items()},
        **({} if config is None else {"config": config}),  # a run started from a config
    }


def continuation(order: DataOrder, saved: dict[str, Any], position: int, epoch: int, quiet: bool = False) -> int | None:
    """How this fit goes on in epoch ``epoch``, left after ``position`` batches by a checkpoint (its data
    order ``saved``): None at that position, else the samples read, after which the rest is batched anew
    (:mod:`fitforge.inputs.placement`). A FitforgeValueError when neither is exact."""
    if order.stream is not None and "data_state" in saved:  # one state for every number of ranks
        return None
    old, new = saved.get("batch_size"), order.batch_size
    old_world, (placed_samples, placed_at) = saved.get("world", 1), saved.get("offset", (0, 0))
    same_world = old_world == world_size()
    if old is None or new is None:  # batches without a size
        if same_world or isinstance(order.data, (list, tuple)):  # a list is not split: every rank reads it all
            return None
        raise _not_found(position, epoch, old_world, order.unplaceable or "train_data has no batch size")
    if same_world and old == new and not placed_samples:
        return None
    new_step = new * order.split  # samples per step, all ranks together
    samples = placed_samples + (position - placed_at) * old * saved.get("split", old_world)
    why = None  # why the rest of the epoch cannot be split anew for this fit
    if order.unplaceable is not None:
        why = f"train_data's order is not one for every number of ranks: {order.unplaceable}"
    elif not saved.get("placeable", not saved.get("shuffled", False)):
        why = "the run that wrote it drew its order from a sampler or generator of its own"
    elif saved.get("shuffled", False) != order.shuffled:
        why = "its epoch was " + ("shuffled and train_data is not" if order.shuffled is False else "not shuffled")
    if why is not None and not same_world:
        raise _not_found(samples, epoch, old_world, why, "sample(s)")
    if why is not None and samples % new_step:
        raise FitforgeValueError(
            f"the checkpoint stopped {samples} sample(s) into epoch {epoch + 1} (in batches of {old}), but "
            f"train_data now has batches of {new}, which cannot continue at that sample ({why}): resume with "
            f"batch_size={old} (or one that divides {samples}) to finish the epoch, or resume from a checkpoint "
            "written at an epoch's end"
        )
    if not quiet:
        log.info(
            "the checkpoint was written %d sample(s) into epoch %d by %d rank(s) in batches of %d; epoch %d goes on "
            "from that sample of its order on %d rank(s) in batches of %d",
            samples,
            epoch + 1,
            old_world,
            old,
            epoch + 1,
            world_size(),
            new,
        )
    return samples


def _not_found(read: int, epoch: int, old_world: int, why: str, unit: str = "batch(es)") -> FitforgeValueError:
    return FitforgeValueError(
        f"the checkpoint was written {read} {unit} into epoch {epoch + 1} by {old_world} rank(s), and this fit "
        f"runs on {world_size()}, where the rest of that epoch cannot be found: {why}. Resume on {old_world} "
        "rank(s) to finish the epoch, or from a checkpoint written at an epoch's end (CheckpointHandler's "
        "epoch_period), or train from a DataLoader with shuffle=True or False and no sampler or generator of "
        "your own, whose order fitforge continues on any number of ranks"
    )


def resume(state: TrainState, checkpoint: dict[str, Any]) -> None:
    """Continue from ``checkpoint`` (whose weights and optimizer states are already loaded): the
    counters, history, generators, data order and handler states; a stop when its target is reached."""
    order = fit_data_order(state)
    state.epoch, state.global_step = checkpoint["epochs_completed"], checkpoint["global_step"]
    state.run.resumed, state.run.epochs_before = True, 0  # the checkpoint's history counts the run's epochs
    state.run.resumed_at = (state.epoch, state.global_step)
    position = checkpoint.get("position", 0)
    epoch_start_step = checkpoint.get("epoch_start_step", state.global_step - position)
    state.optimizer_steps = checkpoint.get("optimizer_steps", 0)
    state.accumulated_batches = checkpoint.get("accumulated_batches", 0)
    grads = checkpoint.get("grads", {})
    sample = None
    if position and order is not None:  # another split of the epoch: it goes on from the same sample
        sample = continuation(order, checkpoint.get("data_order", {}), position, state.epoch)
    mid_epoch = position > 0
    # The restored state is the one after the checkpoint's last batch: a stop before any batch of
    # this fit (a signal while restoring) then saves that same state, or nothing, never another.
    state.batch_idx = position - 1
    for name, parameter in state.estimator.net.named_parameters():
        parameter.grad = grads[name].to(parameter.device) if name in grads else None
    history = checkpoint["history"]
    if history["epochs"] > state.epoch and not mid_epoch:  # a row of an epoch that reruns from its start
        columns = {key: values[: state.epoch] for key, values in history["columns"].items()}
        history = {**history, "epochs": state.epoch, "recorded": [], "columns": columns}
    state.history.load_state_dict({**history, "stop_reason": None})
    state.run.clock.load_state_dict(checkpoint.get("clock", {}))
    rank_rngs = checkpoint.get("rank_rngs")  # every rank's generators, in a checkpoint of several ranks
    same_ranks = isinstance(rank_rngs, list) and len(rank_rngs) == world_size()
    restore_rng_states(rank_rngs[rank()] if same_ranks else checkpoint.get("rng", {}))  # type: ignore[index]
    if order is not None:
        order.load_state_dict(checkpoint.get("data_order", {}), mid_epoch=mid_epoch)
        order.resume_at(position, epoch_start_step, sample)
    saved = checkpoint.get("handlers", {})
    for key, handler in stateful_handlers(_handlers(state)).items():
        if key in saved:
            handler.load_state_dict(saved[key])
    finished = [h for h in _handlers(state) if (s := role_of(h, Stopping)) is not None and s.ended_run()]  # e.g. early
    if finished:
        state.run.stop(f"already stopped: {history.get('stop_reason') or handler_name(finished[0])}")
    elif state.run.max_epochs is not None and state.epoch >= state.run.max_epochs:
        state.run.stop(f"already trained: {state.epoch} of epochs={state.run.max_epochs} completed")
    elif state.run.max_batches is not None and state.global_step >= state.run.max_batches:
        state.run.stop(f"already trained: {state.global_step} of batches={state.run.max_batches} completed")


def warn_if_inexact(state: TrainState, saves_mid_epoch: bool, resumes: bool) -> None:
    """Say, once per fit, which condition of an exact resume (docs/checkpoints.md) this run misses."""
    order = fit_data_order(state)
    problem = None if order is None else order.problem
    if problem is not None and (saves_mid_epoch or resumes):
        log.warning(
            "CheckpointHandler: a resume in the middle of an epoch cannot restore the position in "
            "train_data by index: %s. It reads and discards the batches before the checkpoint, and "
            "continues exactly only if train_data yields the same batches in the same order on every "
            "pass (see docs/checkpoints.md). Data that keeps its own position, a torchdata "
            "StatefulDataLoader or a dataset with state_dict/load_state_dict, resumes from its saved "
            "state instead (see docs/data-at-scale.md)",
            problem,
        )
    if resumes and state.estimator.device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        log.warning(
            "CheckpointHandler: resuming on CUDA without torch.use_deterministic_algorithms(True): the "
            "resumed run continues the same training, but not bit for bit (see docs/checkpoints.md)"
        )


def pick(state: TrainState, folder: CheckpointFolder) -> tuple[dict[str, Any], Location] | None:
    """At a resuming handler's ``train_begin``: the newest checkpoint in ``folder`` that loads and this fit
    can continue, and where it is (None: none), its weights and optimizer states loaded. Rank 0 picks."""
    loaded: list[dict] = []  # rank 0's checkpoint, kept out of the broadcast
    ranks = state.run.ranks
    several = ranks.several  # loading weights may be a collective (FSDP): rank 0 only reads the file
    order = fit_data_order(state)

    def check_resumable(checkpoint: dict[str, Any]) -> None:  # refused before its weights are loaded
        position = checkpoint.get("position", 0)
        if position and order is not None:
            continuation(order, checkpoint.get("data_order", {}), position, checkpoint["epochs_completed"], quiet=True)

    name = ranks.on_main(
        lambda: folder.newest_loadable(state.estimator, loaded, several, check_resumable), CheckpointError
    )
    if name is None:
        return None
    path = folder.location(name)
    if several:
        try:
            checkpoint = loaded[0] if loaded else folder.read(name)
            loaded = [restore_weights(state.estimator, checkpoint, folder=folder.shards)]
        except FileNotFoundError as err:
            raise CheckpointError(
                f"rank {ranks.rank} cannot find {path}, which rank 0 resumes from: model_dir must be "
                "a folder every rank can read (a shared filesystem across machines)"
            ) from err
    checkpoint = loaded[0]
    position = checkpoint.get("position", 0)
    assert state._loop is not None  # CheckpointWriter.start refuses a resume outside a fit
    state._loop.resume_from = checkpoint  # fit resumes from it once every train_begin ran
    log.info(
        "CheckpointHandler: resuming from %s (%d epoch(s) and %d batch(es) completed%s)",
        path.name,
        checkpoint["epochs_completed"],
        checkpoint["global_step"],
        f"; epoch {checkpoint['epochs_completed'] + 1} continues after its first {position} batch(es)"
        if position
        else "",
    )
    return checkpoint, path


def resume_picked(state: TrainState) -> None:
    """Run between ``train_begin`` and the first epoch: resume from the checkpoint a handler picked."""
    checkpoint = None if state._loop is None else state._loop.resume_from
    if checkpoint is not None:
        state._loop.resume_from = None  # type: ignore[union-attr]
        resume(state, checkpoint)


def _handlers(state: TrainState) -> Sequence[object]:
    """The fit's handlers (its run's: a checkpoint is of a fit)."""
    return () if state._loop is None else state._loop.handlers

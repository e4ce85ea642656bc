"""CheckpointWriter: how a ``CheckpointHandler``'s checkpoints are built (on every rank: the state holds
every rank's generators) and written (by rank 0, after every rank's FSDP shards), every rank failing alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from fitforge.checkpoint.adapters import adapter_state
from fitforge.checkpoint.earlier_run import EarlierRunError
from fitforge.checkpoint.finite import non_finite_state
from fitforge.checkpoint.folder import SHARDS, CheckpointFolder, describe_tensors
from fitforge.checkpoint.format import FORMAT_VERSION
from fitforge.checkpoint.locations import EXTENSION, Location
from fitforge.checkpoint.resume import epoch_position, pick, training_state
from fitforge.checkpoint.storage import CheckpointIO
from fitforge.core.state import TrainState
from fitforge.exceptions import CheckpointError, FitforgeValueError

log = logging.getLogger("fitforge")


def keep_earlier_run(folder: CheckpointFolder, epochs_before: int, resuming: bool, overwrite: bool) -> None:
    """Refuse, before training, a run that does not continue the one whose files are in the folder (its own
    would replace them); with ``overwrite``, delete them first (not to mix them with this run's)."""
    earlier = folder.earlier_files()
    if not earlier:
        return
    shown = ", ".join(path.name for path in earlier[-3:]) + (
        f" and {len(earlier) - 3} more" if len(earlier) > 3 else ""
    )
    if overwrite:
        log.warning(
            "CheckpointHandler: overwrite=True: deleting the %d checkpoint file(s) of an earlier run in %s (%s)",
            len(earlier),
            folder.path,
            shown,
        )
        folder.remove(earlier)
        return
    if epochs_before:  # a later phase of the same estimator (fine-tuning): resuming would skip it
        advice = (
            f"this fit goes on from the estimator's {epochs_before} epoch(s) but names its files from epoch 0, so "
            "it would replace them. Give each fit its own model_prefix (or model_dir), or pass overwrite=True to "
            "replace them"
        )
    elif resuming:  # only best (or non-finite) files: nothing to resume from, and a best to lose
        advice = (
            "resume_from_checkpoint=True found no checkpoint to resume from beside them, so this run starts from "
            "scratch and would replace them with its own. Save periodic checkpoints (epoch_period, batch_period) "
            "to be able to resume a run; pass overwrite=True to replace them, or use another model_dir or "
            "model_prefix to keep them"
        )
    else:
        advice = (
            "this run starts from scratch and would replace them. To continue that run pass "
            "resume_from_checkpoint=True; to replace its files pass overwrite=True; to keep them use another "
            "model_dir or model_prefix"
        )
    raise EarlierRunError(
        f"CheckpointHandler: {folder.path} already holds {len(earlier)} checkpoint file(s) of an earlier run ({shown})",
        advice,
        folder.regular_files() if not (epochs_before or resuming) else [],
    )


class CheckpointWriter:
    """The checkpoints of one handler in ``io``, named ``<prefix>-...``; ``keep`` regular ones."""

    def __init__(self, io: CheckpointIO, prefix: str, keep: int, background: bool, save_non_finite: bool) -> None:
        self.folder = CheckpointFolder(io, prefix, background)
        self.prefix, self.keep, self.save_non_finite = prefix, keep, save_non_finite
        self.saved: list[Location] = []  # rank 0's, which writes and rotates
        self.last_saved: Location | None = None  # the newest regular checkpoint this fit saved, on every rank
        self.last: tuple[int, int, int] | None = None  # (epochs, batches, position) saved or started from
        self._refused = 0  # saves of non-finite states in this fit
        self._shards: Any = None  # every rank's sharded saves in flight (the engine's shard_writer, with async_save)

    def start(self, state: TrainState, resumes: bool, overwrite: bool) -> Location | None:
        """At fit start: ready the store; with ``resumes``, pick the checkpoint the fit goes on from (None:
        none), else refuse (or with ``overwrite`` delete) an earlier run's checkpoints."""
        if self._shards is not None:  # a fit that ended without its train_end
            self._shards.close()
            self._shards = None
        strategy = state.estimator.strategy
        if resumes and state._loop is None:
            raise FitforgeValueError(
                "CheckpointHandler resumes within a fit: call estimator.fit, not train_begin alone"
            )
        if strategy.sharded and not self.folder.holds_shards:
            raise FitforgeValueError(
                f"CheckpointHandler: FSDP's sharded checkpoints are folders of every rank's shards, which "
                f"{self.folder.label} cannot hold: give your CheckpointIO a folder_path(name) (a local path or an "
                "fsspec URL for the folder named name; see docs/extending.md), or save to a folder or URL"
            )
        if strategy.sharded and self.folder.background is not None:
            self._shards = strategy.shard_writer()
        state.run.ranks.on_main(self.folder.prepare, FitforgeValueError)
        # A fresh run starts from the state of no batch: stopped before its first batch (a signal in
        # train_begin), it has nothing to save. A resumed run's starting state is its checkpoint's.
        self.saved, self.last_saved, self.last, self._refused = [], None, (0, 0, 0), 0
        picked = pick(state, self.folder) if resumes else None
        if picked is None:
            earlier = partial(keep_earlier_run, self.folder, state.run.epochs_before, resumes, overwrite)
            state.run.ranks.on_main(earlier, FitforgeValueError)
            return None
        checkpoint, path = picked  # newer unreadable files leave the rotation
        files = self.folder.regular_files()
        self.saved = files[: files.index(path) + 1] if path in files else [path]
        self.last = (checkpoint["epochs_completed"], checkpoint["global_step"], checkpoint.get("position", 0))
        return path

    def regular(self, state: TrainState, epochs: int, batches: int) -> None:
        """Save ``<prefix>-epoch<epochs>batch<batches>.pt`` and rotate."""
        # The same state is not written twice (a preempted batch's save, then its epoch's end); a
        # state with the same counters but another position (after a CancelBatch) is.
        key = (epochs, batches, epoch_position(state, epochs))
        path = self.folder.regular(epochs, batches)
        if self.last == key or not self.writable(state, path.name, epochs, batches):
            return
        self.last = key
        checkpoint = self.checkpoint(state, epochs, batches)  # on every rank: it gathers their states
        written = self._save_shards(state, checkpoint, f"{path.name.removesuffix(EXTENSION)}pos{key[2]}{SHARDS}")
        self._write(state, lambda: self._commit_and_rotate(checkpoint, path), written, path.name)
        self.last_saved = path

    def _commit_and_rotate(self, checkpoint: dict, path: Location) -> None:
        self.folder.commit(checkpoint, path, stale=f"{path.name.removesuffix(EXTENSION)}pos*{SHARDS}")
        self.folder.then(partial(self._rotate, path))  # once it is written: a failed write is not kept

    def _rotate(self, path: Location) -> None:
        if path in self.saved:
            self.saved.remove(path)
        self.saved.append(path)
        self.folder.rotate(self.saved, self.keep)

    def single(self, state: TrainState, kind: str, epochs: int, batches: int, extra: dict) -> Location:
        """Write ``<prefix>-<kind>.pt`` (``best``, ``nonfinite``: one file each, replaced at each save)."""
        checkpoint = {**self.checkpoint(state, epochs, batches), **extra}
        path = self.folder.single(kind)
        shards = f"{self.prefix}-{kind}-epoch{epochs}batch{batches}pos{epoch_position(state, epochs)}{SHARDS}"
        written = self._save_shards(state, checkpoint, shards)
        stale = f"{self.prefix}-{kind}-epoch*{SHARDS}"
        self._write(state, lambda: self.folder.commit(checkpoint, path, stale=stale), written, path.name)
        return path

    def _write(
        self, state: TrainState, commit: Callable[[], None], written: Callable[[], None] | None, name: str
    ) -> None:
        """``commit()`` on rank 0, every rank sharing its error; with ``async_save`` in the background, after
        the previous save and ``written`` (the wait for the shards), except a preemption's save."""
        background = self.folder.background

        def now() -> None:
            if background is not None:
                background.wait()
                if written is not None:
                    background.after(written, name)  # the shards' error, if any, is the save's
            commit()
            if background is not None and state.run.preempted is not None:
                background.wait()

        state.run.ranks.on_main(now, CheckpointError)

    def _save_shards(self, state: TrainState, checkpoint: dict, name: str) -> Callable[[], None] | None:
        """Under FSDP, every rank writes its shards into the folder ``name`` (unique per state: never the
        shards a checkpoint in force names). With ``async_save`` (not preempted): the wait for them."""
        strategy = state.estimator.strategy
        if not strategy.sharded:
            return None
        checkpoint["sharded"] = name
        where, options = self.folder.shards(name)
        grads, shards = bool(state.accumulated_batches), self._shards
        if shards is not None:  # one save in flight: the previous one's shards, then its file
            shards.wait()
            state.run.ranks.on_main(self.folder.background.wait, CheckpointError)  # type: ignore[union-attr]
        if shards is None or state.run.preempted is not None:  # preempted: the process exits after this save
            strategy.save_shards(state.estimator, where, grads, options)
            return None
        return shards.submit(state.estimator, where, grads, name, options)

    def writable(self, state: TrainState, name: str, epochs: int, batches: int) -> bool:
        """Let the guards vouch for the state (a spike guard may restore good weights), then whether it may
        be saved as ``name``: not when it holds a nan or an inf on any rank (see ``save_non_finite``)."""
        for confirm in state.services.before_save:
            confirm(state)
        poisoned = non_finite_state(state.estimator)
        if not state.run.ranks.any(bool(poisoned)):
            return True
        self._refused += 1
        if self.save_non_finite and self._refused == 1:  # the first non-finite state is the telling one
            self.single(state, "nonfinite", epochs, batches, {"non_finite": poisoned})
        if self._refused > 1:
            log.debug("CheckpointHandler: not saving %s (nan/inf in %s)", name, describe_tensors(poisoned))
            return False
        kept = self.saved[-1].name if self.saved else "none (no finite state was saved in this run)"
        buffers = {name for name, _ in state.estimator.net.named_buffers()}  # what a guard cannot protect
        cause = (
            "a batch with nan/inf reached the forward (no guard can undo that): clean the data"
            if poisoned and all(name in buffers for name in poisoned)
            else "training diverged: add a NaNGuardHandler to skip or stop such steps, or lower the learning rate"
        )
        kept_apart = f"; kept as {self.prefix}-nonfinite.pt for inspection" if self.save_non_finite else ""
        log.warning(
            "CheckpointHandler: not saving %s: nan/inf in %s; %s. The newest checkpoint stays %s%s",
            name,
            describe_tensors(poisoned) or "another rank's state",
            cause,
            kept,
            kept_apart,
        )
        return False

    def finish(self, state: TrainState) -> None:
        """At train_end: every save written (or its error raised), and the count of refused saves."""
        if self._shards is not None:  # every rank's shards written (their error is rank 0's too, raised next)
            self._shards.close()
            self._shards = None
        if self.folder.background is not None:  # the last save is written, or its error raised here
            state.run.ranks.on_main(self.folder.background.close, CheckpointError)
        if self._refused > 1:
            log.warning(
                "CheckpointHandler: %d saves were not written, their state holding nan/inf; the newest "
                "checkpoint is %s",
                self._refused,
                self.saved[-1].name if self.saved else "none",
            )

    @staticmethod
    def checkpoint(state: TrainState, epochs: int, batches: int) -> dict:
        """The dict written: the engine's ``model_state`` and the :func:`~fitforge.checkpoint.resume.training_state`."""
        training = training_state(state, epochs, batches)
        model = state.estimator.strategy.model_state(state.estimator)
        if "model" in model:  # an adapter's net: its weights and its base's fingerprint, not the base
            model.update(adapter_state(state.estimator.net, model["model"]))
        return {"format_version": FORMAT_VERSION, **training, **model}

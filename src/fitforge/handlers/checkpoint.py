"""CheckpointHandler: decides when to save the training state and which checkpoint is best."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from fitforge.checkpoint.async_writer import AsyncCheckpointIO
from fitforge.checkpoint.compile_cache import load_compile_cache, save_compile_cache
from fitforge.checkpoint.locations import Location
from fitforge.checkpoint.resume import warn_if_inexact
from fitforge.checkpoint.saver import CheckpointWriter
from fitforge.checkpoint.storage import CheckpointIO, resolve_io
from fitforge.core.clock import compiled, history_key
from fitforge.core.events import BatchEnd, EpochEnd, Stage, TrainBegin, TrainEnd
from fitforge.core.roles import KeyRecording, Monitoring, averaged_weights
from fitforge.core.services import SavedCheckpoints, Services
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeValueError, check_flag, check_positive
from fitforge.metrics.monitor import Monitor

log = logging.getLogger("fitforge")


def _completed_epochs(state: TrainState) -> int:
    """Epochs completed at an epoch end: this one counts unless a stop (``batches=N``, a signal...)
    cut it short; a cancelled epoch counts, as the run goes on with the next one."""
    return state.epoch + 1 if state.run.epoch_finished else state.epoch


class CheckpointHandler(TrainBegin, BatchEnd, EpochEnd, TrainEnd, Monitoring, KeyRecording):
    """Save the training state every ``epoch_period`` epochs and/or ``batch_period`` batches, and the
    best one by ``monitor`` when ``save_best``; docs/checkpoints.md has the details.

    Args:
        model_dir: a folder (created if needed) or an fsspec URL (``s3://bucket/run``). Or give ``io``.
        model_prefix: file name prefix.
        monitor: the history key judging "best", e.g. ``"val_accuracy"`` (needed for ``save_best``).
        save_best: also keep ``<prefix>-best.pt``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (inferred from the key; see EarlyStoppingHandler).
        epoch_period: save at the end of every n-th epoch (None: never at epoch end).
        batch_period: save after every n-th training batch (None: never mid-epoch).
        max_checkpoints: how many regular checkpoints to keep.
        save_non_finite: keep the run's first state with a nan or an inf as ``<prefix>-nonfinite.pt`` (such a state
            is never saved under a checkpoint name).
        resume_from_checkpoint: at fit start, continue from the newest checkpoint that loads, to the same target.
        overwrite: delete the checkpoints of its prefix a run that does not resume finds (else it is refused).
        storage_options: for a URL ``model_dir``, the options of its fsspec filesystem.
        async_save: write in the background; training waits only while the state is copied to the host.
        io: a :class:`~fitforge.checkpoint.CheckpointIO` instead of ``model_dir`` (docs/extending.md).
    """

    priority = Stage.PERSIST  # after user handlers, so the state saved includes their updates of this epoch
    reads = (
        "estimator",
        "phase",
        "epoch",
        "global_step",
        "run",
        "services",
        "history",
        "metrics",
        "optimizer_steps",
        "accumulated_batches",
        "batch_idx",
        "num_batches",
    )
    # Resuming happens after train_begin (fitforge.checkpoint.resume), not through the state; a guard
    # it asks before a save (services.before_save) may put good weights back and drop an open group.
    writes = ("accumulated_batches",)

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        model_prefix: str = "model",
        monitor: str | None = None,
        save_best: bool = False,
        mode: str = "auto",
        epoch_period: int | None = 1,
        batch_period: int | None = None,
        max_checkpoints: int = 5,
        resume_from_checkpoint: bool = False,
        save_non_finite: bool = False,
        overwrite: bool = False,
        storage_options: dict[str, Any] | None = None,
        async_save: bool = False,
        io: CheckpointIO | None = None,
    ) -> None:
        self.io = resolve_io(model_dir, io, storage_options, "CheckpointHandler")
        while isinstance(self.io, AsyncCheckpointIO):  # a store written in the background: as async_save does
            self.io, async_save = self.io.io, True
        check_positive("CheckpointHandler", "epoch_period", epoch_period, allow_none=True)
        check_positive("CheckpointHandler", "batch_period", batch_period, allow_none=True)
        check_positive("CheckpointHandler", "max_checkpoints", max_checkpoints)
        if save_best and monitor is None:
            raise FitforgeValueError("CheckpointHandler: save_best=True needs a monitor, e.g. monitor='val_loss'")
        if epoch_period is None and batch_period is None and not save_best:
            raise FitforgeValueError(
                "CheckpointHandler would never save: epoch_period and batch_period are None and "
                "save_best is False; set at least one of them"
            )
        self._monitor = None if monitor is None else Monitor(monitor, mode, owner="CheckpointHandler")
        self.save_non_finite = check_flag("CheckpointHandler", "save_non_finite", save_non_finite)
        self.async_save = check_flag("CheckpointHandler", "async_save", async_save)
        self._writer = CheckpointWriter(self.io, model_prefix, max_checkpoints, async_save, save_non_finite)
        self._folder = self._writer.folder
        self.model_dir: Location = self._folder.path  # a Path, or the URL of an object-store folder or an io
        self.model_prefix, self.monitor = model_prefix, monitor
        self.save_best = check_flag("CheckpointHandler", "save_best", save_best)
        self.epoch_period, self.batch_period = epoch_period, batch_period
        self.max_checkpoints = max_checkpoints
        self.resume_from_checkpoint = check_flag("CheckpointHandler", "resume_from_checkpoint", resume_from_checkpoint)
        self.overwrite = check_flag("CheckpointHandler", "overwrite", overwrite)
        self.best: float | None = None
        self.best_path: Location | None = None
        self.resumed_from: Location | None = None
        self._compile_kept = True  # whether a compiled fit's caches are beside the checkpoints (or none to keep)

    @property
    def saved(self) -> list[Location]:
        """The regular checkpoints kept (rank 0's, which writes and rotates), oldest first."""
        return self._writer.saved

    @property
    def last_saved(self) -> Location | None:
        """The newest regular checkpoint this fit saved (on every rank)."""
        return self._writer.last_saved

    def history_keys(self, estimator: Any, phase: str) -> list[str]:
        return [history_key("checkpoint")] if phase == "train" else []  # the seconds its saves stall training

    def offer(self, services: Services) -> None:
        services.checkpoints.append(self)  # what it saves, for the handlers that report it (Ray's, MLflow's)
        local = isinstance(self.model_dir, Path) and self._folder.local
        services.run_folders.append(self.model_dir if local else self.io)  # the run's manifest, beside its checkpoints

    def train_begin(self, state: TrainState) -> None:
        if self._monitor is not None:
            self._monitor.resolve(state.estimator)
        self.best, self.best_path = None, None
        warn_if_inexact(state, bool(self.batch_period), self.resume_from_checkpoint)
        started = time.perf_counter()
        self.resumed_from = self._writer.start(state, self.resume_from_checkpoint, self.overwrite)
        if self.resumed_from is not None:  # a resume's picking and loading of its checkpoint
            state.run.clock.add("replay", time.perf_counter() - started)
        self._compile_kept = not self._keeps_compiled(state)  # nothing to keep, or kept after the first save
        if not self._compile_kept:
            with state.run.clock.timing("compile"):
                load_compile_cache(self.model_dir)  # type: ignore[arg-type]  # a local folder: _keeps_compiled

    def _keeps_compiled(self, state: TrainState) -> bool:
        """Whether the fit's compiled net's caches are kept beside the checkpoints (a local folder, one process)."""
        local = isinstance(self.model_dir, Path) and self._folder.local
        return local and compiled(state.estimator.net) and not state.run.ranks.several

    def _keep_compiled(self, state: TrainState) -> None:
        """After the first save of a compiled fit (its first steps compiled), its caches beside the checkpoints."""
        if not self._compile_kept:
            self._compile_kept = True
            save_compile_cache(self.model_dir)  # type: ignore[arg-type]  # a local folder: _keeps_compiled

    def _saves_at_epoch_end(self, state: TrainState) -> bool:
        period = self.epoch_period
        return period is not None and (state.epoch + 1) % period == 0

    def batch_end(self, state: TrainState) -> None:
        if state.run.preempted is None:  # else now, before epoch_end handlers change the state or use up the grace
            if not self.batch_period or (state.global_step + 1) % self.batch_period:
                return
            if state.batch_idx + 1 == state.num_batches and self._saves_at_epoch_end(state):
                return  # the epoch ends with this batch and saves the same state under its epoch name
        with state.run.clock.timing("checkpoint"):  # the time training stands still for it
            self._writer.regular(state, state.epoch, state.global_step + 1)
            for saved in state.services.after_save:  # the run's manifest records it
                saved(state)
            self._keep_compiled(state)

    def epoch_end(self, state: TrainState) -> None:
        with state.run.clock.timing("checkpoint"):
            if self.save_best:  # first, so the regular checkpoint of this epoch holds this epoch's best
                self._save_if_best(state)
            if self._saves_at_epoch_end(state) or state.run.preempted is not None:
                self._writer.regular(state, _completed_epochs(state), state.global_step)
                self._keep_compiled(state)

    def train_end(self, state: TrainState) -> None:
        with state.run.clock.timing("checkpoint"):
            # A signal that came after this epoch's save (in a later epoch_end hook) still loses nothing.
            if state.run.preempted is not None and state.phase == "train":
                self._writer.regular(state, _completed_epochs(state), state.global_step)
            self._writer.finish(state)

    def _save_if_best(self, state: TrainState) -> None:
        monitor = self._monitor
        value = None if monitor is None else monitor.epoch_value(state, self)
        if value is None or monitor is None or not monitor.improved(value, self.best):
            return
        epochs = _completed_epochs(state)
        if not self._writer.writable(state, self._folder.single("best").name, epochs, state.global_step):
            return
        previous, self.best = self.best, value
        with averaged_weights(state.estimator):  # the weights the value was judged on (an EMA's)
            best = {"best": {"monitor": self.monitor, "value": value, "epoch": state.epoch}}
            self.best_path = self._writer.single(state, "best", epochs, state.global_step, best)
        log.info(
            "%s improved from %s to %.4g: saved %s",
            self.monitor,
            "nothing" if previous is None else f"{previous:.4g}",
            value,
            self.best_path.name,
        )

    def saved_checkpoints(self) -> SavedCheckpoints:
        return SavedCheckpoints(
            self.io,
            self.model_dir,
            self.model_prefix,
            self.resume_from_checkpoint,
            self.async_save,
            self.saved,
            self.last_saved,
            self.best_path,
            self.best,
            self.resumed_from,
            self._folder.checksums,
        )

    def best_weights(self) -> str | None:
        """``"saved"`` with ``save_best``: ``<prefix>-best.pt`` holds the best weights by ``monitor``."""
        return "saved" if self.save_best else None

    def best_checkpoint(self) -> Path | None:
        """The local file of the best checkpoint this fit saved (``best_path``), if any (None in an
        object store: ``best_path`` is its URL)."""
        local = self.save_best and self._folder.local
        return self.best_path if local and isinstance(self.best_path, Path) else None

    def state_dict(self) -> dict:
        """The best monitored value so far (the files to rotate are found in ``model_dir``)."""
        return {"best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = state["best"]
        best_path = self._folder.single("best")
        self.best_path = best_path if self.best is not None and self._folder.exists(best_path) else None

    def __repr__(self) -> str:
        where = f"io={self.io!r}" if self._folder.label.startswith("io") else repr(str(self.model_dir))
        return f"CheckpointHandler({where}, monitor={self.monitor!r})"

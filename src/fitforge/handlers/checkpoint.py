"""CheckpointHandler: decides when to save the training state and which checkpoint is best; the
writing is :class:`~fitforge.checkpoint.saver.CheckpointWriter`'s, the storage a
:class:`~fitforge.checkpoint.CheckpointIO`'s, the resume :mod:`fitforge.checkpoint.resume`'s."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from fitforge.checkpoint.earlier_run import keep_earlier_run
from fitforge.checkpoint.locations import Location
from fitforge.checkpoint.resume import fit_data_order, pick
from fitforge.checkpoint.saver import CheckpointWriter
from fitforge.checkpoint.storage import CheckpointIO, check_io, open_io
from fitforge.core.arguments import check_flag, check_positive
from fitforge.core.events import BatchEnd, EpochEnd, Stage, TrainBegin, TrainEnd
from fitforge.core.monitor import Monitor
from fitforge.core.roles import Checkpointing, Monitoring, SavedCheckpoints, averaged_weights
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

log = logging.getLogger("fitforge")


def _completed_epochs(state: TrainState) -> int:
    """Epochs completed at an epoch end: this one counts unless a stop (``batches=N``, a signal...)
    cut it short; a cancelled epoch counts, as the run goes on with the next one."""
    return state.epoch + 1 if state.epoch_finished else state.epoch


class CheckpointHandler(TrainBegin, BatchEnd, EpochEnd, TrainEnd, Checkpointing, Monitoring):
    """Save the training state every ``epoch_period`` epochs and/or ``batch_period`` batches, and the
    best one by ``monitor`` when ``save_best``.

    Files are ``<model_prefix>-epoch<E>batch<B>.pt`` (E completed epochs, B completed batches in the
    whole run: ``epoch2batch45`` is five batches into the third epoch of 20, also when a stop cut
    it short there) and ``<model_prefix>-best.pt``. Each holds the weights, the optimizers' states,
    the counters and the history (:func:`fitforge.checkpoint.files.load_checkpoint`), with a checksum
    that loading verifies. Writes are atomic; the newest ``max_checkpoints`` regular files are kept,
    older ones deleted by exact name once the new file is written. Best is judged at every epoch
    end, whatever ``epoch_period``; a non-finite value is never best.

    Args:
        model_dir: folder for the files (created if needed; checked writable at fit start), or an
            fsspec URL (``s3://bucket/run``, ``memory://run``; ``pip install "fitforge[cloud]"``),
            where a checkpoint counts once its upload is committed (:mod:`fitforge.checkpoint.objects`).
            ``file://`` URLs are local folders. Give either ``model_dir`` or ``io``.
        model_prefix: file name prefix.
        monitor: the history key judging "best", e.g. ``"val_accuracy"`` (needed for ``save_best``).
        save_best: also keep ``<prefix>-best.pt``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (inferred from the key; see EarlyStoppingHandler).
        epoch_period: save at the end of every n-th epoch (None: never at epoch end).
        batch_period: save after every n-th training batch (None: never mid-epoch).
        max_checkpoints: how many regular checkpoints to keep.
        save_non_finite: a state whose weights or optimizer state hold a nan or an inf is never
            written under a checkpoint name (it can neither be resumed from nor rotate a finite one
            away); with True the run's first such state is kept as ``<prefix>-nonfinite.pt`` for
            inspection. Buffers may hold an inf (a causal mask), not a nan. Judged at a save only.
        resume_from_checkpoint: at fit start, continue from the newest checkpoint that loads (a
            corrupt or unfitting one is skipped with a warning naming it and why; if none loads, a
            ``CheckpointError``; if there is none, training starts from scratch, logged), to the
            same target: ``epochs=5`` means five in all. See :mod:`fitforge.checkpoint.resume` and
            docs/checkpoints.md for what is restored and when it is bitwise exact.
        overwrite: a run that does not resume, in a store holding checkpoints of its prefix (of an
            earlier run, or an earlier fit of this estimator), would replace them, so it is refused
            before training, naming the ways out: resume, another ``model_dir`` or ``model_prefix``,
            or ``overwrite=True``, which deletes them (logged) first. One folder and prefix hold one run.
        storage_options: for a URL ``model_dir``, the options of its fsspec filesystem (s3fs's
            ``key``, ``secret``, ``endpoint_url``...); None: the store's own defaults (environment
            variables such as ``AWS_ENDPOINT_URL``, config files).
        async_save: save without stalling training: the state is copied to the host (the only time
            training waits), then written, committed and rotated in the background
            (:class:`~fitforge.checkpoint.async_writer.AsyncCheckpointIO` around the store). One save
            is in flight at most: the next save, a preemption save and ``train_end`` wait for it,
            and its error is raised there. Under FSDP every rank's shards go through DCP's
            ``async_save``. See docs/checkpoints.md.
        io: a :class:`~fitforge.checkpoint.CheckpointIO` to keep the checkpoints in instead of
            ``model_dir``: a store of one's own, one class with ``write(name, checkpoint)``,
            ``read(name)``, ``names()`` and ``delete(name)`` (docs/extending.md). Everything above
            holds through it.

    A SIGTERM or SIGINT during fit makes it save the state at the next batch boundary. Under
    torch.distributed every rank builds the checkpoint, rank 0 writes it and every rank fails with
    its error; on resume rank 0 picks the file and every rank loads it, so ``model_dir`` must be
    readable by every rank.

    Example:
        >>> saver = CheckpointHandler("runs/digits", monitor="val_accuracy", save_best=True)
        >>> estimator.fit(train, val_data=val, epochs=10, event_handlers=[saver])  # doctest: +SKIP
        >>> saver.best_path                                                        # doctest: +SKIP
        PosixPath('runs/digits/model-best.pt')
    """

    priority = Stage.PERSIST  # after user handlers, so the state saved includes their updates of this epoch
    reads = (
        "estimator",
        "phase",
        "epoch",
        "global_step",
        "preempted",
        "handlers",
        "history",
        "metrics",
        "optimizer_steps",
        "accumulated_batches",
        "epoch_finished",
        "batch_idx",
        "epochs_before",
        "num_batches",
    )
    # Resuming happens after train_begin (fitforge.checkpoint.resume), not through the state; a guard
    # it asks before a save (StateConfirming) may put good weights back and drop an open group.
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
        if (model_dir is None) == (io is None):
            raise FitforgeValueError(
                "CheckpointHandler: give a model_dir (a folder or an fsspec URL) or an io (a CheckpointIO), "
                + ("not both" if io is not None else "got neither")
            )
        if io is not None:
            io = check_io(io, "CheckpointHandler")
        elif not isinstance(model_dir, (str, os.PathLike)):
            raise FitforgeTypeError(
                f"CheckpointHandler: model_dir must be a folder path, got {describe(model_dir)} (or an fsspec URL "
                "such as 's3://bucket/run')"
            )
        if storage_options is not None and not isinstance(storage_options, dict):
            raise FitforgeTypeError(
                f"CheckpointHandler: storage_options must be a dict or None, got {describe(storage_options)}"
            )
        if not isinstance(model_prefix, str) or not re.fullmatch(r"[\w.-]+", model_prefix):
            raise FitforgeValueError(
                f"CheckpointHandler: model_prefix must be a non-empty file-name prefix "
                f"(letters, digits, '_', '-', '.'), got {model_prefix!r}"
            )
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
        if io is not None and storage_options:
            raise FitforgeValueError("CheckpointHandler: storage_options are for a model_dir URL; give them to your io")
        self.io: CheckpointIO = open_io(model_dir, storage_options) if io is None else io  # type: ignore[arg-type]
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
        self._picked: dict | None = None  # the checkpoint train_begin chose to resume from
        self.resumed_from: Location | None = None

    @property
    def saved(self) -> list[Location]:
        """The regular checkpoints kept (rank 0's, which writes and rotates), oldest first."""
        return self._writer.saved

    @property
    def last_saved(self) -> Location | None:
        """The newest regular checkpoint this fit saved (on every rank)."""
        return self._writer.last_saved

    def train_begin(self, state: TrainState) -> None:
        self._writer.start(state)
        if self._monitor is not None:
            self._monitor.resolve(state.estimator)
        self.best, self.best_path, self._picked, self.resumed_from = None, None, None, None
        self._warn_if_inexact(state)
        picked = pick(state, self._folder) if self.resume_from_checkpoint else None
        if picked is not None:  # fit resumes from it once every train_begin ran
            self._picked, self.resumed_from = picked
            self._writer.resumed(*picked)
        else:  # a run of its own: nothing of an earlier one is replaced unasked
            resuming = self.resume_from_checkpoint
            state.ranks.on_main(
                lambda: keep_earlier_run(self._folder, state.epochs_before, resuming, self.overwrite),
                FitforgeValueError,
            )

    def _warn_if_inexact(self, state: TrainState) -> None:
        """Say, once per fit, which condition of an exact resume (docs/checkpoints.md) this run misses."""
        order = fit_data_order(state)
        problem = None if order is None else order.problem
        if problem is not None and (self.batch_period or self.resume_from_checkpoint):
            log.warning(
                "CheckpointHandler: a resume in the middle of an epoch cannot restore the position in "
                "train_data by index: %s. It reads and discards the batches before the checkpoint, and "
                "continues exactly only if train_data yields the same batches in the same order on every "
                "pass (see docs/checkpoints.md)",
                problem,
            )
        if (
            self.resume_from_checkpoint
            and state.estimator.device.type == "cuda"
            and not torch.are_deterministic_algorithms_enabled()
        ):
            log.warning(
                "CheckpointHandler: resuming on CUDA without torch.use_deterministic_algorithms(True): the "
                "resumed run continues the same training, but not bit for bit (see docs/checkpoints.md)"
            )

    def take_resume_checkpoint(self) -> dict | None:
        """The checkpoint ``train_begin`` picked, for fit to resume from once every handler's
        ``train_begin`` ran (see :func:`fitforge.checkpoint.resume.resume_picked`); once."""
        picked, self._picked = self._picked, None
        return picked

    def _saves_at_epoch_end(self, state: TrainState) -> bool:
        period = self.epoch_period
        return period is not None and (state.epoch + 1) % period == 0

    def batch_end(self, state: TrainState) -> None:
        if state.preempted is not None:  # now, before epoch_end handlers change the state (or use up the grace time)
            self._writer.regular(state, state.epoch, state.global_step + 1)
            return
        if self.batch_period and (state.global_step + 1) % self.batch_period == 0:
            if state.batch_idx + 1 == state.num_batches and self._saves_at_epoch_end(state):
                return  # the epoch ends with this batch and saves the same state under its epoch name
            self._writer.regular(state, state.epoch, state.global_step + 1)

    def epoch_end(self, state: TrainState) -> None:
        if self.save_best:  # first, so the regular checkpoint of this epoch holds this epoch's best
            self._save_if_best(state)
        if self._saves_at_epoch_end(state) or state.preempted is not None:
            self._writer.regular(state, _completed_epochs(state), state.global_step)

    def train_end(self, state: TrainState) -> None:
        # A signal that came after this epoch's save (in a later epoch_end hook) still loses nothing.
        if state.preempted is not None and state.phase == "train":
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

    def checkpoint(self, state: TrainState, epochs: int, batches: int) -> dict:
        """The dict a save writes (see :meth:`fitforge.checkpoint.saver.CheckpointWriter.checkpoint`)."""
        return self._writer.checkpoint(state, epochs, batches)

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

"""CheckpointHandler: periodic and best-so-far checkpoints, written atomically and rotated."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fitforge.checkpoint.async_writer import BackgroundWriter
from fitforge.checkpoint.earlier_run import keep_earlier_run
from fitforge.checkpoint.files import CheckpointError, restore_weights
from fitforge.checkpoint.folder import SHARDS, CheckpointFolder, describe_tensors
from fitforge.checkpoint.format import FORMAT_VERSION
from fitforge.checkpoint.locations import EXTENSION, Location
from fitforge.checkpoint.resume import check_resumable, fit_data_order, training_state
from fitforge.checkpoint.storage import CheckpointIO, check_io, open_io
from fitforge.core.arguments import check_flag, check_positive
from fitforge.core.events import BatchEnd, EpochEnd, Stage, TrainBegin, TrainEnd
from fitforge.core.finite import non_finite_state, only_buffers
from fitforge.core.monitor import Monitor
from fitforge.core.roles import (
    Checkpointing,
    Monitoring,
    SavedCheckpoints,
    StateConfirming,
    averaged_weights,
    players,
)
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

log = logging.getLogger("fitforge")


def _confirm(state: TrainState) -> None:
    """Let the guards vouch for the state about to be saved (a spike guard may restore good weights)."""
    for guard in players(state.handlers, StateConfirming):
        guard.confirm_state(state)


def _completed_epochs(state: TrainState) -> int:
    """Epochs completed at an epoch end: this one counts unless a stop (``batches=N``, a signal...)
    cut it short; a cancelled epoch counts, as the run goes on with the next one."""
    return state.epoch + 1 if state.epoch_finished else state.epoch


class CheckpointHandler(TrainBegin, BatchEnd, EpochEnd, TrainEnd, Checkpointing, Monitoring):
    """Save the training state every ``epoch_period`` epochs and/or ``batch_period`` batches, and the
    best one by ``monitor`` when ``save_best``.

    Files are ``<model_prefix>-epoch<E>batch<B>.pt``, where E is the number of completed epochs and B
    the number of completed training batches in the whole run (``epoch2batch40`` is the state after
    two full epochs of 20 batches; ``epoch2batch45`` five batches into the third, also when the
    third epoch was cut short there by a stop), and
    ``<model_prefix>-best.pt``. Each holds the net's weights, the optimizers' states, the counters
    and the history (see :func:`fitforge.checkpoint.files.load_checkpoint`), with a checksum of its contents
    that loading verifies (``torch.load`` alone misses bytes flipped inside tensor data). Writes are atomic; the
    newest ``max_checkpoints`` regular files are kept and older ones are deleted by exact name, only
    once the new file is on disk. Best is judged at every epoch end, whatever ``epoch_period``; a
    non-finite value (nan, inf, -inf) is never best.

    Args:
        model_dir: folder for the files (created if needed; must be writable, checked at fit start),
            or an fsspec URL of an object-store folder (``s3://bucket/run``, ``memory://run``; needs
            ``pip install "fitforge[cloud]"``), where a checkpoint counts once its upload is
            committed (:mod:`fitforge.checkpoint.objects`). ``file://`` URLs are local folders.
            Give either ``model_dir`` or ``io``.
        model_prefix: file name prefix.
        monitor: the history key judging "best", e.g. ``"val_accuracy"`` (needed for ``save_best``).
        save_best: also keep ``<prefix>-best.pt``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (inferred from the key; see EarlyStoppingHandler).
        epoch_period: save at the end of every n-th epoch (None: never at epoch end).
        batch_period: save after every n-th training batch (None: never mid-epoch).
        max_checkpoints: how many regular checkpoints to keep.
        save_non_finite: a state whose weights or optimizer state hold a nan or an inf (training
            diverged) is never written under a checkpoint name, so it can neither be resumed from
            nor rotate a finite checkpoint away; with True the run's first such state is kept for
            inspection as ``<prefix>-nonfinite.pt`` (never resumed from). Buffers may hold an inf (a
            causal mask of -inf), not a nan. Judging a state reads one flag per tensor, at a save
            only: no cost per batch.
        resume_from_checkpoint: at fit start, continue from the newest checkpoint in ``model_dir``
            that loads (a corrupt or unfitting one is skipped with a warning naming the file and the
            reason; if there are checkpoints and none loads, a ``CheckpointError``; if there are
            none, training starts from scratch, logged). Training continues to the same target:
            ``epochs=5`` means five in all, so a run that already reached it trains no more. See
            :mod:`fitforge.checkpoint.resume` for what is restored, and docs/checkpoints.md for when the
            continuation is bitwise exact (a mid-epoch checkpoint continues at its batch).
        overwrite: a run that does not resume (or finds nothing to resume from) in a folder that
            holds checkpoint files of its prefix (periodic, best or non-finite ones, of an earlier
            run or an earlier fit of this estimator) would replace them, so it is refused before
            training, naming the ways out: resume that run, use another ``model_dir`` or
            ``model_prefix``, or pass ``overwrite=True``, which deletes the earlier run's files
            (logged) before training. A run that resumes continues those files, whatever
            ``overwrite`` says. One folder and prefix hold one run.
        storage_options: for a URL ``model_dir``, the options of its fsspec filesystem (s3fs's
            ``key``, ``secret``, ``endpoint_url``...); None: the store's own defaults (environment
            variables such as ``AWS_ACCESS_KEY_ID`` and ``AWS_ENDPOINT_URL``, config files).
        async_save: save without stalling training: at a save the state is copied to the host (new
            CPU tensors; the only time training waits), then written, committed and rotated by a
            background thread while training goes on. It costs one host copy of the state. One
            save is in flight at most: the next save, a preemption save and ``train_end`` wait for
            it, and its error is raised there (the same ``CheckpointError``). With
            ``strategy="fsdp"`` every rank's shards go through torch's
            ``torch.distributed.checkpoint.async_save`` (staged to CPU memory, then written by its
            background thread over a gloo group of the saves' own), and rank 0 commits the file
            once they are written. See docs/checkpoints.md.
        io: a :class:`~fitforge.checkpoint.CheckpointIO` to keep the checkpoints in instead of
            ``model_dir``: a store of one's own (a database, a service), one class with
            ``write(name, checkpoint)``, ``read(name)``, ``names()`` and ``delete(name)`` (see
            docs/extending.md). Everything above holds through it: names, rotation, best,
            resume, the refusal of an earlier run's checkpoints.

    A SIGTERM or SIGINT during fit (see ``Estimator.fit``) makes it save the state at the next
    batch boundary, whatever ``epoch_period`` and ``batch_period`` say.

    Under torch.distributed every rank builds the checkpoint (it holds every rank's random
    generators and running metric sums), rank 0 alone writes it, and every rank waits for the write
    and fails with rank 0's error if it fails. On resume rank 0 picks the file and every rank loads
    it, so ``model_dir`` must be readable by every rank (shared across machines).

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
        self._folder = CheckpointFolder(self.io, model_prefix)
        self.model_dir: Location = self._folder.path  # a Path, or the URL of an object-store folder or an io
        self.model_prefix, self.monitor = model_prefix, monitor
        self.save_best = check_flag("CheckpointHandler", "save_best", save_best)
        self.epoch_period, self.batch_period = epoch_period, batch_period
        self.max_checkpoints = max_checkpoints
        self.resume_from_checkpoint = check_flag("CheckpointHandler", "resume_from_checkpoint", resume_from_checkpoint)
        self.save_non_finite = check_flag("CheckpointHandler", "save_non_finite", save_non_finite)
        self.overwrite = check_flag("CheckpointHandler", "overwrite", overwrite)
        self.async_save = check_flag("CheckpointHandler", "async_save", async_save)
        # Rank 0's writes in flight (the other ranks only build the state, so never use it).
        self._writer = BackgroundWriter() if async_save else None
        self.saved: list[Location] = []  # rank 0's, which writes and rotates
        self.last_saved: Location | None = None  # the newest regular checkpoint this fit saved, on every rank
        self.best: float | None = None
        self.best_path: Location | None = None
        self._last: tuple[int, int, int] | None = None  # (epochs, batches, position) saved or started from
        self._refused = 0  # saves of non-finite states in this run
        self._picked: dict | None = None  # the checkpoint train_begin chose to resume from
        self.resumed_from: Location | None = None
        self._shards: Any = None  # every rank's sharded saves in flight (the engine's shard_writer, with async_save)

    def train_begin(self, state: TrainState) -> None:
        if self._shards is not None:  # a fit that ended without its train_end
            self._shards.close()
            self._shards = None
        strategy = state.estimator.strategy
        if strategy.sharded and self.async_save:
            self._shards = strategy.shard_writer()
        if strategy.sharded and not self._folder.holds_shards:
            raise FitforgeValueError(
                f"CheckpointHandler: FSDP's sharded checkpoints are folders of every rank's shards, which "
                f"{self._folder.label} cannot hold: give your CheckpointIO a folder_path(name) (a local path or an "
                "fsspec URL for the folder named name; see docs/extending.md), or save to a folder or URL"
            )
        state.ranks.on_main(self._folder.prepare, FitforgeValueError)
        if self._monitor is not None:
            self._monitor.resolve(state.estimator)
        # A fresh run starts from the state of no batch: stopped before its first batch (a signal in
        # train_begin), it has nothing to save. A resumed run's starting state is its checkpoint's.
        self.saved, self.best, self.best_path, self._last = [], None, None, (0, 0, 0)
        self.last_saved = None
        self._picked, self.resumed_from = None, None
        self._refused = 0
        self._warn_if_inexact(state)
        if self.resume_from_checkpoint:
            self._resume(state)
        if self.resumed_from is None:  # a run of its own: nothing of an earlier one is replaced unasked
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

    def _resume(self, state: TrainState) -> None:
        """Rank 0 picks the newest checkpoint that loads; every other rank loads the same file."""
        loaded: list[dict] = []  # rank 0's checkpoint, kept out of the broadcast
        ranks = state.ranks
        several = ranks.several  # loading weights may be a collective (FSDP): rank 0 only reads the file
        name = ranks.on_main(
            lambda: self._folder.newest_loadable(state.estimator, loaded, several, partial(check_resumable, state)),
            CheckpointError,
        )
        if name is None:
            return
        path = self._folder.location(name)
        if several:
            try:
                checkpoint = loaded[0] if loaded else self._folder.read(name)
                loaded = [restore_weights(state.estimator, checkpoint, folder=self._folder.shards)]
            except FileNotFoundError as err:
                raise CheckpointError(
                    f"rank {ranks.rank} cannot find {path}, which rank 0 resumes from: model_dir must be "
                    "a folder every rank can read (a shared filesystem across machines)"
                ) from err
        self._restore(state, loaded[0], path, self._folder.regular_files())

    def _restore(self, state: TrainState, checkpoint: dict, path: Location, files: list[Location]) -> None:
        self._picked, self.resumed_from = checkpoint, path  # fit resumes once every train_begin ran
        # Newer unreadable files leave the rotation's count (only rank 0, which writes, rotates).
        self.saved = files[: files.index(path) + 1] if path in files else [path]
        self._last = (checkpoint["epochs_completed"], checkpoint["global_step"], checkpoint.get("position", 0))
        log.info(
            "CheckpointHandler: resuming from %s (%d epoch(s) and %d batch(es) completed%s)",
            path.name,
            checkpoint["epochs_completed"],
            checkpoint["global_step"],
            f"; epoch {checkpoint['epochs_completed'] + 1} continues after its first {checkpoint['position']} batch(es)"
            if checkpoint.get("position")
            else "",
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
            self._save_regular(state, state.epoch, state.global_step + 1)
            return
        if self.batch_period and (state.global_step + 1) % self.batch_period == 0:
            if state.batch_idx + 1 == state.num_batches and self._saves_at_epoch_end(state):
                return  # the epoch ends with this batch and saves the same state under its epoch name
            self._save_regular(state, state.epoch, state.global_step + 1)

    def epoch_end(self, state: TrainState) -> None:
        if self.save_best:  # first, so the regular checkpoint of this epoch holds this epoch's best
            self._save_if_best(state)
        if self._saves_at_epoch_end(state) or state.preempted is not None:
            self._save_regular(state, _completed_epochs(state), state.global_step)

    def train_end(self, state: TrainState) -> None:
        # A signal that came after this epoch's save (in a later epoch_end hook) still loses nothing.
        if state.preempted is not None and state.phase == "train":
            self._save_regular(state, _completed_epochs(state), state.global_step)
        if self._shards is not None:  # every rank's shards written (their error is rank 0's too, raised next)
            self._shards.close()
            self._shards = None
        if self._writer is not None:  # the end of fit: the last save is on disk, or its error raised here
            state.ranks.on_main(self._writer.close, CheckpointError)
        if self._refused > 1:
            log.warning(
                "CheckpointHandler: %d saves were not written, their state holding nan/inf; the newest "
                "checkpoint is %s",
                self._refused,
                self.saved[-1].name if self.saved else "none",
            )

    def _save_regular(self, state: TrainState, epochs: int, batches: int) -> None:
        # The same state is not written twice (a preempted batch's save, then its epoch's end); a
        # state with the same counters but another position (after a CancelBatch) is.
        key = (epochs, batches, 0 if epochs > state.epoch else state.batch_idx + 1)
        if self._last == key:
            return
        path = self._folder.regular(epochs, batches)
        _confirm(state)
        if self._refuses_non_finite(state, path.name, epochs, batches):
            return
        self._last = key
        checkpoint = self.checkpoint(state, epochs, batches)  # on every rank: it gathers their states
        stem = path.name.removesuffix(EXTENSION)
        written = self._save_shards(state, checkpoint, f"{stem}pos{key[2]}{SHARDS}")
        self._write(state, path, checkpoint, lambda saved: self._write_and_rotate(saved, path), written)
        self.last_saved = path

    def _write(
        self,
        state: TrainState,
        path: Location,
        checkpoint: dict,
        write: Callable[[dict], None],
        sharding: Callable[[], None] | None = None,
    ) -> None:
        """``write(checkpoint)`` on rank 0, every rank sharing its error; with ``async_save`` in the
        background, after the previous write (whose error, if any, is raised here on every rank) and
        after ``sharding`` (DCP's background save of the shards the file names, and their folder). A preemption
        save is written before returning: the process exits after it."""
        writer = self._writer

        def now() -> None:
            if writer is not None:
                writer.wait()
            write(checkpoint)

        def once_sharded(saved: dict) -> None:
            if sharding is not None:
                sharding()  # waits for the shards: their error, if any, is the save's
            write(saved)

        if writer is None or state.preempted is not None:
            state.ranks.on_main(now, CheckpointError)
        else:
            state.ranks.on_main(lambda: writer.submit(once_sharded, checkpoint, path.name), CheckpointError)

    def _save_shards(self, state: TrainState, checkpoint: dict, name: str) -> Callable[[], None] | None:
        """Under FSDP, every rank writes its shard of the weights into the folder ``name``, which the
        checkpoint names (its file, written once every shard is, commits them). Names are unique
        per state (file name and batch position), so a save never writes into the shards a
        checkpoint in force names. With ``async_save`` (not preempted): the wait for DCP's
        background save, which the file's write waits for."""
        strategy = state.estimator.strategy
        if not strategy.sharded:
            return None
        checkpoint["sharded"] = name
        where, options = self._folder.shards(name)
        grads, shards = bool(state.accumulated_batches), self._shards
        if shards is None or state.preempted is not None:  # preempted: the process exits after this save
            if shards is not None:
                self._wait_for_saves(state)
            strategy.save_shards(state.estimator, where, grads, options)
            return None
        self._wait_for_saves(state)  # one save in flight: the previous one's shards, then its file
        return shards.submit(state.estimator, where, grads, name, options)

    def _wait_for_saves(self, state: TrainState) -> None:
        """Wait for the save in flight: its shards, then its file (its error raised on every rank)."""
        self._shards.wait()
        assert self._writer is not None  # async_save
        state.ranks.on_main(self._writer.wait, CheckpointError)

    def _write_and_rotate(self, checkpoint: dict, path: Location) -> None:
        self._folder.commit(checkpoint, path, stale=f"{path.name.removesuffix(EXTENSION)}pos*{SHARDS}")
        if path in self.saved:
            self.saved.remove(path)
        self.saved.append(path)
        self._folder.rotate(self.saved, self.max_checkpoints)

    def _save_if_best(self, state: TrainState) -> None:
        monitor = self._monitor
        value = None if monitor is None else monitor.epoch_value(state, self)
        if value is None or monitor is None or not monitor.improved(value, self.best):
            return
        epochs = _completed_epochs(state)
        _confirm(state)
        if self._refuses_non_finite(state, self._folder.single("best").name, epochs, state.global_step):
            return
        previous, self.best = self.best, value
        with averaged_weights(state.estimator):  # the weights the value was judged on (an EMA's)
            self.best_path = self._save_single(
                state,
                "best",
                epochs,
                state.global_step,
                {"best": {"monitor": self.monitor, "value": value, "epoch": state.epoch}},
            )
        log.info(
            "%s improved from %s to %.4g: saved %s",
            self.monitor,
            "nothing" if previous is None else f"{previous:.4g}",
            value,
            self.best_path.name,
        )

    def _save_single(self, state: TrainState, kind: str, epochs: int, batches: int, extra: dict) -> Location:
        """Write ``<prefix>-<kind>.pt`` (``best``, ``nonfinite``: one file each, replaced at each
        save); under FSDP its shards go to a folder named for the state, the stale ones removed."""
        checkpoint = {**self.checkpoint(state, epochs, batches), **extra}
        position = 0 if epochs > state.epoch else state.batch_idx + 1
        path = self._folder.single(kind)
        written = self._save_shards(
            state, checkpoint, f"{self.model_prefix}-{kind}-epoch{epochs}batch{batches}pos{position}{SHARDS}"
        )
        stale = f"{self.model_prefix}-{kind}-epoch*{SHARDS}"
        self._write(state, path, checkpoint, lambda saved: self._folder.commit(saved, path, stale=stale), written)
        return path

    def _refuses_non_finite(self, state: TrainState, name: str, epochs: int, batches: int) -> bool:
        """Whether the state is not saved as ``name`` because its weights or optimizer state hold a
        nan or an inf (every rank judges its own tensors, and all agree); with ``save_non_finite``
        it is written as ``<prefix>-nonfinite.pt`` instead. One warning per run, then DEBUG lines,
        and a count when training ends."""
        poisoned = non_finite_state(state.estimator)
        if not state.ranks.any(bool(poisoned)):
            return False
        self._refused += 1
        if self.save_non_finite and self._refused == 1:  # the first non-finite state is the telling one
            self._save_single(state, "nonfinite", epochs, batches, {"non_finite": poisoned})
        if self._refused > 1:
            log.debug("CheckpointHandler: not saving %s (nan/inf in %s)", name, describe_tensors(poisoned))
            return True
        kept = self.saved[-1].name if self.saved else "none (no finite state was saved in this run)"
        cause = (
            "a batch with nan/inf reached the forward (no guard can undo that): clean the data"
            if only_buffers(poisoned, state.estimator.net)
            else "training diverged: add a NaNGuardHandler to skip or stop such steps, or lower the learning rate"
        )
        kept_apart = f"; kept as {self.model_prefix}-nonfinite.pt for inspection" if self.save_non_finite else ""
        log.warning(
            "CheckpointHandler: not saving %s: nan/inf in %s; %s. The newest checkpoint stays %s%s",
            name,
            describe_tensors(poisoned) or "another rank's state",
            cause,
            kept,
            kept_apart,
        )
        return True

    def checkpoint(self, state: TrainState, epochs: int, batches: int) -> dict:
        """The dict written to a file: the weights, the optimizers' states (and the fp16 GradScaler's
        under ``precision="16-mixed"``) and the :func:`~fitforge.checkpoint.resume.training_state`. Under
        FSDP the weights, optimizer states and gradients go to a sharded folder instead (the
        engine's :meth:`~fitforge.distributed.Strategy.model_state`)."""
        training = training_state(state, epochs, batches)
        return {"format_version": FORMAT_VERSION, **training, **state.estimator.strategy.model_state(state.estimator)}

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

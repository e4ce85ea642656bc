"""RayTrainReportHandler: the fit's checkpoints and each epoch's metrics reported to Ray Train."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

from fitforge.checkpoint.files import load_checkpoint, save_checkpoint
from fitforge.checkpoint.locations import EXTENSION, Location
from fitforge.checkpoint.storage import LocalCheckpointIO
from fitforge.core.events import BatchEnd, EpochBegin, EpochEnd, EventHandler, Stage, TrainBegin, TrainEnd
from fitforge.core.roles import Accompanied
from fitforge.core.services import CheckpointSaver, SavedCheckpoints
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeValueError
from fitforge.handlers.checkpoint import CheckpointHandler

_reported_here = False  # whether a fit in this process reported to Ray (its checkpoints are then this process's)


class RayTrainReportHandler(TrainBegin, EpochBegin, BatchEnd, EpochEnd, TrainEnd, Accompanied):
    """Each epoch's metrics, and every checkpoint the fit's :class:`CheckpointHandler` s save, reported to Ray Train's
    ``ray.train.report``; a fit that Ray restarts resumed from ``ray.train.get_checkpoint()``. For a fit run inside a
    Ray ``TorchTrainer``'s ``train_loop_per_worker``; docs/distributed.md (Ray Train) has the details.

    Args:
        model_dir: the local folder of the CheckpointHandler it adds to a fit that has none (None: a temporary folder,
            removed with the handler).
        **options: that CheckpointHandler's other arguments (``epoch_period``, ``save_best``...), except
            ``resume_from_checkpoint`` (always on) and ``async_save``.
    """

    priority = Stage.PERSIST + 1  # after the checkpoint handlers' saves, which it reports

    def __init__(self, model_dir: str | os.PathLike | None = None, **options: Any) -> None:
        try:  # imported here: Ray is an optional extra
            import ray.train
        except ImportError as err:
            raise ImportError('RayTrainReportHandler needs Ray Train: pip install "fitforge[ray]"') from err
        self._train: Any = ray.train
        for refused in ("resume_from_checkpoint", "async_save"):
            if refused in options:
                raise FitforgeValueError(
                    f"RayTrainReportHandler: {refused} is not an option here: it always resumes from Ray's checkpoint "
                    "(and the newest in model_dir), and reports each checkpoint once it is written"
                )
        folder = tempfile.mkdtemp(prefix="fitforge-ray-") if model_dir is None else model_dir
        self._options = options if model_dir is None else {"model_dir": model_dir, **options}  # for the refusal below
        self._own = CheckpointHandler(folder, resume_from_checkpoint=True, **options)  # for a fit without one
        if model_dir is None:  # kept while the handler lives (a later handler may read its best file)
            weakref.finalize(self, shutil.rmtree, folder, ignore_errors=True)
        self._sources: list[CheckpointSaver] = [self._own]  # the fit's checkpoint handlers
        self._seen: list[tuple[Location | None, float | None]] = []  # per source: newest saved, best, reported

    # What the checkpoint handler it reports (its own, or the first of the fit's) saved.
    @property
    def model_dir(self) -> Location:
        return _told(self._sources[0]).root

    @property
    def saved(self) -> list[Location]:
        return _told(self._sources[0]).saved

    @property
    def resumed_from(self) -> Location | None:
        return _told(self._sources[0]).resumed_from

    @property
    def best_path(self) -> Location | None:
        return _told(self._sources[0]).best

    def best_checkpoint(self) -> Path | None:
        return self._sources[0].best_checkpoint()

    def companions(self) -> list[EventHandler]:
        return [self._own, _RaysCheckpointPlacer(self)]

    def train_begin(self, state: TrainState) -> None:
        self._seen = []

    def epoch_begin(self, state: TrainState) -> None:
        if not self._seen:  # the first epoch: what the handlers hold once they resumed counts as reported
            self._seen = [(told.last, told.best_value) for told in map(_told, self._sources)]

    def _take_in(self, state: TrainState) -> None:
        """Before the checkpoint handlers' ``train_begin``: check them, and put Ray's files in those that resume."""
        sources = [s for s in state.services.checkpoints if s.saved_checkpoints() is not None]
        told = [_told(source) for source in sources]
        if self._own in sources and not isinstance(self._own.io, LocalCheckpointIO):
            raise FitforgeValueError(
                f"RayTrainReportHandler: model_dir must be a local folder (a staging folder for Ray), got "
                f"{str(self._own.model_dir)!r}; Ray uploads to RunConfig(storage_path=...)"
            )
        if self._own not in sources and self._options:
            raise FitforgeValueError(
                f"RayTrainReportHandler: the fit has a CheckpointHandler of yours, which saves what is reported: give "
                f"it the arguments given here ({', '.join(self._options)})"
            )
        prefixes = [source.prefix for source in told]
        if len(set(prefixes)) < len(prefixes):
            raise FitforgeValueError(
                f"RayTrainReportHandler: the fit's CheckpointHandlers share a model_prefix ({prefixes}), and Ray keeps "
                "their files in one folder: give each its own model_prefix"
            )
        if any(source.in_background for source in told):
            raise FitforgeValueError(
                "RayTrainReportHandler reports each checkpoint once it is written: give the fit's CheckpointHandler "
                "async_save=False"
            )
        if state.estimator.strategy.sharded:
            raise FitforgeValueError(
                "RayTrainReportHandler: with strategy='fsdp' a checkpoint is a folder of every rank's shards, which "
                "this handler does not report to Ray; train with DDP (strategy='auto'), or save with a "
                "CheckpointHandler on shared storage"
            )
        self._sources = sources
        try:
            checkpoint = self._train.get_checkpoint()
        except RuntimeError as err:  # Ray's "cannot be used outside of a Ray Train training function"
            raise FitforgeValueError(
                "RayTrainReportHandler runs inside Ray Train: in the training function of a TorchTrainer "
                "(train_loop_per_worker); outside Ray, save and resume with CheckpointHandler"
            ) from err
        if checkpoint is None or _reported_here:  # an earlier fit's of this worker: not one to resume
            return
        resuming = [source for source in told if source.resumes]
        if not resuming:
            raise FitforgeValueError(
                "RayTrainReportHandler: Ray restarted this run from its last checkpoint, and no CheckpointHandler of "
                "the fit resumes: pass resume_from_checkpoint=True to yours"
            )
        with checkpoint.as_directory() as directory:
            for source in resuming:
                present = set(source.io.names())
                for file in Path(directory).glob(f"{source.prefix}-*{EXTENSION}"):
                    if file.name not in present:  # workers sharing a store: each write lands whole
                        _place(file, source.io)
        state.run.ranks.any(False)  # every rank's files placed before rank 0 looks for the newest

    def batch_end(self, state: TrainState) -> None:
        saved = self._new_saves()
        if saved:  # a batch's save (batch_period, a signal): reported now
            self._report(state, {"epoch": state.epoch, "global_step": state.global_step + 1}, saved)

    def epoch_end(self, state: TrainState) -> None:
        if state.phase != "train":
            return
        metrics: dict[str, Any] = {}
        if not state.run.epoch_suspended:  # an epoch cut by a signal: its values are the resumed run's
            history = state.history
            metrics = history.current_row(finite=True)
        self._report(state, {**metrics, "epoch": state.history.epochs, "global_step": state.global_step})

    def train_end(self, state: TrainState) -> None:
        saved = self._new_saves()
        if saved:  # a signal's save after the last report: Ray keeps it too
            self._report(state, {"epoch": state.history.epochs, "global_step": state.global_step}, saved)

    def _new_saves(self) -> list[tuple[SavedCheckpoints, Location]]:
        """The checkpoints saved since the last report (the newest regular one, and a new best), marked as reported."""
        new: list[tuple[SavedCheckpoints, Location]] = []
        for i, source in enumerate(map(_told, self._sources if self._seen else ())):
            if source.last is not None and source.last != self._seen[i][0]:
                new.append((source, source.last))
            if source.best_value != self._seen[i][1] and source.best is not None:
                new.append((source, source.best))
            self._seen[i] = (source.last, source.best_value)
        return new

    def _report(self, state: TrainState, metrics: dict[str, Any], saved: list | None = None) -> None:
        """``ray.train.report`` on every worker; rank 0 attaches the files saved since the last report."""
        global _reported_here
        _reported_here = True
        saved = self._new_saves() if saved is None else saved
        if not saved or state.run.ranks.rank != 0:
            self._train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="fitforge-ray-report-") as staging:
            for source, location in saved:
                target = Path(staging) / location.name
                if isinstance(source.io, LocalCheckpointIO) and isinstance(location, Path):
                    try:
                        os.link(location, target)  # no copy: a file is replaced, never written again
                    except OSError:
                        shutil.copy2(location, target)
                else:  # a store's: read through its io
                    save_checkpoint(source.io.read(location.name), target)
            self._train.report(metrics, checkpoint=self._train.Checkpoint.from_directory(staging))


class _RaysCheckpointPlacer(TrainBegin):
    """Puts Ray's checkpoint into the stores of the fit's checkpoint handlers before they resume."""

    priority = Stage.PERSIST - 1

    def __init__(self, reporter: RayTrainReportHandler) -> None:
        self.reporter = reporter

    def train_begin(self, state: TrainState) -> None:
        self.reporter._take_in(state)


def _place(file: Path, io: Any) -> None:
    """Put Ray's checkpoint ``file`` into ``io``: a local folder gets its bytes (copied, then renamed
    into place), another store the checkpoint read from it."""
    if not isinstance(io, LocalCheckpointIO):
        io.write(file.name, load_checkpoint(file))
        return
    io.path.mkdir(parents=True, exist_ok=True)  # its handler's train_begin, which makes it, runs next
    with file.open("rb") as source, tempfile.NamedTemporaryFile(dir=io.path, prefix=".copy-", delete=False) as copy:
        shutil.copyfileobj(source, copy)
    os.replace(copy.name, io.path / file.name)


def _told(source: CheckpointSaver) -> SavedCheckpoints:
    told = source.saved_checkpoints()
    assert told is not None  # the sources are those that tell
    return told

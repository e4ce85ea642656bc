"""RayTrainReportHandler: checkpoints and metrics reported to Ray Train, and a restart resumed from them."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

from fitforge.checkpoint.locations import EXTENSION
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeValueError
from fitforge.handlers.checkpoint import CheckpointHandler

_reported_here = False  # whether a fit in this process reported to Ray (its checkpoints are then this process's)


def _ray_train() -> Any:
    """``ray.train``, imported when a handler is made: Ray is an optional extra."""
    try:
        import ray.train
    except ImportError as err:
        raise ImportError('RayTrainReportHandler needs Ray Train: pip install "fitforge[ray]"') from err
    return ray.train


class RayTrainReportHandler(CheckpointHandler):
    """Checkpoints and each epoch's metrics reported to Ray Train's ``ray.train.report``, and a fit
    that Ray restarts resumed from ``ray.train.get_checkpoint()``, for a fit run inside a Ray
    ``TorchTrainer``'s ``train_loop_per_worker``.

    It is a :class:`CheckpointHandler` (same arguments, same files, same exact resume) whose
    ``model_dir`` is this worker's local staging folder; Ray keeps the checkpoints
    (``RunConfig(storage_path=...)``, ``CheckpointConfig(num_to_keep=...)``). Every save is reported
    as a Ray checkpoint holding its ``.pt`` file (and ``<prefix>-best.pt`` when ``save_best``
    replaced it since the last report). Each epoch end reports the epoch's history row (every
    finite value: ``train_loss``, ``val_*``, ``lr``...) with ``epoch`` (completed epochs) and
    ``global_step``, with that epoch's files when they were saved. A save in the middle of an epoch
    (``batch_period``, a preemption) is reported with ``epoch`` and ``global_step``. Every worker
    calls ``ray.train.report`` at the same points, as Ray requires; rank 0 attaches the files.

    At fit start, when Ray has a checkpoint (a worker group restarted after a failure, with
    ``FailureConfig(max_failures=...)``), every worker copies its files into ``model_dir`` and the
    fit resumes from the newest checkpoint there, exactly as
    ``CheckpointHandler(resume_from_checkpoint=True)`` does (mid-epoch, on another number of
    workers too). Without one, training starts from scratch. A later fit in the same worker process
    (after this process reported) does not take Ray's checkpoint: it is that process's own.

    Ray's ``TorchTrainer`` sets up the process group before the loop runs; fit uses it as it is
    (DDP, the data split, rank 0 writing), as under torchrun. Needs the optional extra:
    ``pip install "fitforge[ray]"``.

    Args:
        model_dir: the local staging folder (None: a temporary folder, removed when the handler is
            garbage-collected or the process exits). A folder of your own keeps the files, and its
            newest checkpoint is resumed from: use a new folder per run.
        **options: :class:`CheckpointHandler`'s other arguments (``epoch_period``, ``batch_period``,
            ``max_checkpoints``, ``model_prefix``, ``monitor``, ``save_best``...), except
            ``resume_from_checkpoint`` (always on) and ``async_save`` (a checkpoint is reported once
            written).

    Raises:
        ImportError: Ray Train is not installed.
        FitforgeValueError: ``resume_from_checkpoint`` or ``async_save`` given; at fit start,
            ``strategy="fsdp"`` (its checkpoints are folders of every rank's shards, which this
            handler does not report), a ``model_dir`` URL, or a fit outside a Ray Train training function.

    Example:
        >>> def train_loop_per_worker(config):
        ...     estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        ...     estimator.fit(train, val_data=val, epochs=10, event_handlers=[RayTrainReportHandler()])
        >>> trainer = TorchTrainer(
        ...     train_loop_per_worker,
        ...     scaling_config=ScalingConfig(num_workers=2),
        ...     run_config=RunConfig(storage_path="/shared/ray", failure_config=FailureConfig(max_failures=3)),
        ... )
        >>> trainer.fit()  # doctest: +SKIP
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, **options: Any) -> None:
        self._train = _ray_train()
        for refused in ("resume_from_checkpoint", "async_save"):
            if refused in options:
                raise FitforgeValueError(
                    f"RayTrainReportHandler: {refused} is not an option here: it always resumes from Ray's checkpoint "
                    "(and the newest in model_dir), and reports each checkpoint once it is written"
                )
        folder = tempfile.mkdtemp(prefix="fitforge-ray-") if model_dir is None else model_dir
        super().__init__(folder, resume_from_checkpoint=True, **options)
        if model_dir is None:  # kept while the handler lives (a later handler may read its best file)
            weakref.finalize(self, shutil.rmtree, folder, ignore_errors=True)
        self._reported: Path | None = None  # the checkpoint saved since the last report
        self._best_saved = False  # the best checkpoint was replaced since the last report
        self._deferring = False  # in epoch_end or train_end, which report their save themselves

    def train_begin(self, state: TrainState) -> None:
        if state.estimator.strategy.sharded:
            raise FitforgeValueError(
                "RayTrainReportHandler: with strategy='fsdp' a checkpoint is a folder of every rank's shards, which "
                "this handler does not report to Ray; train with DDP (strategy='auto'), or save with a "
                "CheckpointHandler on shared storage"
            )
        if self._folder.local is None:
            raise FitforgeValueError(
                f"RayTrainReportHandler: model_dir must be a local folder (a staging folder for Ray), got "
                f"{str(self.model_dir)!r}; Ray uploads to RunConfig(storage_path=...)"
            )
        self._take_rays_checkpoint(self._folder.local)
        self._reported, self._best_saved = None, False
        super().train_begin(state)

    def _take_rays_checkpoint(self, folder: Path) -> None:
        """Copy the files of Ray's latest reported checkpoint (if any) into ``folder``."""
        try:
            checkpoint = self._train.get_checkpoint()
        except RuntimeError as err:  # Ray's "cannot be used outside of a Ray Train training function"
            raise FitforgeValueError(
                "RayTrainReportHandler runs inside Ray Train: in the training function of a TorchTrainer "
                "(train_loop_per_worker); outside Ray, save and resume with CheckpointHandler"
            ) from err
        if checkpoint is None or _reported_here:  # an earlier fit's of this worker: not one to resume
            return
        folder.mkdir(parents=True, exist_ok=True)
        with checkpoint.as_directory() as directory:
            for file in Path(directory).glob(f"{self.model_prefix}-*{EXTENSION}"):
                if not (folder / file.name).exists():  # workers sharing a folder: each copy lands whole
                    with (
                        file.open("rb") as source,
                        tempfile.NamedTemporaryFile(dir=folder, prefix=".copy-", delete=False) as copy,
                    ):
                        shutil.copyfileobj(source, copy)
                    os.replace(copy.name, folder / file.name)

    def _save_regular(self, state: TrainState, epochs: int, batches: int) -> None:
        written = self._last
        super()._save_regular(state, epochs, batches)
        if self._last != written and self._folder.local is not None:  # saved (every rank gets here together)
            self._reported = self._folder.local / self._folder.regular(epochs, batches).name
            if not self._deferring:  # a batch's save (batch_period, a signal): reported now
                self._report(state, {"epoch": epochs, "global_step": batches})

    def _save_if_best(self, state: TrainState) -> None:
        best = self.best
        super()._save_if_best(state)
        self._best_saved = self._best_saved or self.best is not best

    def epoch_end(self, state: TrainState) -> None:
        self._deferring = True  # the epoch's save goes with the epoch's metrics
        try:
            super().epoch_end(state)
        finally:
            self._deferring = False
        if state.phase != "train":
            return
        metrics: dict[str, Any] = {}
        if not state.epoch_suspended:  # an epoch cut by a signal: its values are the resumed run's
            history = state.history
            metrics = {key: value for key in history if _finite(value := history.current(key))}
        self._report(state, {**metrics, "epoch": state.history.epochs, "global_step": state.global_step})

    def train_end(self, state: TrainState) -> None:
        self._deferring = True
        try:
            super().train_end(state)
        finally:
            self._deferring = False
        if self._reported is not None:  # a signal's save after the last report: Ray keeps it too
            self._report(state, {"epoch": state.history.epochs, "global_step": state.global_step})

    def _report(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """``ray.train.report`` on every worker; rank 0 attaches the files saved since the last report
        (the regular checkpoint, the best one)."""
        global _reported_here
        _reported_here = True
        saved = [self._reported] if self._reported is not None else []
        if self._best_saved and isinstance(self.best_path, Path):
            saved.append(self.best_path)
        self._reported, self._best_saved = None, False
        files = [path for path in saved if path.exists()] if state.ranks.rank == 0 else []
        if not files:
            self._train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="fitforge-ray-report-") as staging:
            for path in files:
                try:
                    os.link(path, Path(staging) / path.name)  # no copy: a file is replaced, never written again
                except OSError:
                    shutil.copy2(path, Path(staging) / path.name)
            self._train.report(metrics, checkpoint=self._train.Checkpoint.from_directory(staging))


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

"""RayTrainReportHandler: checkpoints and metrics reported to Ray Train, and a restart resumed from them."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fitforge.checkpoint.folder import EXTENSION
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeValueError
from fitforge.handlers.checkpoint import CheckpointHandler


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
    as a Ray checkpoint holding the one ``.pt`` file. Each epoch end reports the epoch's history row
    (every finite value: ``train_loss``, ``val_*``, ``lr``...) with ``epoch`` (completed epochs)
    and ``global_step``, with the checkpoint of that epoch when one was saved. A save in the middle
    of an epoch (``batch_period``, a preemption) is reported with ``epoch`` and ``global_step``.
    Every worker calls ``ray.train.report`` at the same points, as Ray requires; rank 0 attaches
    the checkpoint.

    At fit start, when Ray has a checkpoint (a worker group restarted after a failure, with
    ``FailureConfig(max_failures=...)``, or a run restored from storage), every worker copies its
    file into ``model_dir`` and the fit resumes from the newest checkpoint there, exactly as
    ``CheckpointHandler(resume_from_checkpoint=True)`` does (mid-epoch, on another number of
    workers too). Without one, training starts from scratch.

    Ray's ``TorchTrainer`` sets up the process group before the loop runs; fit uses it as it is
    (DDP, the data split, rank 0 writing), as under torchrun. Needs the optional extra:
    ``pip install "fitforge[ray]"``.

    Args:
        model_dir: the local staging folder (None: a new temporary folder per fit, deleted at its
            end). A folder of your own keeps the files, and its newest checkpoint is resumed from.
        **options: :class:`CheckpointHandler`'s other arguments (``epoch_period``, ``batch_period``,
            ``max_checkpoints``, ``model_prefix``, ``monitor``, ``save_best``...), except
            ``resume_from_checkpoint`` (always on) and ``async_save`` (a checkpoint is reported once
            written).

    Raises:
        ImportError: Ray Train is not installed.
        FitforgeValueError: ``resume_from_checkpoint`` or ``async_save`` given; at fit start,
            ``strategy="fsdp"`` (its checkpoints are folders of every rank's shards, which this
            handler does not report).

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
        self._staging = model_dir is None
        folder = tempfile.mkdtemp(prefix="fitforge-ray-") if model_dir is None else model_dir
        super().__init__(folder, resume_from_checkpoint=True, **options)
        self._reported: Path | None = None  # the checkpoint saved since the last report
        self._deferring = False  # in epoch_end or train_end, which report their save themselves

    def train_begin(self, state: TrainState) -> None:
        if state.estimator.strategy == "fsdp":
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
        self._reported = None
        super().train_begin(state)

    def _take_rays_checkpoint(self, folder: Path) -> None:
        """Copy the checkpoint file of Ray's latest reported checkpoint (if any) into ``folder``."""
        checkpoint = self._train.get_checkpoint()
        if checkpoint is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        with checkpoint.as_directory() as directory:
            for file in Path(directory).glob(f"{self.model_prefix}-*{EXTENSION}"):
                if not (folder / file.name).exists():
                    shutil.copy2(file, folder / file.name)

    def _save_regular(self, state: TrainState, epochs: int, batches: int) -> None:
        written = self._last
        super()._save_regular(state, epochs, batches)
        if self._last != written and self._folder.local is not None:  # saved (every rank gets here together)
            self._reported = self._folder.local / self._folder.regular(epochs, batches).name
            if not self._deferring:  # a batch's save (batch_period, a signal): reported now
                self._report(state, {"epoch": epochs, "global_step": batches})

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
        if self._staging and self._folder.local is not None:
            shutil.rmtree(self._folder.local, ignore_errors=True)

    def _report(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """``ray.train.report`` on every worker, rank 0 with the checkpoint saved since the last report."""
        saved, self._reported = self._reported, None
        if saved is None or state.ranks.rank != 0 or not saved.exists():
            self._train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="fitforge-ray-report-") as staging:
            try:
                os.link(saved, Path(staging) / saved.name)  # no copy: the file is never written again
            except OSError:
                shutil.copy2(saved, Path(staging) / saved.name)
            self._train.report(metrics, checkpoint=self._train.Checkpoint.from_directory(staging))


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

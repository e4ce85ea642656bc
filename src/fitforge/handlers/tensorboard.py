"""TensorBoardHandler: history values as TensorBoard scalars, and the run's hyperparameters for the HParams tab."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fitforge.core.events import BatchEnd, EpochEnd, Event, Stage, TrainBegin, TrainEnd
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, check_flag, check_positive, describe
from fitforge.reporting.hparams import ParamValue, last_values, run_params


class TensorBoardHandler(TrainBegin, BatchEnd, EpochEnd, TrainEnd):
    """Write every history value of each training epoch as a TensorBoard scalar (step: the epoch from 1, over the
    estimator's fits), and at ``train_end`` the run's hyperparameters to the HParams tab. Needs
    ``pip install 'fitforge[tensorboard]'``.

    Args:
        log_dir: the folder of the event files (created if needed).
        histograms: also write a histogram of every parameter of the net at each epoch end (``weights/<name>``).
        log_every_n_batches: also write the running values every n training batches (``batch/<key>``, a host read
            each time); None: never.

    Example:
        >>> from fitforge.handlers.tensorboard import TensorBoardHandler
        >>> board = TensorBoardHandler("runs/tb", histograms=True, log_every_n_batches=50)
        >>> history = estimator.fit(train, val_data=val, epochs=5, event_handlers=[board])  # doctest: +SKIP
    """

    priority = Stage.REPORT  # after user handlers, so the epoch's row is complete
    main_rank_only = True  # under torch.distributed, rank 0 reports for all
    reads = ("phase", "epoch", "global_step", "run", "history", "estimator", "metrics", "batch_idx", "num_batches")
    writes = ()

    def __init__(
        self, log_dir: str | os.PathLike, histograms: bool = False, log_every_n_batches: int | None = None
    ) -> None:
        if not isinstance(log_dir, (str, os.PathLike)):
            raise FitforgeTypeError(f"TensorBoardHandler: log_dir must be a folder path, got {describe(log_dir)}")
        self.histograms = check_flag("TensorBoardHandler", "histograms", histograms)
        check_positive("TensorBoardHandler", "log_every_n_batches", log_every_n_batches, allow_none=True)
        try:  # imported here, not at module import: tensorboard is an optional extra
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError as err:
            raise ImportError(
                "TensorBoardHandler needs the tensorboard package: pip install 'fitforge[tensorboard]'"
            ) from err
        self._writer_class, self._hparams = SummaryWriter, hparams
        self.log_dir, self.log_every_n_batches = Path(log_dir), log_every_n_batches
        if log_every_n_batches is None:  # called per batch only when asked
            self.handled_events = (Event.TRAIN_BEGIN, Event.EPOCH_END, Event.TRAIN_END)
        self._every = log_every_n_batches or 0
        self.writer: Any = None
        self._params: dict[str, ParamValue] = {}

    def train_begin(self, state: TrainState) -> None:
        self._close()
        self._params = run_params(state)
        self.writer = self._writer_class(log_dir=str(self.log_dir))

    def batch_end(self, state: TrainState) -> None:  # inherited as a hook only with log_every_n_batches
        step = state.global_step + 1
        if state.phase == "train" and step % self._every == 0:
            for key, value in state.running_metrics().items():  # a host read, at the asked interval
                self.writer.add_scalar(f"batch/{key}", value, step)

    def epoch_end(self, state: TrainState) -> None:
        if state.phase != "train" or state.run.epoch_suspended:
            return
        history, step = state.history, state.run.epochs_before + state.history.epochs  # over the estimator's fits
        for key in history:
            if (value := history.current(key)) is not None:
                self.writer.add_scalar(key, value, step)
        if self.histograms:
            for name, parameter in state.estimator.net.named_parameters():
                self.writer.add_histogram(f"weights/{name}", parameter.detach().float().cpu(), step)
        self.writer.flush()

    def train_end(self, state: TrainState) -> None:
        if self.writer is not None:
            # Not add_hparams (it writes the metrics again in another folder): the HParams tab reads this run's scalars.
            for summary in self._hparams(self._params, last_values(state.history)):
                self.writer.file_writer.add_summary(summary)
        self._close()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __repr__(self) -> str:
        return f"TensorBoardHandler({str(self.log_dir)!r})"

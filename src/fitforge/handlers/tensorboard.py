"""TensorBoardHandler: history values as TensorBoard scalars, written from a background thread, and the run's
hyperparameters for the HParams tab."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fitforge.core.events import BatchEnd, EpochBegin, EpochEnd, Event, Stage, TrainBegin, TrainEnd
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, check_flag, check_positive, describe
from fitforge.reporting.hparams import ParamValue, last_values, run_params
from fitforge.reporting.tracking import FLUSH_SECS, BackgroundWriter, check_flush_secs


class TensorBoardHandler(TrainBegin, EpochBegin, BatchEnd, EpochEnd, TrainEnd):
    """Write every history value of each training epoch as a TensorBoard scalar (step: the epoch from 1, over the
    estimator's fits), and at ``train_end`` the run's hyperparameters to the HParams tab. A background thread writes
    the event file, so no step waits for it. A fit resumed from a checkpoint continues in the same folder and hides
    what the interrupted run wrote after the checkpoint (TensorBoard's ``purge_step``). Needs
    ``pip install 'fitforge[tensorboard]'``.

    Args:
        log_dir: the folder of the event files (created if needed).
        histograms: also write a histogram of every parameter of the net at each epoch end (``weights/<name>``).
        log_every_n_batches: also write the running values every n training batches (``batch/<key>``, a host read
            each time); None: never.
        flush_secs: the longest a value waits before it is in the event file (a process killed loses at most these
            seconds of values).

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
        self,
        log_dir: str | os.PathLike,
        histograms: bool = False,
        log_every_n_batches: int | None = None,
        flush_secs: float = FLUSH_SECS,
    ) -> None:
        if not isinstance(log_dir, (str, os.PathLike)):
            raise FitforgeTypeError(f"TensorBoardHandler: log_dir must be a folder path, got {describe(log_dir)}")
        self.histograms = check_flag("TensorBoardHandler", "histograms", histograms)
        check_positive("TensorBoardHandler", "log_every_n_batches", log_every_n_batches, allow_none=True)
        self.flush_secs = check_flush_secs("TensorBoardHandler", flush_secs)
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
            self.handled_events = (Event.TRAIN_BEGIN, Event.EPOCH_BEGIN, Event.EPOCH_END, Event.TRAIN_END)
        self._every = log_every_n_batches or 0
        self.writer: Any = None  # the SummaryWriter, while a fit runs
        self._queue: BackgroundWriter | None = None
        self._params: dict[str, ParamValue] = {}

    def offer(self, services: Services) -> None:
        services.run_folders.append(self.log_dir)  # the run's manifest goes beside its event files

    def train_begin(self, state: TrainState) -> None:
        self._close()
        self._params = run_params(state)

    def epoch_begin(self, state: TrainState) -> None:
        if self.writer is None and state.phase == "train":  # the fit's first epoch: a resume is known by now
            resumed = state.run.resumed_at
            # Batch values count other steps than the epochs': with them, nothing is hidden.
            purge = None if resumed is None or self._every else resumed[0] + 1
            self.writer = self._writer_class(log_dir=str(self.log_dir), purge_step=purge)
            self._queue = BackgroundWriter("TensorBoardHandler", self._write, self.flush_secs)

    def batch_end(self, state: TrainState) -> None:  # inherited as a hook only with log_every_n_batches
        step = state.global_step + 1
        if state.phase == "train" and step % self._every == 0 and self._queue is not None:
            values = state.running_metrics()  # a host read, at the asked interval
            self._queue.put((step, {f"batch/{key}": value for key, value in values.items()}))

    def epoch_end(self, state: TrainState) -> None:
        if state.phase != "train" or state.run.epoch_suspended or self._queue is None:
            return
        history, step = state.history, state.run.epochs_before + state.history.epochs  # over the estimator's fits
        self._queue.put((step, history.current_row()))
        if self.histograms:  # copies: the thread writes them while training changes the weights
            weights = state.estimator.net.named_parameters()
            copies = {f"weights/{name}": p.detach().to("cpu", torch.float32, copy=True) for name, p in weights}
            self._queue.put((step, copies))

    def _write(self, records: list[tuple[int, dict[str, Any]]]) -> None:
        """On the writer's thread: the scalars and histograms, then flushed to the event file."""
        for step, values in records:
            for tag, value in values.items():
                if isinstance(value, torch.Tensor):
                    self.writer.add_histogram(tag, value, step)
                else:
                    self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def train_end(self, state: TrainState) -> None:
        try:
            if self._queue is not None:
                self._queue.close()
                self._queue = None
                # Not add_hparams (it writes the metrics again in another folder): the HParams tab reads this
                # run's scalars.
                for summary in self._hparams(self._params, last_values(state.history)):
                    self.writer.file_writer.add_summary(summary)
        finally:  # the writer's own thread ends whatever failed
            self._close()

    def _close(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __repr__(self) -> str:
        return f"TensorBoardHandler({str(self.log_dir)!r})"

"""CSVLoggerHandler: one CSV row per training epoch, and the run's hyperparameters in a JSON file beside it."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from pathlib import Path

from fitforge.core.events import EpochEnd, Stage, TrainBegin
from fitforge.core.history import History
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_flag, describe
from fitforge.reporting.hparams import run_params

log = logging.getLogger("fitforge")


class CSVLoggerHandler(TrainBegin, EpochEnd):
    """Write the history row of every training epoch to a CSV file as the epoch ends, flushed, and the run's
    hyperparameters to ``<name>.params.json`` beside it. A resumed run continues the file; a key that appears later
    adds a column. docs/handlers.md has the details.

    Args:
        path: the CSV file (its folder is created if needed).
        append: in a fresh (not resumed) run, add this run's rows after those of an existing log (Keras's ``append``);
            False overwrites the file at the run's first epoch end.
    """

    priority = Stage.REPORT  # after user handlers: the row is complete
    main_rank_only = True  # under torch.distributed, rank 0 reports for all
    reads = ("phase", "epoch", "history", "services", "estimator", "run", "batch_idx", "num_batches")
    writes = ()

    def __init__(self, path: str | os.PathLike, append: bool = False) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise FitforgeTypeError(f"CSVLoggerHandler: path must be a file path, got {describe(path)}")
        self.path = Path(path)
        self.params_path = self.path.with_name(f"{self.path.stem}.params.json")  # not with_suffix: "log" has none
        self.append = check_flag("CSVLoggerHandler", "append", append)
        self._header: list[str] = []  # empty until the run's first write

    def offer(self, services: Services) -> None:
        if self.path.parent.resolve() != Path.cwd().resolve():  # a folder of the run's, not the working one
            services.run_folders.append(self.path.parent)  # the run's manifest goes beside the log

    def train_begin(self, state: TrainState) -> None:
        self._header = []  # decided at the first write, once a resume (after train_begin) is known
        if self.path.is_dir():
            raise FitforgeValueError(f"CSVLoggerHandler: path {self.path} is a folder; expected a file path")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(self.path.parent, os.W_OK) or (self.path.exists() and not os.access(self.path, os.W_OK)):
            raise FitforgeValueError(f"CSVLoggerHandler: cannot write {self.path}: permission denied")
        temporary = self.params_path.with_name(self.params_path.name + ".tmp")
        temporary.write_text(json.dumps(run_params(state), indent=2) + "\n")
        os.replace(temporary, self.params_path)

    def epoch_end(self, state: TrainState) -> None:
        if state.phase != "train" or not state.run.epoch_finished:
            return  # a row per completed epoch: one cut short is written when a resumed run completes it
        history = state.history
        rows = self._start(state) if not self._header else [(history.epochs, _current_row(history))]
        if rows:
            self._write(rows)

    def _start(self, state: TrainState) -> list[tuple[int, dict[str, float]]]:
        """The first write of a run: choose the header and the rows to catch up on."""
        history = state.history
        resumed = state.run.resumed
        header, last = self._read() if resumed or self.append else (None, 0)
        if header is None:
            # Known now, not at train_begin: the first batch may have left out a default metric.
            expected = state.services.history_keys()
            keys = list(history) + [key for key in expected if key not in history]
            self._header = ["epoch", *keys]
            _write_rows(self.path, "w", [self._header])
        else:
            self._header = header
        if not resumed:  # a fresh run (appending or not) numbers its epochs from 1
            return [(history.epochs, _current_row(history))]
        return [(epoch, row) for epoch, row in enumerate(history.rows(), start=1) if epoch > last]

    def _read(self) -> tuple[list[str] | None, int]:
        """The header and last epoch of the file to continue; a line torn by a crash is dropped."""
        if not self.path.exists():
            return None, 0
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
            os.truncate(self.path, len(data))
            log.warning("CSVLoggerHandler: dropped an incomplete last line of %s (a write cut short)", self.path)
        lines = [line for line in csv.reader(io.StringIO(data.decode())) if line]
        if not lines:
            return None, 0
        try:
            if lines[0][0] != "epoch":
                raise ValueError
            last = int(lines[-1][0]) if len(lines) > 1 else 0
        except ValueError:
            raise FitforgeValueError(
                f"CSVLoggerHandler: {self.path} is not a log this handler can continue (its first column should be "
                f"'epoch', got {lines[0][:3]}...); pass another path, or move the file away"
            ) from None
        return lines[0], last

    def _write(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        new = list(dict.fromkeys(key for _, row in rows for key in row if key not in self._header))
        if new:  # the file rewritten with them as new columns (nan in the rows already written), atomically
            with self.path.open(newline="") as file:
                old = [line for line in csv.reader(file) if line][1:]
            self._header = [*self._header, *new]
            temporary = self.path.with_name(self.path.name + ".tmp")
            width = len(self._header)
            _write_rows(temporary, "w", [self._header, *(line + ["nan"] * (width - len(line)) for line in old)])
            os.replace(temporary, self.path)
            log.info("CSVLoggerHandler: new history key(s) %s: added as columns to %s", ", ".join(new), self.path)
        keys = self._header[1:]
        _write_rows(self.path, "a", [[epoch, *(row.get(key, math.nan) for key in keys)] for epoch, row in rows])

    def __repr__(self) -> str:
        return f"CSVLoggerHandler({str(self.path)!r})"


def _current_row(history: History) -> dict[str, float]:
    """The current epoch's row (nan for keys it has no value for), without copying the columns."""
    return {key: math.nan if (value := history.current(key)) is None else value for key in history}


def _write_rows(path: Path, mode: str, rows: list[list]) -> None:
    """Write ``rows`` to ``path`` (``mode`` "w" or "a"), flushed and fsynced: a crash loses at most one epoch."""
    with path.open(mode, newline="") as file:
        csv.writer(file, lineterminator="\n").writerows(rows)
        file.flush()
        os.fsync(file.fileno())

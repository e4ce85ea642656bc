"""ProgressBarHandler: a tqdm bar per epoch, refreshed at a throttled interval (docs/output.md, The progress bar)."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from tqdm.std import tqdm as text_bar

from fitforge.core.events import BatchEnd, EpochBegin, EpochEnd, Stage, TrainEnd
from fitforge.core.history import in_notebook
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, check_non_negative, check_positive, describe
from fitforge.reporting.formatting import epoch_label, format_value, pass_label
from fitforge.reporting.notebook_output import CellLine, notebook_bar

_MORE = " …"  # ends running values cut to fit the width


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a closed or odd stream is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def interactive() -> bool:
    """True on a terminal or in a Jupyter notebook, where a progress bar helps rather than clutters."""
    return in_notebook() or is_terminal(sys.stderr)


class _Sink:
    """Where a bar that must not redraw (output is no terminal) draws: nowhere."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class ProgressBarHandler(EpochBegin, BatchEnd, EpochEnd, TrainEnd):
    """Show a progress bar with the running loss and metrics, moved (and the running values read from the device)
    only every ``refresh_seconds``.

    Args:
        refresh_seconds: the throttle interval.
        leave: keep each finished training bar as the epoch's line. None (the default): keep it unless a
            LoggingHandler of the fit prints the epoch's line (its lines are enabled).
        file: the stream to draw on; None: ``sys.stderr``, or in a notebook, a cell output of each bar's own.
        ncols: the width in columns; None: the terminal's, followed as it changes.
    """

    priority = Stage.REPORT
    main_rank_only = True  # under torch.distributed, rank 0 reports for all
    reads = ("phase", "prefix", "epoch", "run", "num_batches", "metrics", "services")

    def __init__(
        self,
        refresh_seconds: float = 0.5,
        leave: bool | None = None,
        file: TextIO | None = None,
        ncols: int | None = None,
    ) -> None:
        check_non_negative("ProgressBarHandler", "refresh_seconds", refresh_seconds, (int, float))
        if leave is not None and not isinstance(leave, bool):
            raise FitforgeTypeError(f"ProgressBarHandler: leave must be True, False or None, got {describe(leave)}")
        if file is not None and not callable(getattr(file, "write", None)):
            raise FitforgeTypeError(f"ProgressBarHandler: file must be a text stream or None, got {describe(file)}")
        check_positive("ProgressBarHandler", "ncols", ncols, allow_none=True)
        self.refresh_seconds, self.leave, self.file, self.ncols = refresh_seconds, leave, file, ncols
        self._bar: Any = None
        self._cell: CellLine | None = None  # the bar's output in a notebook

    def offer(self, services: Services) -> None:
        services.bars.append(self.epoch_end)  # a handler printing an epoch's line ends the bar first

    def epoch_begin(self, state: TrainState) -> None:
        self._close()
        self._keep = state.phase == "train" and (
            self.leave if self.leave is not None else not state.services.shows_epoch_lines()
        )
        options = {
            "total": state.num_batches,
            "desc": epoch_label(state) if state.phase == "train" else pass_label(state),
            "leave": self._keep,
            "mininterval": self.refresh_seconds,
            "disable": False,  # tqdm's None would hide it where stderr is no terminal (a notebook)
        }
        if self.file is None and in_notebook():  # a cell output of its own, redrawn in place
            self._live = True
            self._bar, self._cell = notebook_bar(**options, ncols=self.ncols)
        else:
            stream = self._stream = self.file or sys.stderr
            self._live = is_terminal(stream)  # else no redraws: a file would get every one
            self._bar = text_bar(
                **options,
                file=stream if self._live else _Sink(),
                ncols=self.ncols if self._live else None,  # a file's line is not cut to a width
                dynamic_ncols=self._live and self.ncols is None,
            )
        self._pending = 0
        # Not live: nothing to show before the epoch ends, so no running values are read.
        self._next = time.monotonic() + self.refresh_seconds if self._live else math.inf

    def batch_end(self, state: TrainState) -> None:
        self._pending += 1
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.refresh_seconds
            self._flush(state.running_metrics())

    def _flush(self, values: dict[str, float]) -> None:
        bar = self._bar
        bar.update(self._pending)
        self._pending = 0
        width = bar.format_dict.get("ncols") if self._live else None
        bar.set_postfix_str(fitted(bar, values, width if isinstance(width, int) else None), refresh=self._live)

    def epoch_end(self, state: TrainState) -> None:
        if self._bar is None:
            return
        self._flush(state.metrics)
        if self._keep and not self._live:
            self._stream.write(f"{self._bar}\n")  # the finished bar, once: the epoch's line in a file
        self._close()

    def train_end(self, state: TrainState) -> None:
        self._close()

    def _close(self) -> None:
        bar, cell = self._bar, self._cell
        if bar is None:
            return
        if cell is not None:  # what the saved notebook keeps: the bar's last line, or nothing
            cell.show(str(bar) if self._keep else "")
        bar.close()
        self._bar = self._cell = None


def fitted(bar: Any, values: dict[str, float], width: int | None) -> str:
    """``values`` as the bar's postfix: whole ``key=value`` pairs, as many as leave the bar at least 10 cells in
    ``width`` columns (all of them when the width is unknown)."""
    pairs = [f"{key}={format_value(value)}" for key, value in values.items()]
    if width is None:
        return " ".join(pairs)
    # The line without values, its bar at tqdm's default of 10 cells; ", " joins the values to it.
    bare = bar.format_meter(**{**bar.format_dict, "postfix": None, "ncols": None})
    room = width - len(bare) - 2
    shown: list[str] = []
    for pair in pairs:
        more = _MORE if len(shown) + 1 < len(pairs) else ""  # pairs follow this one: room for the mark
        if len(" ".join([*shown, pair]) + more) > room:
            cut = (" ".join(shown) + _MORE).strip()
            return cut if len(cut) <= room else ""
        shown.append(pair)
    return " ".join(shown)

"""LivePlotHandler: the loss and metric curves, redrawn after every training epoch."""

from __future__ import annotations

import importlib
import io
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from fitforge.core.events import EpochEnd, Stage, TrainBegin
from fitforge.core.history import default_plotted, draw_history, figure_size, in_notebook, metric_names
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

log = logging.getLogger("fitforge")
DEFAULT_PATH = "fitforge-live.png"


class LivePlotHandler(TrainBegin, EpochEnd):
    """Redraw :meth:`History.plot`'s panels (train and val curves per metric) after every epoch: in place under the
    cell in a notebook, else in the PNG file ``path``, replaced whole each epoch (docs/output.md, Notebooks).

    Args:
        path: the PNG file. None: none in a notebook, else ``fitforge-live.png`` in the current directory.
        keys: metric names without prefix (``["loss", "accuracy"]``), as for ``History.plot``; None: every
            ``train_``/``val_`` name but the speeds.
    """

    priority = Stage.REPORT
    main_rank_only = True  # under torch.distributed, rank 0 draws for all
    reads = ("estimator", "phase", "history", "services")

    def __init__(self, path: str | os.PathLike | None = None, keys: list[str] | None = None) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise FitforgeTypeError(f"LivePlotHandler: path must be a file path or None, got {describe(path)}")
        if keys is not None and (
            isinstance(keys, str) or not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys)
        ):
            raise FitforgeTypeError(f"LivePlotHandler: keys must be a list of metric names or None, got {keys!r}")
        if keys is not None and not keys:
            raise FitforgeValueError("LivePlotHandler: keys must name at least one metric, got []")
        try:
            from matplotlib.figure import Figure
        except ImportError as err:
            raise ImportError("LivePlotHandler needs matplotlib: pip install 'fitforge[plot]'") from err
        self._figure = Figure
        self.path, self.keys = path, None if keys is None else list(keys)
        self._file: Path | None = None
        self._notebook = False
        self._shown: Any = None  # the notebook display's handle, once shown

    def train_begin(self, state: TrainState) -> None:
        # Nothing to check without keys, or with a custom validation's keys, known only once it ran.
        if self.keys is not None and state.services.keys_complete:
            names = metric_names(state.services.history_keys())
            unknown = [key for key in self.keys if key not in names]
            if unknown:
                raise FitforgeValueError(
                    f"LivePlotHandler: keys {unknown} are no metric this fit records; available: {names}. A value a "
                    "step logs with state.log(name, ...) is known before training when BatchProcessor.logs declares it"
                )
        self._notebook = in_notebook()
        self._shown = None  # a new fit draws in its own cell
        self._file = Path(self.path) if self.path is not None else None if self._notebook else Path(DEFAULT_PATH)
        if self.path is None and self._file is not None:
            log.info("LivePlotHandler: the curves go to %s after every epoch", self._file.resolve())

    def epoch_end(self, state: TrainState) -> None:
        if state.phase != "train":
            return
        available = metric_names(state.history)
        names = [name for name in self.keys or default_plotted(available) if name in available]
        if not names:
            return
        figure = self._figure(figsize=figure_size(len(names)))
        draw_history(figure, state.history, names)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=100)  # a Figure outside pyplot: no backend, no window
        png = buffer.getvalue()
        path = self._file
        if path is not None:  # through a temporary file in its folder, renamed over it: a viewer never sees half
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(handle, "wb") as file:
                    file.write(png)
                os.replace(temporary, path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        if self._notebook:
            display = importlib.import_module("IPython.display")
            image = display.Image(data=png, format="png")
            if self._shown is None:
                self._shown = display.display(image, display_id=True)
            else:
                self._shown.update(image)

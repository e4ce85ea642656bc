"""History: one row per epoch, returned by ``fit``.

A read-only mapping from keys (``train_loss``, ``val_accuracy``, ``lr``, ``epoch_time``...) to
per-epoch lists of floats. Every list has one entry per epoch begun; an epoch without a value for a
key (say, validation every second epoch) holds ``nan`` there.
"""

from __future__ import annotations

import csv
import math
import numbers
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any


def numbered_key(name: str, index: int) -> str:
    """The key of the ``index``-th of several values named ``name``: ``lr``, ``lr_1``, ``lr_2``..."""
    return name if index == 0 else f"{name}_{index}"


class History(Mapping):
    """Per-epoch records.

    Attributes:
        restored_epoch: the 1-based epoch whose weights the estimator holds after a restore (e.g.
            ``EarlyStoppingHandler(restore_best=True)``), so ``history.rows()[restored_epoch - 1]``
            holds the values matching the weights; None for the last epoch's weights. A new epoch
            clears it; checkpoints keep it.
        stop_reason: why training stopped (``"reached epochs=5"``, early stopping's reason...).
    """

    def __init__(self) -> None:
        self._columns: dict[str, list[float]] = {}
        self._epochs = 0
        self._recorded: set[str] = set()  # keys recorded in the current row (nan may be a recorded value)
        self._times: dict[str, int] = {}  # key -> records (a validation every n batches: several a row)
        self.stop_reason: str | None = None
        self.restored_epoch: int | None = None
        self.profile: str | None = None  # fit(profile=True)'s table of time per handler and event

    def new_epoch(self) -> None:
        """Open a row for a new epoch; every key gets ``nan`` until recorded."""
        self._epochs += 1
        self._recorded.clear()
        self.restored_epoch = None  # the weights move on from any restored epoch
        for column in self._columns.values():
            column.append(math.nan)

    def open_epoch(self, index: int) -> None:
        """Open the row of epoch ``index`` (0-based) unless it is open already: an epoch that a
        resume continues keeps the row its checkpoint holds."""
        if self._epochs <= index:
            self.new_epoch()

    def record(self, key: str, value: float) -> None:
        """Set ``key`` for the current (last) epoch, overwriting; an integer is kept as an int."""
        if self._epochs == 0:
            raise RuntimeError(
                "History.record() before the first epoch: history has rows only in fit, from epoch_begin on; in "
                "evaluate/predict (state.phase != 'train') put values in state.metrics or state.shared instead"
            )
        column = self._columns.get(key)
        if column is None:
            column = self._columns[key] = [math.nan] * self._epochs
        column[-1] = int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else float(value)
        self._recorded.add(key)
        self._times[key] = self._times.get(key, 0) + 1

    def __getitem__(self, key: str) -> list[float]:
        try:
            return list(self._columns[key])
        except KeyError:
            raise KeyError(f"history has no key {key!r}; available: {sorted(self._columns)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns)

    def __len__(self) -> int:
        return len(self._columns)

    @property
    def epochs(self) -> int:
        """Number of epoch rows (including a partial last epoch)."""
        return self._epochs

    def last(self, key: str, default: float = math.nan) -> float:
        """The latest non-nan value of ``key``, or ``default``."""
        return next((value for value in reversed(self._columns.get(key, ())) if not math.isnan(value)), default)

    def current(self, key: str) -> float | None:
        """The value recorded for ``key`` in the current row (a recorded nan included), else None."""
        return self._columns[key][-1] if key in self._recorded else None

    def current_row(self, finite: bool = False) -> dict[str, float]:
        """The values recorded in the current row, by key (only the finite ones when ``finite``)."""
        row = {key: self._columns[key][-1] for key in self._columns if key in self._recorded}
        return {key: value for key, value in row.items() if math.isfinite(value)} if finite else row

    def times_recorded(self, key: str) -> int:
        """How many times ``key`` was recorded into this History (loading a state does not count):
        a handler acting on each new value compares counts, as one row may get several equal ones."""
        return self._times.get(key, 0)

    def __contains__(self, key: object) -> bool:
        return key in self._columns

    def state_dict(self) -> dict:
        """The records as plain python values (for checkpoints)."""
        return {
            "columns": {k: list(v) for k, v in self._columns.items()},
            "epochs": self._epochs,
            "recorded": sorted(self._recorded),
            "stop_reason": self.stop_reason,
            "restored_epoch": self.restored_epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Replace the records with those of :meth:`state_dict`."""
        self._columns = {k: [x if type(x) is int else float(x) for x in v] for k, v in state["columns"].items()}
        self._epochs = int(state["epochs"])
        self._recorded = set(state.get("recorded", ()))  # keys of the last row: a resumed epoch continues it
        self.stop_reason = state.get("stop_reason")
        restored = state.get("restored_epoch")  # absent from checkpoints written before it
        self.restored_epoch = restored if restored is not None and restored <= self._epochs else None

    def extend(self, other: History) -> None:
        """Append ``other``'s rows after these (a key either lacks is nan in the other's rows) and
        take its ``stop_reason``: ``Estimator.history`` grows so fit after fit. ``restored_epoch``
        follows the weights: ``other``'s, renumbered; None when ``other`` has rows but restored
        none; kept when ``other`` has no row."""
        if other.restored_epoch is not None:
            self.restored_epoch = self._epochs + other.restored_epoch
        elif other._epochs:
            self.restored_epoch = None
        for key in other._columns:
            if key not in self._columns:  # in other's order: columns keep a stable order
                self._columns[key] = [math.nan] * self._epochs
        for key, column in self._columns.items():
            column.extend(other._columns.get(key, [math.nan] * other._epochs))
        self._epochs += other._epochs
        self._recorded = set(other._recorded)
        self.stop_reason = other.stop_reason

    def rows(self) -> list[dict[str, float]]:
        """The records as one dict per epoch."""
        return [{key: col[i] for key, col in self._columns.items()} for i in range(self._epochs)]

    def to_csv(self, path: str | Path) -> Path:
        """Write one row per epoch (with an ``epoch`` column, 1-based) to ``path``."""
        path = Path(path)
        with path.open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(["epoch", *self._columns])
            writer.writerows([i, *row.values()] for i, row in enumerate(self.rows(), start=1))
        return path

    def plot(self, path: str | Path | None = None, keys: list[str] | None = None):
        """Plot the loss and each metric (train and validation on one panel) with matplotlib, and
        return the Figure. In a notebook it is taken out of pyplot's figures, so it renders once, as
        the cell's value; elsewhere ``plt.show()`` opens it. Saved to ``path``, it is closed.

        Args:
            path: where to save a PNG; None only returns the figure.
            keys: metric names without prefix (default: every ``train_``/``val_`` name but speeds).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("History.plot() needs matplotlib: pip install 'fitforge[plot]'") from err
        available = metric_names(self)
        names = keys or default_plotted(available)
        if not names:
            raise ValueError(f"nothing to plot: history has no train_/val_ keys (keys: {list(self)})")
        unknown = [name for name in names if name not in available]
        if unknown:
            raise ValueError(f"History.plot(keys=...) got unknown names {unknown}; available: {available}")
        fig = plt.figure(figsize=figure_size(len(names)))
        draw_history(fig, self, names)
        return finish_figure(fig, path)

    def __repr__(self) -> str:
        """The epochs and each key's latest value (after a restore, the restored epoch's)."""
        restored = self.restored_epoch
        if restored is None:
            values = [f"{k}={self.last(k):.4g}" for k in self._columns]
            return f"History({', '.join([f'epochs={self._epochs}', *values])})"
        values = [f"{k}={v:.4g}" for k in self._columns if not math.isnan(v := self[k][restored - 1])]
        return f"History({', '.join([f'epochs={self._epochs}', f'restored_epoch={restored}', *values])})"


def in_notebook() -> bool:
    """True inside a Jupyter kernel (notebook, JupyterLab, VS Code, Colab), not in a terminal IPython."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    if shell is None:
        return False
    jupyter = any(cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__)
    return jupyter or "IPKernelApp" in getattr(shell, "config", ())


def figure_size(panels: int) -> tuple[float, float]:
    """Inches for a row of ``panels`` panels."""
    return (4.5 * panels, 3.5)


def draw_history(fig: Any, history: History, names: list[str]) -> None:
    """A panel per metric name in ``fig`` (a matplotlib Figure): its train and val curves by epoch."""
    axes = fig.subplots(1, len(names), squeeze=False)
    epochs = range(1, history.epochs + 1)
    for ax, name in zip(axes[0], names):
        for prefix in ("train_", "val_"):
            if prefix + name in history:
                ax.plot(epochs, history[prefix + name], marker="o", label=prefix.rstrip("_"))
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend()


def finish_figure(fig: Any, path: str | Path | None) -> Any:
    """Lay out ``fig`` (made with pyplot) and save it to ``path`` as a PNG when given. Returns it,
    closed when saved (an open figure only holds memory) and in a notebook (else shown twice)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    if path is not None or in_notebook():
        plt.close(fig)
    return fig


def is_timing(name: str) -> bool:
    """Whether a key measures time or speed (``epoch_time``, ``time_data_s``, a speed): values that differ
    between two runs of the same training."""
    return (
        name == "epoch_time"
        or name.endswith("_time")
        or (name.startswith("time_") and name.endswith("_s"))
        or is_speed(name)
    )


def is_speed(name: str) -> bool:
    """Whether a key or metric name is a speed (``train_samples_per_s``, ``mfu``), which summaries
    and plots leave out unless asked."""
    return name.endswith(("_per_s", "mfu"))


def default_plotted(names: list[str]) -> list[str]:
    """The metric names a plot shows unless asked for others: not the speeds (:func:`is_speed`)."""
    return [name for name in names if not is_speed(name)]


def metric_names(columns: Iterable[str]) -> list[str]:
    """The metric names (without ``train_``/``val_``) among ``columns``, in order of appearance."""
    names = (key.removeprefix(prefix) for key in columns for prefix in ("train_", "val_") if key.startswith(prefix))
    return list(dict.fromkeys(names))

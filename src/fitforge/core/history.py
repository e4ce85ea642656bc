"""History: one row per epoch, returned by ``fit``.

A read-only mapping from keys (``train_loss``, ``val_accuracy``, ``lr``, ``epoch_time``...) to
per-epoch lists of floats. Every list has one entry per epoch begun; an epoch without a value for a
key (say, validation every second epoch) holds ``nan`` there.

:class:`RunClock` feeds its ``time_<cause>_s`` columns: where a fit's wall-clock time went, by cause
(docs/handlers.md, "Where the time goes"). The loop times each training batch with the host's clock
(no device read): the wait for the loader's next batch (``data``), the step (``step``: forward, loss,
backward, the optimizer's update), and the hooks around it (``handlers``). Handlers whose work is a cause
of its own report it: a validation, a checkpoint's save (the time training stands still for it), a spike's
rollback (the steps it undid, and its own); a resume's restoring (``replay``: the checkpoint loaded, and
for data without positions the batches before it read and discarded); the first step of a compiled net beyond an
ordinary step (``compile``). The goodput is the step's share of the wall clock, whose rest (the fit's
set-up in ``train_begin``, the loop's own work) no cause claims.

Each epoch's row gets the seconds since the row before, recorded before ``epoch_end``: the time of an
epoch's end (its validation, its checkpoint) counts in the next row. The run's totals, across resumes,
go in every checkpoint. On a GPU the host's clock sees the device's time where the host waits for it: in
a step that reads a value, or in the next data wait; the shares are of the host's wall clock.
"""

from __future__ import annotations

import csv
import math
import numbers
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fitforge.exceptions import FitforgeValueError


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


CAUSES = ("step", "data", "handlers", "validation", "checkpoint", "compile", "replay", "rollback")
ALWAYS = ("step", "data", "handlers")  # in every History row; the others where the fit has their handlers
ADVICE = {  # what to try when a cause took much of a run's time
    "data": "give the DataLoader more num_workers (and persistent_workers=True; on a GPU, pin_memory=True), "
    "or make its __getitem__ cheaper",
    "checkpoint": "save in the background, CheckpointHandler(async_save=True), or less often (a larger "
    "batch_period or epoch_period)",
    "validation": "validate less often (ValidationHandler's epoch_period or batch_period) or on less data",
    "handlers": "fit(profile=True) times each handler in each event",
    "compile": "a longer run repays it, or Estimator(compile=False) saves it",
    "replay": "data with batch positions (a map-style DataLoader) or a state resumes without reading the "
    "batches before the checkpoint again",
    "rollback": "lower the learning rate, or raise SpikeGuardHandler's factor",
}


def history_key(cause: str) -> str:
    return f"time_{cause}_s"


class RunClock:
    """``state.run.clock``: the seconds of the fit by cause, this epoch's and the run's (across resumes).

    Handlers time a cause of their own with ``with state.run.clock.timing("validation"): ...``.
    """

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.epoch = dict.fromkeys(CAUSES, 0.0)  # since the last History row
        self.before: dict[str, float] = {}  # the run's before this fit (a resume's checkpoint), "wall" included
        self._done = dict.fromkeys(CAUSES, 0.0)  # this fit's, in its History rows
        self.causes: tuple[str, ...] = ALWAYS  # those the History rows record (a resume's replay: the totals only)
        self.last = 0.0  # the batch's last mark (the loop's, to_step's, to_hooks')
        self.in_step = False  # whether the time since then is a step's
        self.waited = self.stepping = self.hooked = 0.0  # the open pass's seconds, added by the loop batch by batch
        self._pass_reported = 0.0  # :attr:`reported` when the open pass began
        self.reported = 0.0  # the seconds of the causes reported within hooks, ever (the hooks' own are the rest)
        self._undone = 0.0  # seconds of steps a rollback undid, not yet taken out of the step's
        self._stepped = 0.0  # this fit's seconds in the steps of its closed passes, undone ones included

    @contextmanager
    def timing(self, cause: str) -> Iterator[None]:
        """Add the block's seconds to ``cause`` (one of :data:`CAUSES`); in a hook, they are not the hooks'."""
        if cause not in CAUSES:
            raise FitforgeValueError(f"RunClock.timing: cause must be one of {CAUSES}, got {cause!r}")
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(cause, time.perf_counter() - started)

    def add(self, cause: str, seconds: float) -> None:
        self.epoch[cause] += seconds
        if cause != "handlers":  # a cause timed within hooks: not the hooks' own time
            self.reported += seconds

    @contextmanager
    def hooks(self) -> Iterator[None]:
        """The block's seconds (hooks) to ``handlers``, but for the causes reported within it."""
        started, reported = time.perf_counter(), self.reported
        try:
            yield
        finally:
            self.add("handlers", max(0.0, time.perf_counter() - started - (self.reported - reported)))

    def to_step(self, state: Any) -> None:
        """A mark in a batch's hooks: the time since the last mark was the hooks', a step's from here."""
        now = time.perf_counter()
        self.hooked += now - self.last
        self.last, self.in_step = now, True

    def to_hooks(self, state: Any) -> None:
        """A mark in a batch's hooks: the time since the last mark was the step's, the hooks' from here."""
        now = time.perf_counter()
        self.stepping += now - self.last
        self.last, self.in_step = now, False

    def end_batch(self, now: float) -> None:
        """A batch's end (``now``), also where it raised: the time since its last mark to the step or the hooks."""
        if self.in_step:  # a step cancelled from within (a guard's CancelBatch at backward_end)
            self.stepping += now - self.last
            self.in_step = False
        else:
            self.hooked += now - self.last

    def open_batches(self) -> float:
        """The start of a pass over batches, whose seconds the loop adds batch by batch; returns the time."""
        self._pass_reported = self.reported
        return time.perf_counter()

    def close_batches(self) -> None:
        """The end of a pass over batches: its seconds go to the epoch's."""
        for cause, seconds in self._open_pass().items():
            self.epoch[cause] += seconds
        self._undone -= min(self._undone, self.stepping)
        self._stepped += self.stepping
        self.waited = self.stepping = self.hooked = 0.0

    def _open_pass(self) -> dict[str, float]:
        """The open pass's seconds by cause: the hooks' but for causes reported within them (a checkpoint's),
        the steps' but for those a rollback undid."""
        return {
            "data": self.waited,
            "step": self.stepping - min(self._undone, self.stepping),
            "handlers": max(0.0, self.hooked - (self.reported - self._pass_reported)),
        }

    def steps_so_far(self) -> float:
        """This fit's seconds in steps until now (a rollback's measure of the steps it undoes)."""
        return self._stepped + self.stepping

    def undo(self, seconds: float) -> None:
        """A rollback undid ``seconds`` of steps (and took some itself, within a step's time): the rollback's."""
        self._undone += seconds
        self.add("rollback", seconds)
        self.reported -= seconds  # no time of the hooks: the batches' own

    def record_epoch(self, history: Any) -> None:
        """Put the seconds since the last row in ``history``'s open row, before ``epoch_end`` (which loggers
        write): an epoch's end (its validation, its checkpoint) counts in the next row."""
        for cause, seconds in self.epoch.items():
            if cause in self.causes:
                history.record(history_key(cause), seconds)
            self._done[cause] += seconds
        self.epoch = dict.fromkeys(CAUSES, 0.0)

    def first_step(self, seconds: float, steps: int, compiled: bool) -> None:
        """The epoch's first step took ``seconds`` of its ``steps``: beyond an ordinary one, a compiled net's
        compilation."""
        if compiled:
            ordinary = (self.epoch["step"] - seconds) / (steps - 1) if steps > 1 else 0.0
            extra = max(0.0, seconds - ordinary)
            self.epoch["step"] -= extra
            self.epoch["compile"] += extra

    def totals(self) -> dict[str, float]:
        """The run's seconds by cause, and ``wall`` (this fit's from its start, and earlier fits' of the run)."""
        open_pass = self._open_pass()
        totals = {c: self.before.get(c, 0.0) + self._done[c] + self.epoch[c] + open_pass.get(c, 0.0) for c in CAUSES}
        totals["wall"] = self.before.get("wall", 0.0) + time.perf_counter() - self.started
        return totals

    def state_dict(self) -> dict[str, float]:
        return self.totals()

    def load_state_dict(self, totals: dict[str, float]) -> None:
        self.before = {key: float(value) for key, value in totals.items()}


def goodput(totals: dict[str, float]) -> tuple[float, str | None, float]:
    """``(the step's share of the wall clock, the cause that lost the most, its share)``."""
    wall = totals.get("wall", 0.0)
    if wall <= 0:
        return 1.0, None, 0.0
    losses = {cause: totals.get(cause, 0.0) for cause in CAUSES if cause != "step"}
    top = max(losses, key=losses.__getitem__)
    return totals.get("step", 0.0) / wall, (top if losses[top] > 0 else None), losses[top] / wall


def compiled(net: Any) -> bool:
    """Whether ``net`` runs compiled: by ``Estimator(compile=...)``, or a ``torch.compile``'d module."""
    return getattr(vars(net).get("forward"), "fitforge_compiled", False) or hasattr(net, "_orig_mod")

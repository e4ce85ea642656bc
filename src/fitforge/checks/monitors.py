"""Monitored keys, checked before training: every handler playing
:class:`~fitforge.core.roles.Monitoring` must watch a key the run will produce."""

from __future__ import annotations

import difflib
import itertools
import warnings
from collections.abc import Sequence

from fitforge.core.events import EventHandler
from fitforge.core.roles import Monitoring, Validating, players, role_of
from fitforge.core.state import EstimatorLike
from fitforge.exceptions import HandlerOrderError, MonitorKeyError
from fitforge.handlers.defaults import by_own_means, run_keys, unknown_val_keys


def check_monitors(handlers: Sequence[EventHandler], estimator: EstimatorLike) -> list[EventHandler]:
    """Every ``monitor`` attribute must name a key the run will produce. Returns the handlers that
    monitor a key only a custom ``eval_fn`` may produce (:func:`check_monitor_order`), which is checked
    at first use (:func:`fitforge.metrics.monitor.monitored_value`)."""
    monitors = [(h, m) for h in handlers if (m := role_of(h, Monitoring)) is not None and isinstance(m.monitor, str)]
    keys = run_keys(handlers, estimator) if monitors else []  # every fit: the keys only when one is monitored
    custom_eval, left = unknown_val_keys(handlers), []
    for handler, monitoring in monitors:
        key = str(monitoring.monitor)
        if key in keys:
            continue
        if custom_eval and key.startswith("val_"):
            left.append(handler)
            continue
        raise MonitorKeyError(
            f"{handler!r} monitors {key!r}, which this run will not produce; available keys: {', '.join(keys)}. "
            + _monitor_hint(key, keys, bool(players(handlers, Validating)), estimator)
        )
    # A best checkpoint and restored best weights judged by different keys are two different models.
    savers = [m for _, m in monitors if m.best_weights() == "saved"]
    restorers = [m for _, m in monitors if m.best_weights() == "restored"]
    for saver, restorer in itertools.product(savers, restorers):
        if saver.monitor != restorer.monitor:
            warnings.warn(
                f"{type(saver).__name__} keeps the best weights by {saver.monitor!r} but {type(restorer).__name__} "
                f"restores the best by {restorer.monitor!r}; the best checkpoint and the final weights may be "
                "different models: monitor the same key",
                UserWarning,
                stacklevel=4,  # the caller of fit
            )
    return left


def check_monitor_order(epoch_end: Sequence[EventHandler], left: Sequence[EventHandler]) -> None:
    """A handler monitoring a key only a custom validation records must run after that validation
    at ``epoch_end`` (in ``epoch_end``'s call order), or it would never see the epoch's value."""
    custom = [h for h in epoch_end if (v := role_of(h, Validating)) is not None and by_own_means(v)]
    for handler in left:
        monitoring = role_of(handler, Monitoring)
        if not custom or monitoring is None or handler not in epoch_end:
            continue
        if epoch_end.index(handler) < epoch_end.index(custom[0]):
            raise HandlerOrderError(
                f"{handler!r} monitors {monitoring.monitor!r}, which only a validation of your own such as "
                f"{custom[0]!r} records, but runs before it at epoch_end, so it would never see the epoch's "
                f"value: give {type(custom[0]).__name__} priority=Stage.METRICS + 1 (from fitforge.events)"
            )


def _monitor_hint(key: str, keys: list[str], validates: bool, estimator: EstimatorLike) -> str:
    """The fixes for a monitored key the run will not produce: a validation to add; the loss a step
    leaves out; else a near name (a typo), and a logged value to declare."""
    if key.startswith("val_") and not validates:
        return "No validation runs in this fit: pass val_data=... (or a ValidationHandler) to produce val_ keys"
    if key in ("train_loss", "val_loss") and not estimator.batch_processor.record_loss:
        return (
            f"The batch processor sets record_loss = False, which leaves its loss out of {key}: monitor a loss it "
            "logs by name (state.log), or record the loss"
        )
    near = difflib.get_close_matches(key, keys, n=1)
    name = key.split("_", 1)[1] if key.startswith(("train_", "val_")) else key
    return (f"Did you mean {near[0]!r}? " if near else "") + (
        f"A value a step logs with state.log({name!r}, ...) is known before training only when its name is "
        f"declared in BatchProcessor.logs, e.g. logs = ({name!r},)"
    )

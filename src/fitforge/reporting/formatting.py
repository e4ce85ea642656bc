"""How logged values read (docs/output.md): shared by the log lines, the progress bar and the final summary."""

from __future__ import annotations

import math
import numbers

from fitforge.core.state import TrainState


def format_value(value: float) -> str:
    """An int as it is; a float with 4 significant digits (``0.6931``), whole from 1e4 to 1e6 (``12346``),
    in e-notation outside 1e-3 to 1e6 (``1.234e-05``); 0, nan and inf as ``0``, ``nan``, ``inf``."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return str(int(value))
    value = float(value)
    if not math.isfinite(value):
        return str(value)  # nan, inf, -inf
    size = abs(value)
    if size == 0:
        return "0"
    if 1e-3 <= size < 1e6:
        text = f"{value:#.4g}"  # '#' keeps trailing zeros: 0.5000 lines up with 0.6931
        return f"{value:.0f}" if "e" in text else text.rstrip(".")
    return f"{value:.3e}"


def format_values(values: dict[str, float]) -> str:
    """``key=value`` pairs, space-separated, each value as :func:`format_value` writes it."""
    return " ".join(f"{key}={format_value(value)}" for key, value in values.items())


def epoch_label(state: TrainState) -> str:
    """``Epoch 6/8``: the epoch's number over the estimator's fits, out of the last this fit trains."""
    before = state.run.epochs_before
    total = f"/{before + state.run.max_epochs}" if state.run.max_epochs else ""
    return f"Epoch {before + state.epoch + 1}{total}"


def pass_label(state: TrainState) -> str:
    """``Validate`` for an evaluate pass (``Test`` for ``evaluate(prefix="test")``), ``Predict`` for predict."""
    return state.prefix.capitalize() if state.prefix else state.phase.capitalize()

"""How logged values read: shared by LoggingHandler and ProgressBarHandler."""

from __future__ import annotations

import math


def format_values(values: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in values.items() if not math.isnan(v))

"""The metric protocol (torchmetrics metrics fit it unchanged) and the on-device accumulator base of
the built-in metrics, which read no value to the host before ``compute``."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Metric(Protocol):
    """What fitforge needs of a metric (the torchmetrics protocol)."""

    def update(self, pred: torch.Tensor, label: torch.Tensor) -> None: ...

    def compute(self) -> torch.Tensor | float: ...

    def reset(self) -> None: ...

    def to(self, device: torch.device | str): ...


class SumCountMetric:
    """A mean of per-sample values, summed on the device: subclasses implement :meth:`batch_stats`,
    ``(sum tensor, count)`` of one batch (``count`` an int, or a device tensor so that counting never
    reads a value to the host), and may override :meth:`finish` to transform the mean."""

    name = "metric"
    higher_is_better: bool | None = None

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._count: int | torch.Tensor = 0

    def batch_stats(self, pred: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, int | torch.Tensor]:
        raise NotImplementedError

    def _takes(self, pred: torch.Tensor, label: torch.Tensor) -> bool:
        """Whether the shapes show that :meth:`batch_stats` takes the batch (raising where they do not fit)."""
        return False

    def update(self, pred: torch.Tensor, label: torch.Tensor) -> None:
        total, count = self.batch_stats(pred.detach() if pred.requires_grad else pred, label)
        self._accumulate(total, count)

    def _accumulate(self, total: torch.Tensor, count: int | torch.Tensor, weight: int = 1) -> None:
        # The first batch sets device and dtype: integer counts stay exact int64; float sums use
        # float64 on CPU (cheap there) and float32 on accelerators. Later batches add in place.
        if self._sum is None:
            floating = torch.float64 if total.device.type == "cpu" else torch.float32
            dtype = floating if total.is_floating_point() else torch.int64
            self._sum = torch.zeros((), dtype=dtype, device=total.device)
        if weight == 1:
            self._sum.add_(total)
        else:
            self._sum.add_(total, alpha=weight)
        if type(count) is int and type(self._count) is int:
            self._count += count
        elif isinstance(self._count, torch.Tensor):
            self._count.add_(count)  # a tensor count stays on the device
        else:
            self._count = self._count + count  # the first tensor count makes a new tensor: no aliasing

    def compute(self) -> torch.Tensor:
        if self._sum is None or not self._count:  # a tensor count is read here, at compute time only
            return torch.tensor(float("nan"))
        return self.finish(
            self._sum.double() / self._count if self._sum.device.type == "cpu" else self._sum.float() / self._count
        )

    def finish(self, mean: torch.Tensor) -> torch.Tensor:
        return mean

    def value(self) -> float:
        """:meth:`compute` as a float; a plain mean of a CPU sum and an int count is divided on the host."""
        total, count = self._sum, self._count
        if (
            total is not None
            and type(count) is int
            and count
            and total.device.type == "cpu"
            and type(self).compute is SumCountMetric.compute
            and type(self).finish is SumCountMetric.finish
        ):
            return float(total) / count
        return float(self.compute())

    def reset(self) -> None:
        self._sum = None
        self._count = 0

    def state_dict(self) -> dict[str, Any]:
        """The running sum and count (copies), for a mid-epoch checkpoint."""
        count = self._count.clone() if isinstance(self._count, torch.Tensor) else self._count
        return {"sum": None if self._sum is None else self._sum.clone(), "count": count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (call ``to(device)`` after, as the tensors come on the CPU)."""
        self._sum, self._count = state["sum"], state["count"]

    def to(self, device: torch.device | str) -> SumCountMetric:
        if self._sum is not None:
            self._sum = self._sum.to(device)
        if isinstance(self._count, torch.Tensor):
            self._count = self._count.to(device)
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def metric_state(metric: Any) -> dict[str, Any] | None:
    """A metric's running state as checkpoint-safe values (a built-in's or a torchmetrics metric's), else None."""
    if isinstance(metric, SumCountMetric):
        return metric.state_dict()
    states = getattr(metric, "metric_state", None)
    if isinstance(states, dict) and isinstance(getattr(metric, "_update_count", None), int):  # torchmetrics
        copied = {k: [t.clone() for t in v] if isinstance(v, list) else v.clone() for k, v in states.items()}
        return {"states": copied, "updates": metric._update_count}
    return None


def load_metric_state(metric: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`metric_state` returned (the metric then moves its states with ``to``)."""
    if isinstance(metric, SumCountMetric):
        metric.load_state_dict(state)
        return
    for name, value in state["states"].items():
        setattr(metric, name, value)
    metric._update_count = state["updates"]
    metric._computed = None  # torchmetrics caches compute()'s result


def merge_metric_state(metric: Any, state: dict[str, Any]) -> None:
    """Add another rank's :func:`metric_state` to the state ``metric`` holds (resumed on fewer ranks)."""
    if isinstance(metric, SumCountMetric):
        if state["sum"] is not None:
            device = state["sum"].device if metric._sum is None else metric._sum.device
            count = state["count"].to(device) if isinstance(state["count"], torch.Tensor) else state["count"]
            metric._accumulate(state["sum"].to(device), count)
        return
    metric.merge_state(state["states"])
    metric._update_count += state["updates"]
    metric._computed = None


class Tally(SumCountMetric):
    """A count and a total of a run's batches (samples, tokens), totalled over ranks like any sum."""

    def __init__(self) -> None:
        super().__init__()
        self._host_total = 0
        self.totalled = False  # whether any batch gave a total

    def add(self, count: int, total: torch.Tensor | int | None = None) -> None:
        self._count += count  # an int: counts are given as ints
        if total is None:
            return
        self.totalled = True
        if isinstance(total, torch.Tensor):  # a copy at first: the caller's tensor is never added to
            self._sum = total.to(torch.int64, copy=True) if self._sum is None else self._sum.add_(total)
        else:
            self._host_total += total

    def fold(self, device: torch.device | str = "cpu") -> None:
        """Put the host part of the total into the sum, on its device or else ``device`` (the collectives')."""
        if self._host_total:
            on = device if self._sum is None else self._sum.device
            extra = torch.tensor(self._host_total, dtype=torch.int64, device=on)
            self._sum = extra if self._sum is None else self._sum + extra
            self._host_total = 0

    def reset(self) -> None:
        super().reset()
        self._host_total, self.totalled = 0, False

    @property
    def count(self) -> int:
        return int(self._count)

    def total(self) -> int:
        """The total (a read to the host when it is on a device)."""
        self.fold()
        return 0 if self._sum is None else int(self._sum)

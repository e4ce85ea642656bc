"""GradientUpdateHandler: the optimizer step, after the batch processor's backward."""

from __future__ import annotations

from ..events import BatchEnd, TrainBegin


class GradientUpdateHandler(TrainBegin, BatchEnd):
    """Step every optimizer, then ``zero_grad(set_to_none=True)``, at each batch end.

    It runs first at ``batch_end`` (priority -2000), so later handlers see updated weights. A
    handler that must read gradients before the step takes a priority below -2000.
    """

    priority = -2000

    def train_begin(self, state) -> None:
        self._optimizers = list(state.estimator.optimizers)
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)

    def batch_end(self, state) -> None:
        for optimizer in self._optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

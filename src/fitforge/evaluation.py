"""An evaluation set up once and run as often as asked: by ``Estimator.evaluate``, and by a fit's
ValidationHandler at every validation. Each pass costs its batches, a fresh state and its events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fitforge.core.dispatch import Dispatcher
from fitforge.core.events import EventHandler, offered
from fitforge.core.loop import run_pass
from fitforge.core.processor import bound_step
from fitforge.core.run import RunContext, Step
from fitforge.core.services import Services
from fitforge.core.state import RunControl, TrainState
from fitforge.distributed.ranks import on_this_rank, processes
from fitforge.inputs.order import OnePass


class Evaluation:
    """Loss and metrics of ``estimator.val_net`` over ``val_data`` (checked re-iterable batches of
    ``num_batches`` if known; with ``sharded``, this rank's share, maybe empty), each time it is called.
    ``handlers``: the passes' (a MetricHandler among them); ``prefix``: the keys' first word (None:
    ``val``); ``first_check`` wraps the step until a pass reads a batch (None: checked already).
    """

    def __init__(
        self,
        estimator: Any,  # an Estimator (the layer above this one)
        val_data: Iterable,
        num_batches: int | None,
        handlers: Sequence[EventHandler],
        prefix: str | None = None,
        sharded: bool = False,
        first_check: Callable[[Step, Sequence[Callable[[TrainState], None]]], Step] | None = None,
    ) -> None:
        self.estimator, self.val_data, self.num_batches = estimator, val_data, num_batches
        self.prefix, self.sharded = prefix, sharded
        self.dispatcher, self.ranks = Dispatcher(on_this_rank(handlers)), processes()
        self.step = bound_step(estimator.batch_processor, estimator, "evaluate_batch")
        self.services = offered(self.dispatcher.handlers, Services())  # each pass's, its first-batch checks among them
        self.check = None if first_check is None else first_check(self.step, self.services.first_batch_checks)

    @property
    def checked(self) -> bool:
        """Whether its first batch was checked (before training, or by a pass that read one)."""
        return self.check is None

    def __call__(self) -> dict[str, float]:
        """One pass: ``{"val_loss": ..., "val_<metric>": ...}`` (``<prefix>_loss``...)."""
        estimator = self.estimator
        state = TrainState(
            estimator,
            "validate",
            num_batches=self.num_batches,
            prefix=self.prefix,
            services=self.services,
            run=RunControl(ranks=self.ranks),
        )
        run = RunContext(
            self.dispatcher,
            self.step,
            OnePass(self.val_data),
            "val_data",
            self.check or self.step,
            allow_empty=self.sharded,
            watch=estimator.pass_watch,  # within a fit: a signal abandons the pass (PassAbandoned)
        )
        try:
            with estimator.strategy.evaluating(estimator.val_net, estimator.weight_average):
                run_pass(state, run)
        finally:
            if state.output is not None:  # a batch went through the check: later passes are not checked
                self.check = None
        return dict(state.metrics)

"""An evaluation set up once and run as often as asked: ``Estimator.evaluate`` runs one, and a
fit's ValidationHandler runs the same one at every validation.

Setting up checks and prepares what does not change between passes: the data (arrays batched,
split between ranks under torch.distributed), the net's placement, the handlers and their
dispatcher, the step. Each pass then costs its batches, a fresh state and the pass's events. The
first pass checks its first batch (see :mod:`fitforge.core.first_batch`), unless the validation
data was checked before training (:func:`fitforge.preflight.check_first_val_batch`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fitforge.core.arrays import eval_loader
from fitforge.core.data import check_data
from fitforge.core.dispatch import Dispatcher
from fitforge.core.events import EventHandler
from fitforge.core.first_batch import check_first_batch_of
from fitforge.core.loop import run_pass
from fitforge.core.processor import bound_step
from fitforge.core.run import OnePass, RunContext, inference
from fitforge.core.state import TrainState
from fitforge.distributed.data_split import shard_eval
from fitforge.distributed.ranks import on_this_rank
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.handlers.defaults import evaluate_handlers
from fitforge.preflight import check_first_val_batch, check_placement


class Evaluation:
    """Loss and metrics of ``estimator.val_net`` over ``val_data``, each time it is called.

    Args:
        estimator: whose ``val_net``, validation loss and batch processor run.
        val_data: re-iterable batches, or arrays ``(X, y)`` batched by ``batch_size`` (default 32).
        event_handlers: the passes' handlers (a MetricHandler of ``val_metrics`` when none is one).
        checked: the data's first batch was checked already: the first pass skips that check.
        placed: the caller has just checked that ``val_net`` is on the estimator's device (fit, which
            sets up its validations right after): not checked again here.
        prefix: the first word of the result's keys (``"test"``: ``test_loss``...); see
            :func:`check_prefix`.
    """

    def __init__(
        self,
        estimator: Any,  # an Estimator (the layer above this one)
        val_data: Iterable,
        event_handlers: Sequence[EventHandler] | None = None,
        batch_size: int | None = None,
        checked: bool = False,
        prefix: str = "val",
        placed: bool = False,
    ) -> None:
        self.prefix = None if check_prefix(prefix) == "val" else prefix  # None: the phase's own, val
        val_data = self.unsplit = eval_loader(val_data, batch_size, "val_data")  # unsplit: the check's
        self.num_batches = check_data(val_data, "val_data", passes=1)
        self.sharded = False
        if estimator.splits_data:
            val_data, self.sharded = shard_eval(val_data, padded=estimator.strategy == "fsdp")
            self.num_batches = len(val_data) if self.sharded else self.num_batches  # type: ignore[arg-type]
        if not placed:
            check_placement(estimator, "val_net")
        self.estimator, self.val_data, self.checked = estimator, val_data, checked
        self.dispatcher = Dispatcher(on_this_rank(evaluate_handlers(event_handlers)))
        self.step = bound_step(estimator.batch_processor, estimator, "evaluate_batch")

    def check_first(self, name: str = "val_data") -> bool:
        """The check before training (:func:`fitforge.preflight.check_first_val_batch`) through this
        evaluation's handlers and step; once it checked a batch, the first pass skips its own check.
        ``name`` names the data in errors. Returns whether it checked a batch."""
        handlers, estimator = self.dispatcher.handlers, self.estimator
        self.checked = check_first_val_batch(estimator, self.unsplit, name, handlers=handlers, step=self.step)
        return self.checked

    def __call__(self) -> dict[str, float]:
        """One pass: ``{"val_loss": ..., "val_<metric>": ...}`` (``<prefix>_loss``...)."""
        estimator = self.estimator
        state = TrainState(estimator, "validate", num_batches=self.num_batches, prefix=self.prefix)
        run = RunContext(self.dispatcher, self.step, OnePass(self.val_data), "val_data", allow_empty=self.sharded)
        if not self.checked:
            estimator._val_loss.arm_checks()
            check_first_batch_of(run)
        with inference(estimator.val_net, estimator.strategy != "fsdp"):
            run_pass(state, run)
        self.checked = self.checked or state.batch_idx >= 0  # a pass that read a batch checked it
        return dict(state.metrics)


def check_prefix(prefix: object) -> str:
    """``prefix`` must be a non-empty identifier-like str without a trailing ``_`` (``"val"``,
    ``"test"``, ``"holdout_2"``): the keys are ``<prefix>_loss``, ``<prefix>_<metric>``. Returns it.

    Raises:
        FitforgeTypeError: not a str.
        FitforgeValueError: empty, not identifier-like, or ending in ``_``.
    """
    if not isinstance(prefix, str):
        raise FitforgeTypeError(f"evaluate: prefix must be a str such as 'val' or 'test', got {describe(prefix)}")
    if not (prefix.isidentifier() and prefix.isascii() and prefix[0].isalpha() and not prefix.endswith("_")):
        stripped = prefix.rstrip("_")
        valid = stripped.isidentifier() and stripped.isascii() and stripped[:1].isalpha()
        hint = f"; the '_' is added: pass {stripped!r}" if prefix.endswith("_") and valid else ""
        raise FitforgeValueError(
            f"evaluate: prefix must be a non-empty name of letters, digits and '_' that starts with a letter "
            f"and does not end in '_' (the keys are '<prefix>_loss', '<prefix>_<metric>'), got {prefix!r}{hint}"
        )
    return prefix

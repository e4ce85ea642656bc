"""The checks of a run's first batch, so that a mistake fails before the first optimizer step with
an error naming the culprit (what is checked, in order: docs/getting-started.md, "What is checked
before the first optimizer step").

:func:`first_batch_check` gives the step the loop calls for a run's first batch (a fit, resumed or
not, and each evaluate or predict pass until one reads a batch); later batches cost nothing here.
evaluate and predict change no weight: their first batch gets the loss's checks (evaluate) and an error
in the net explained.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from fitforge.checks.forward_errors import explain
from fitforge.core.batches import check_finite
from fitforge.core.processor import check_batch_output
from fitforge.core.state import EstimatorLike, TrainState
from fitforge.exceptions import BatchFormatError


def first_batch_check(
    step: Callable[[TrainState, Any], Any], checks: Sequence[Callable[[TrainState], None]], name: str, phase: str
) -> Callable[[TrainState, Any], Any]:
    """The step of a run's first batch of ``name``: ``step`` with the checks before the first optimizer
    step (training: nan/inf data, the loss's checks, the output, ``checks``), or with an error in the net
    explained (evaluate, predict)."""

    def checked(state: TrainState, batch: Any) -> Any:
        return explained_step(state, step, batch)

    def checked_training(state: TrainState, batch: Any) -> Any:
        # A resumed fit is checked too: its metrics or handlers may differ from the run that saved.
        estimator = state.estimator
        if not estimator.batch_processor.allow_nonfinite:
            check_finite(batch, name)
        output = explained_step(state, step, batch)
        check_output(estimator, output)
        state.output = output
        check_handlers(state, checks)
        return output

    return checked_training if phase == "train" else checked


def check_output(estimator: EstimatorLike, output: Any, method: str = "fit_batch") -> None:
    """A BatchOutput with a batch size (``method`` names the processor's method), no 0-d label, a
    scalar loss."""
    check_batch_output(output, method)
    estimator.losses.train.check_first_batch(output.loss)


def explained_step(state: TrainState, step: Callable[[TrainState, Any], Any], batch: Any) -> Any:
    """``step(state, batch)``, with an error raised inside the net explained (the original as ``__cause__``)."""
    estimator = state.estimator
    net = estimator.net if state.phase == "train" else estimator.val_net
    if state.phase != "predict":  # the loss checks its inputs on the call this step makes
        estimator.losses.of(state.phase).arm_checks()
    try:
        return step(state, batch)
    except RuntimeError as error:
        explained = explain(error, (estimator.net, estimator.val_net), estimator.device, net)
        if explained is None:
            raise
        raise explained from error
    except TypeError as error:
        keys = estimator.batch_processor.label_keys
        own_label = estimator.loss is None and _labelled(batch, keys)  # the label went to the net too
        if not (isinstance(batch, Mapping) or own_label) or "argument" not in str(error):
            raise
        if own_label:  # a net that may not take it
            raise BatchFormatError(
                f"with loss=None the net computes its own loss, so it is given the label (as labels=... "
                f"for a dict batch, as its last argument for a (data, label) pair), but it cannot take it: "
                f"{error}; the net's forward takes {_signature(net)}. Give a loss function (loss=...) "
                "for a net that returns predictions, or let forward take the label and return the loss"
            ) from error
        if not _labelled(batch, keys):  # data alone: every key went to forward
            named = " or ".join(map(repr, keys))
            raise BatchFormatError(
                f"got a dict batch with keys {list(batch)} and no label ({named}), so every key went to the "
                f"net as an argument, and its forward, which takes {_signature(net)}, refused: {error}; put "
                f"the label under {named} (or name its key with BatchProcessor(label_key=...)) and name the "
                "other keys after forward's arguments, or override BatchProcessor.unpack"
            ) from error
        raise BatchFormatError(
            f"the net cannot take this dict batch's keys as its arguments: {error}; the net's forward "
            f"takes {_signature(net)} and the batch's keys other than the label are "
            f"{[k for k in batch if k not in keys]}: name the keys after forward's arguments (the "
            "label under 'labels'), or override BatchProcessor.unpack"
        ) from error


def _labelled(batch: Any, keys: tuple[str, ...]) -> bool:
    """Whether a batch holds a label (see :mod:`fitforge.core.batches`: not data alone)."""
    if isinstance(batch, Mapping):
        return any(key in batch for key in keys)
    return not (isinstance(batch, Tensor) or (isinstance(batch, (tuple, list)) and len(batch) == 1))


def _signature(net: nn.Module) -> str:
    try:
        return str(inspect.signature(net.forward))
    except (TypeError, ValueError):  # no signature to read
        return "(...)"


def check_handlers(state: TrainState, checks: Sequence[Callable[[TrainState], None]]) -> None:
    """Call the first-batch checks the handlers offered (``state.output`` is set)."""
    for check in checks:
        check(state)

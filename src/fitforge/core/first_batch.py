"""The sanity check: the first batch of a run is checked so that a mistake fails before the first
optimizer step, with an error naming the culprit; and fit, evaluate and predict first check that the
net still lives on the estimator's device.

:func:`check_first_batch_of` wraps the run's step so that the first batch of a fit (resumed or not, and
of each evaluate or predict pass) goes through :func:`first_step`, and every other batch through the
step itself: nothing here costs a batch after the first. On the first training batch, in order:

1. nan or inf in the batch's floating tensors (data and labels), before the forward, so that not even
   BatchNorm's running statistics see them (one host read per tensor; ``BatchProcessor(
   allow_nonfinite=True)`` skips it);
2. the step; a ``RuntimeError`` raised inside a layer of the net becomes a ForwardError (a
   DeviceMismatchError for devices) naming the layer, what it received and a fix (see
   :mod:`fitforge.core.forward_errors`). The LossSet checks counts, shapes, label dtypes and class
   ranges on this call (see ``LossSet.check_shapes``);
3. the estimator's checks of the output: a BatchOutput with a batch size, no 0-d label, a scalar loss;
4. every handler's ``check_first_batch(state)``, for handlers that have one, before any ``batch_end``
   hook and so before the optimizer step: MetricHandler updates throw-away copies of its metrics.
   A handler of your own may define it too, to refuse a run before its first step (``state.phase``
   is "train", or "validate" for the validation batch checked before training).

evaluate and predict change no weight, so their first batch gets step 2 only; the first validation
batch, evaluated once before training (:func:`fitforge.preflight.check_first_val_batch`), gets all four.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fitforge.core.data import LABEL_KEYS, check_finite
from fitforge.core.forward_errors import explain, same_device
from fitforge.core.modules import tensors_of
from fitforge.core.roles import FirstBatchCheck, players
from fitforge.core.run import RunContext
from fitforge.core.state import TrainState
from fitforge.exceptions import BatchFormatError, DeviceMismatchError


def first_step(
    state: TrainState, step: Callable[[TrainState, Any], Any], batch: Any, handlers: Sequence[object], name: str
) -> Any:
    """Run ``step`` on the first batch of ``name`` with the checks of the module docstring."""
    estimator = state.estimator
    if state.phase != "train":
        return explained_step(state, step, batch)
    if not getattr(estimator.batch_processor, "allow_nonfinite", False):
        check_finite(batch, name)
    output = explained_step(state, step, batch)
    estimator.check_first_batch(output)
    state.output = output
    check_handlers(state, handlers)
    return output


def check_first_batch_of(run: RunContext) -> None:
    """Make the run's next step go through :func:`first_step`; once one has, every later batch
    calls the step itself (a batch cancelled inside the step is no checked batch: the next is)."""
    step = run.step

    def checked(state: TrainState, batch: Any) -> Any:
        # A resumed fit is checked too: its metrics or handlers may differ from the run that saved.
        output = first_step(state, step, batch, run.dispatcher.handlers, run.name)
        run.step = step
        return output

    run.step = checked


def explained_step(state: TrainState, step: Callable[[TrainState, Any], Any], batch: Any) -> Any:
    """``step(state, batch)``, with an error raised inside the net explained (the original as ``__cause__``)."""
    estimator = state.estimator
    try:
        return step(state, batch)
    except RuntimeError as error:
        called = estimator.net if state.phase == "train" else estimator.val_net
        explained = explain(error, (estimator.net, estimator.val_net), estimator.device, called)
        if explained is None:
            raise
        raise explained from error
    except TypeError as error:
        own_loss = estimator.loss is None
        if not (isinstance(batch, Mapping) or own_loss) or "argument" not in str(error):
            raise
        net = estimator.net if state.phase == "train" else estimator.val_net
        if own_loss:  # the label went to the net, which may not take it
            raise BatchFormatError(
                f"with loss=None the net computes its own loss, so it is given the label (as labels=... "
                f"for a dict batch, as its last argument for a (data, label) pair), but it cannot take it: "
                f"{error}; the net's forward takes {_signature(net)}. Give a loss function (loss=...) "
                "for a net that returns predictions, or let forward take the label and return the loss"
            ) from error
        keys = getattr(estimator.batch_processor, "_label_keys", LABEL_KEYS)
        raise BatchFormatError(
            f"the net cannot take this dict batch's keys as its arguments: {error}; the net's forward "
            f"takes {_signature(net)} and the batch's keys other than the label are "
            f"{[k for k in batch if k not in keys]}: name the keys after forward's arguments (the "
            "label under 'labels'), or override BatchProcessor.unpack"
        ) from error


def _signature(net: nn.Module) -> str:
    try:
        return str(inspect.signature(net.forward))
    except (TypeError, ValueError):  # no signature to read
        return "(...)"


def check_handlers(state: TrainState, handlers: Sequence[object]) -> None:
    """Call ``check_first_batch(state)`` of every handler that checks the first batch
    (:class:`~fitforge.core.roles.FirstBatchCheck`; ``state.output`` is set)."""
    for check in players(handlers, FirstBatchCheck):
        check.check_first_batch(state)


def check_devices(net: nn.Module, device: torch.device, argument: str) -> None:
    """Every parameter and buffer of ``net`` must be on ``device``, where the Estimator placed it: a
    later ``net.to(...)`` would otherwise fail in the forward, or train a copy the optimizer never sees."""
    if all(same_device(found, device) for found in {t.device for t in tensors_of(net)}):
        return  # every fit checks: the names (a slower walk of the modules) only for the error
    for kind, named in (("parameter", net.named_parameters()), ("buffer", net.named_buffers())):
        for name, tensor in named:
            if not same_device(tensor.device, device):
                raise DeviceMismatchError(
                    f"{kind} {name!r} of {argument} is on {tensor.device}, but the estimator's device is {device}: "
                    f"the net was moved after the Estimator placed it (net.to(...), .cuda(), .cpu()); give the "
                    f"device to the Estimator instead (Estimator(..., device=...)), or move the net back: "
                    f"estimator.{argument}.to({str(device)!r})"
                )

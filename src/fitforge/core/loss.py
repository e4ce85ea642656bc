"""One or several losses matched by position to the net's outputs and the labels, or the loss a
model computes itself.

``LossSet(loss, weights)`` computes the weighted total and each part; ``ModelLoss`` (``loss=None``)
reads the ``loss`` of the model's output. Counts must agree: one output,
one label and one loss each, or tuples of equal length. A loss that fails on its inputs is re-raised
as a :class:`~fitforge.exceptions.LossInputError` naming shapes, dtypes and a likely fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, LossInputError, describe

_ELEMENTWISE = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss)


def _spec(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    return describe(value)


def _hint(fn: Callable, pred: Any, label: Any) -> str:
    if not (isinstance(pred, torch.Tensor) and isinstance(label, torch.Tensor)):
        return ""
    classifier = isinstance(fn, (nn.CrossEntropyLoss, nn.NLLLoss))
    if classifier and not label.is_floating_point() and label.shape == (pred.shape[0], *pred.shape[2:]):
        if label.dtype not in (torch.int64, torch.uint8):
            return f"; class-index labels must be int64, got {str(label.dtype).replace('torch.', '')}: use label.long()"
        if pred.dim() >= 2 and label.numel() and int(label.max()) >= pred.shape[1]:  # error path only: a read is fine
            return (
                f"; labels go up to {int(label.max())} but the net outputs {pred.shape[1]} class scores, so "
                f"labels must lie in 0..{pred.shape[1] - 1}: give the last layer {int(label.max()) + 1} outputs"
            )
    classes = (pred.shape[0], *pred.shape[2:])
    if classifier and label.is_floating_point() and label.shape != pred.shape:
        return f"; class-index labels must be int64 of shape {classes}: use label.long()"
    if classifier and label.dim() == pred.dim() and label.shape[1:2] == (1,):
        return f"; class-index labels must have shape {classes}, without the class axis: use label.squeeze(1)"
    if isinstance(fn, _ELEMENTWISE) and not label.is_floating_point():
        return "; this loss needs a floating-point label: use label.float()"
    return ""


def _class_indices(pred: torch.Tensor, label: torch.Tensor) -> bool:
    """Whether ``label`` holds class indices for scores ``pred`` of shape (N, C, ...)."""
    return (
        pred.dim() >= 2
        and not label.is_floating_point()
        and label.dtype != torch.bool
        and label.shape == (pred.shape[0], *pred.shape[2:])
    )


def _not_a_tensor(output: Any) -> str:
    """The fix for a net output a loss cannot take: a model's output object, or a forgotten return."""
    if output is None:
        return "the net must return a tensor, or a tuple of tensors for several losses (did forward() forget a return?)"
    items = list(output) if isinstance(output, Mapping) else [k for k in ("loss", "logits") if hasattr(output, k)]
    if items:
        return (
            f"it holds {', '.join(map(str, items))}: use Estimator(loss=None) to train on the loss the model "
            "computes itself, or BatchProcessor(output_key=...) to give this loss one of its items "
            "(e.g. output_key='logits')"
        )
    return "the net must return a tensor, or a tuple of tensors for several losses"


def _name(fn: Callable) -> str:
    return type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, "__name__", type(fn).__name__)


class LossSet:
    """The configured loss(es) with their weights."""

    def __init__(self, loss: Any, weights: Sequence[float] | None = None, argument: str = "loss") -> None:
        fns = list(loss) if isinstance(loss, (list, tuple)) else [loss]
        if not fns:
            raise FitforgeValueError(f"{argument} is an empty list; give at least one loss")
        for fn in fns:
            if isinstance(fn, type):
                raise FitforgeTypeError(f"{argument} got {describe(fn)}; pass an instance: {fn.__name__}()")
            if not callable(fn):
                raise FitforgeTypeError(
                    f"{argument} must be a loss module or a callable (pred, label) -> scalar tensor, "
                    f"or a list of them, got {describe(fn)}"
                )
        if weights is None:
            weights = [1.0] * len(fns)
        elif not isinstance(weights, (list, tuple)) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights
        ):
            raise FitforgeTypeError(f"loss_weights must be a list of numbers, one per loss, got {describe(weights)}")
        elif len(weights) != len(fns):
            raise FitforgeValueError(
                f"loss_weights has {len(weights)} weight(s) but {len(fns)} loss(es) are configured; give one per loss"
            )
        self.fns = fns
        self.weights = [float(w) for w in weights]
        self.multi = isinstance(loss, (list, tuple))
        self._single_unweighted = not self.multi and self.weights == [1.0]  # one unweighted loss: the fast path
        self.names = [_name(fn) for fn in fns]
        self._shapes_checked = False

    def to(self, device: torch.device) -> LossSet:
        for fn in self.fns:
            if isinstance(fn, nn.Module):
                fn.to(device)
        return self

    def _pair(self, pred: Any, label: Any) -> tuple[Sequence, Sequence]:
        preds = pred if isinstance(pred, (tuple, list)) else (pred,)
        labels = label if isinstance(label, (tuple, list)) else (label,)
        n = len(self.fns)
        if len(preds) != n or len(labels) != n:
            raise LossInputError(
                f"outputs, losses and labels are matched by position but their counts differ: the net "
                f"returned {len(preds)} output(s), {n} loss(es) are configured and the batch has "
                f"{len(labels)} label(s); make the three counts equal (loss=[...] for several outputs, "
                "label a tuple with one tensor per loss)"
            )
        return preds, labels

    def __call__(self, pred: Any, label: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Return ``(weighted total, each loss)``."""
        if not self._shapes_checked:
            return self._first_call(pred, label)
        if self._single_unweighted and type(pred) is torch.Tensor and type(label) is torch.Tensor:
            try:  # the common case, kept short: it runs every batch
                value = self.fns[0](pred, label)
            except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as err:
                raise self._failure(0, pred, label, err) from err
            return value, (value,)
        preds, labels = self._pair(pred, label)
        for i, p in enumerate(preds):
            if not isinstance(p, torch.Tensor):
                raise LossInputError(f"output {i} of the net is {describe(p)}, not a tensor; {_not_a_tensor(p)}")
        parts = [self._call(i, p, y) for i, (p, y) in enumerate(zip(preds, labels))]
        if len(parts) == 1 and self.weights[0] == 1.0:
            return parts[0], (parts[0],)
        total = cast(torch.Tensor, sum(w * v for w, v in zip(self.weights, parts)))  # 0 + tensors: a tensor
        return total, tuple(parts)

    def _first_call(self, pred: Any, label: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The first call of a run: shapes checked before, the values' type after."""
        self.check_shapes(pred, label)
        self._shapes_checked = True
        total, parts = self(pred, label)
        for i, part in enumerate(parts):
            if not isinstance(part, torch.Tensor):
                raise LossInputError(
                    f"loss {i} ({self.names[i]}) returned {describe(part)}, not a tensor: a loss must be "
                    "computed with torch operations so it can be backpropagated; do not turn it into a "
                    "Python number (.item(), float(), numpy)"
                )
        return total, parts

    def _call(self, i: int, pred: Any, label: Any) -> torch.Tensor:
        try:
            return self.fns[i](pred, label)
        except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as err:
            raise self._failure(i, pred, label, err) from err

    def _failure(self, i: int, pred: Any, label: Any, err: Exception) -> LossInputError:
        return LossInputError(
            f"loss {i} ({self.names[i]}) failed on pred {_spec(pred)} and label {_spec(label)}"
            f"{_hint(self.fns[i], pred, label)}. Original error: {err}"
        )

    def arm_checks(self) -> None:
        """Check shapes again at the next call (each fit/evaluate checks its first batch)."""
        self._shapes_checked = False

    def check_shapes(self, pred: Any, label: Any) -> None:
        """Refuse what a loss would take silently or fail on obscurely (run on the first call only):
        shapes an elementwise loss would broadcast, integer labels for an elementwise loss (MSELoss
        promotes them, BCELoss fails, HuberLoss fails only in backward), class labels out of range
        (on a GPU a device-side assert that ruins the process; one host read, once per run)."""
        preds, labels = self._pair(pred, label)
        for i, (fn, p, y) in enumerate(zip(self.fns, preds, labels)):
            if not (isinstance(p, torch.Tensor) and isinstance(y, torch.Tensor)):
                continue
            if isinstance(fn, _ELEMENTWISE):
                self._check_elementwise(i, p, y)
            elif isinstance(fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and _class_indices(p, y):
                self._check_classes(i, fn.ignore_index, p, y)

    def _check_elementwise(self, i: int, pred: torch.Tensor, label: torch.Tensor) -> None:
        if pred.shape != label.shape:
            raise LossInputError(
                f"loss {i} ({self.names[i]}) compares pred and label elementwise, but pred has shape "
                f"{tuple(pred.shape)} and label {tuple(label.shape)}, which would broadcast silently; make "
                f"them equal (e.g. label.view({', '.join(str(d) for d in pred.shape)}) or squeeze the output)"
            )
        if not label.is_floating_point():
            raise LossInputError(
                f"loss {i} ({self.names[i]}) needs a floating-point label, got label {_spec(label)} (pred "
                f"{_spec(pred)}): use label.float() in a custom step, or return float labels from the Dataset "
                "(torch.tensor(y, dtype=torch.float32))"
            )

    def _check_classes(self, i: int, ignore_index: int, pred: torch.Tensor, label: torch.Tensor) -> None:
        classes = pred.shape[1]
        counted = label != ignore_index  # the labels the loss skips may be anything
        if not bool((((label < 0) | (label >= classes)) & counted).any()):
            return
        low, high = int(label[counted].min()), int(label[counted].max())  # the error path: reads are fine
        fix = (
            f"labels go up to {high} but the net outputs {classes} class scores, so labels must lie in "
            f"0..{classes - 1}: give the last layer {high + 1} outputs"
            if high >= classes
            else f"labels go down to {low}, but class indices start at 0 (only ignore_index={ignore_index} marks "
            "a label to skip): shift the labels"
        )
        raise LossInputError(
            f"loss {i} ({self.names[i]}) got class labels from {low} to {high} for pred {_spec(pred)}; {fix}"
        )

    def check_first_batch(self, total: Any) -> None:
        """The total of the first batch must be a scalar tensor."""
        if not isinstance(total, torch.Tensor) or total.dim() != 0:
            raise LossInputError(
                f"the loss must be a scalar tensor, got {_spec(total)}; use reduction='mean' or "
                "reduce the loss to a scalar"
            )


class ModelLoss:
    """``loss=None``: the loss the model computed itself, read from its output's ``loss`` (an
    attribute, as in a ``transformers`` ``ModelOutput``, or a key of a dict). The same interface as
    :class:`LossSet`, with one loss."""

    fns: tuple = (None,)  # one loss, which the model computes
    names = ("loss",)
    weights = (1.0,)
    multi = False

    def to(self, device: torch.device) -> ModelLoss:
        return self

    def arm_checks(self) -> None:
        """Nothing to check again: every call checks what it reads."""

    def __call__(self, output: Any, label: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            return loss, (loss,)
        if isinstance(output, (torch.Tensor, tuple, list)):
            raise LossInputError(
                f"Estimator(loss=None) trains on the loss the model computes itself, but the net returned "
                f"{_spec(output)}, with no loss in it: give a loss function (e.g. loss=nn.CrossEntropyLoss()), "
                "or return the loss from forward, as a dict {'loss': ..., 'logits': ...} or an object with a "
                "loss attribute"
            )
        if loss is None:
            raise LossInputError(
                f"Estimator(loss=None) trains on the loss the model computes itself, but its output "
                f"{describe(output)} has no loss: did forward get the label? It is passed under the batch's own "
                "key ('labels' or 'label'), and a Hugging Face model computes its loss only from labels=..., so "
                "put the label under 'labels'; otherwise give a loss function"
            )
        raise LossInputError(f"the model's loss must be a tensor, got {describe(loss)}")

    def check_first_batch(self, total: Any) -> None:
        """The model's loss must be a scalar tensor."""
        if not isinstance(total, torch.Tensor) or total.dim() != 0:
            raise LossInputError(f"the loss the model computed must be a scalar tensor, got {_spec(total)}")


def loss_sets(
    loss: Any, val_loss: Any, weights: Sequence[float] | None, device: torch.device
) -> tuple[LossSet | ModelLoss, LossSet | ModelLoss]:
    """The training and validation losses: ``LossSet`` objects, or ``ModelLoss`` for ``loss=None``."""
    if loss is None:
        if val_loss is not None or weights is not None:
            given = "val_loss" if val_loss is not None else "loss_weights"
            raise FitforgeValueError(
                f"loss=None trains and evaluates on the loss the model computes itself, so {given} cannot be "
                "given with it; give loss a function to use your own"
            )
        return ModelLoss(), ModelLoss()
    train = LossSet(loss, weights).to(device)
    return train, train if val_loss is None else LossSet(val_loss, weights, "val_loss").to(device)

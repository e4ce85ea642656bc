"""One or several losses matched to the net's outputs and the labels by position or by name, or the
loss a model computes itself (the rules: docs/getting-started.md, "Several outputs and losses").

``LossSet(loss, weights)`` computes the weighted total and each part; ``ModelLoss`` (``loss=None``)
reads the ``loss`` of the model's output. Each loss is known by its output's *key*: its position (an
int) or its name (a str). A loss that fails on its inputs is re-raised as a
:class:`~fitforge.exceptions.LossInputError` with a fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, LossInputError, describe
from fitforge.losses.hints import (
    CLASSIFIERS,
    ELEMENTWISE,
    class_indices,
    elementwise_fix,
    hint,
    labelless,
    not_a_tensor,
    quoted,
    sequence_fix,
    sequence_scores,
    spec,
    tensors,
)

OutputKey = int | str  # an output's position, or its name in a dict of outputs


def _name(fn: Callable) -> str:
    return type(fn).__name__ if isinstance(fn, nn.Module) else getattr(fn, "__name__", type(fn).__name__)


def part_keys(keys: Sequence[OutputKey]) -> tuple[str, ...]:
    """The history names of each loss of ``keys``: ``loss_0``, ``loss_1``... by position, ``cls_loss``
    by name; none for a single loss by position, whose mean is the loss itself."""
    if tuple(keys) == (0,):
        return ()
    return tuple(f"{key}_loss" if isinstance(key, str) else f"loss_{key}" for key in keys)


def check_output_names(given: Iterable[Any], keys: Sequence[OutputKey], argument: str, fix: str) -> None:
    """Every name in ``given`` (``argument``'s keys) must be one of the loss's output ``keys``."""
    unknown = [key for key in given if key not in keys]
    if unknown:
        raise FitforgeValueError(
            f"{argument} names the output(s) {quoted(unknown)}, which loss does not: its outputs are "
            f"{quoted(keys)}; {fix}"
        )


def _check_weights(weights: Any, keys: tuple[OutputKey, ...], named: bool) -> list[float]:
    """One weight per loss: a list by position, or a dict by output name (a name left out weighs 1)."""
    if weights is None:
        return [1.0] * len(keys)
    if named:
        if not isinstance(weights, Mapping) or not all(_number(w) for w in weights.values()):
            raise FitforgeTypeError(
                f"loss_weights must be a dict of numbers by output name, as loss is (its outputs: {quoted(keys)}), "
                f"got {describe(weights)}; e.g. {{{keys[0]!r}: 1.0}}"
            )
        check_output_names(weights, keys, "loss_weights", "weigh those outputs (a name left out weighs 1.0)")
        return [float(weights.get(key, 1.0)) for key in keys]
    if isinstance(weights, Mapping):
        raise FitforgeTypeError(
            f"loss_weights is a dict ({describe(weights)}), which weighs outputs by name, but loss matches them by "
            "position: give a list with one weight per loss, or give loss as a dict by output name too"
        )
    if not isinstance(weights, (list, tuple)) or not all(_number(w) for w in weights):
        raise FitforgeTypeError(f"loss_weights must be a list of numbers, one per loss, got {describe(weights)}")
    if len(weights) != len(keys):
        raise FitforgeValueError(
            f"loss_weights has {len(weights)} weight(s) but {len(keys)} loss(es) are configured; give one per loss"
        )
    return [float(w) for w in weights]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class LossSet:
    """The configured loss(es) with their weights.

    Attributes:
        keys: the output each loss reads, by position (``(0, 1)``) or by name (``("cls", "reg")``).
        named: whether ``loss`` was a dict by output name.
    """

    def __init__(
        self, loss: Any, weights: Sequence[float] | Mapping[str, float] | None = None, argument: str = "loss"
    ) -> None:
        self.named = isinstance(loss, Mapping)
        if self.named:
            bad = [k for k in loss if not isinstance(k, str) or not k]
            if bad:
                raise FitforgeTypeError(
                    f"{argument} as a dict is keyed by the names of the net's outputs (non-empty strs), got the "
                    f"key(s) {quoted(bad)}; to match outputs by position, give a list of losses"
                )
        fns = list(loss.values()) if self.named else list(loss) if isinstance(loss, (list, tuple)) else [loss]
        if not fns:
            raise FitforgeValueError(
                f"{argument} is an empty {'dict' if self.named else 'list'}; give at least one loss"
            )
        for fn in fns:
            if isinstance(fn, type):
                raise FitforgeTypeError(f"{argument} got {describe(fn)}; pass an instance: {fn.__name__}()")
            if not callable(fn):
                raise FitforgeTypeError(
                    f"{argument} must be a loss module or a callable (pred, label) -> scalar tensor, "
                    f"or a list of them, or a dict of them by output name, got {describe(fn)}"
                )
        self.keys: tuple[OutputKey, ...] = tuple(loss) if self.named else tuple(range(len(fns)))
        self.fns = fns
        self.weights = _check_weights(weights, self.keys, self.named)
        self.multi = self.named or isinstance(loss, (list, tuple))
        self._single_unweighted = not self.multi and self.weights == [1.0]  # one unweighted loss: the fast path
        self.names = [_name(fn) for fn in fns]
        self._shapes_checked = False

    def _which(self, i: int) -> str:
        """Loss ``i`` in messages: ``loss 0 (MSELoss)``, or ``loss 'reg' (MSELoss)`` by name."""
        return f"loss {self.keys[i]!r} ({self.names[i]})"

    def to(self, device: torch.device) -> LossSet:
        for fn in self.fns:
            if isinstance(fn, nn.Module):
                fn.to(device)
        return self

    def _pair(self, pred: Any, label: Any) -> tuple[Sequence, Sequence]:
        if self.named:
            return self._by_name(pred, "the net's output"), self._by_name(label, "the batch's label")
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

    def _by_name(self, value: Any, what: str) -> list:
        """The items of ``value`` (the net's output or the label) under the loss's names, in order."""
        if isinstance(value, Mapping):
            missing = [key for key in self.keys if key not in value]
            if not missing:
                return [value[key] for key in self.keys]
            raise LossInputError(
                f"loss names the output(s) {quoted(missing)}, which {what} lacks: its keys are {quoted(value)}; "
                "name the losses (and loss_weights, metrics) after the keys the net returns and the label holds"
            )
        example = ", ".join(f"{k!r}: y_{k}" for k in self.keys[:2])
        fix = "return a dict of outputs from forward" if what == "the net's output" else f"make it (x, {{{example}}})"
        raise LossInputError(
            f"loss is a dict by output name ({quoted(self.keys)}), so {what} must be a dict holding those names, "
            f"got {spec(value)}: {fix}; or give loss as a list, to match outputs by position"
        )

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
                raise LossInputError(
                    f"output {self.keys[i]!r} of the net is {describe(p)}, not a tensor; {not_a_tensor(p)}"
                )
        parts = [self._call(i, p, y) for i, (p, y) in enumerate(zip(preds, labels))]
        if len(parts) == 1 and self.weights[0] == 1.0 and not self.named:
            return parts[0], (parts[0],)
        total = cast(torch.Tensor, sum(w * v for w, v in zip(self.weights, parts)))  # 0 + tensors: a tensor
        return total, tuple(parts)

    def _first_call(self, pred: Any, label: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The first call of a run: the label's presence and shapes checked before, the values' type after."""
        if label is None:
            raise LossInputError(labelless(self.names))
        self.check_shapes(pred, label)
        self._shapes_checked = True
        total, parts = self(pred, label)
        for i, part in enumerate(parts):
            if not isinstance(part, torch.Tensor):
                raise LossInputError(
                    f"{self._which(i)} returned {describe(part)}, not a tensor: a loss must be "
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
        fn = self.fns[i]
        if isinstance(fn, CLASSIFIERS) and tensors(pred, label) and class_indices(pred, label):
            try:  # torch's own bounds check (on the CPU) raised: the same explanation as the check's
                self._check_classes(i, fn.ignore_index, pred, label)
            except LossInputError as explained:
                return explained
        return LossInputError(
            f"{self._which(i)} failed on pred {spec(pred)} and label {spec(label)}"
            f"{hint(self.fns[i], pred, label)}. Original error: {err}"
        )

    def arm_checks(self) -> None:
        """Check shapes again at the next call (each fit/evaluate checks its first batch)."""
        self._shapes_checked = False

    def check_shapes(self, pred: Any, label: Any) -> None:
        """Refuse what a loss would take silently or fail on obscurely (on the first call only):
        shapes an elementwise loss would broadcast, integer labels for an elementwise loss (MSELoss
        promotes them, HuberLoss fails only in backward), class labels out of range (on a GPU a
        device-side assert that ruins the process; one host read). On the CPU torch's own losses
        raise on those, which ``_failure`` explains the same way: no read there."""
        preds, labels = self._pair(pred, label)
        for i, (fn, p, y) in enumerate(zip(self.fns, preds, labels)):
            if not tensors(p, y):
                continue
            if isinstance(fn, ELEMENTWISE):
                self._check_elementwise(i, p, y)
            elif isinstance(fn, CLASSIFIERS) and class_indices(p, y):
                if type(fn) in CLASSIFIERS and y.device.type == "cpu":
                    continue  # torch's loss raises on a label out of range (a subclass may not)
                self._check_classes(i, fn.ignore_index, p, y)
            elif isinstance(fn, CLASSIFIERS) and sequence_scores(p, y):
                raise LossInputError(sequence_fix(self._which(i), fn, p, y))

    def _check_elementwise(self, i: int, pred: torch.Tensor, label: torch.Tensor) -> None:
        if pred.shape != label.shape:
            raise LossInputError(
                f"{self._which(i)} compares pred and label elementwise, but pred has shape "
                f"{tuple(pred.shape)} and label {tuple(label.shape)}, which would broadcast silently; "
                f"{elementwise_fix(pred, label)}"
            )
        if not label.is_floating_point():
            raise LossInputError(
                f"{self._which(i)} needs a floating-point label, got label {spec(label)} (pred "
                f"{spec(pred)}): use label.float() in a custom step, or return float labels from the Dataset "
                "(torch.tensor(y, dtype=torch.float32))"
            )

    def _check_classes(self, i: int, ignore_index: int, pred: torch.Tensor, label: torch.Tensor) -> None:
        classes = pred.shape[1]
        # The usual case, at every fit, in two torch calls and one read: labels in 0..C-1 floor-divide
        # to 0, below 0 to -1 or less, from C up to 1 or more.
        if classes > 0 and not bool((label // classes).any()):
            return
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
        raise LossInputError(f"{self._which(i)} got class labels from {low} to {high} for pred {spec(pred)}; {fix}")

    def check_first_batch(self, total: Any) -> None:
        """The total of the first batch must be a scalar tensor."""
        if not isinstance(total, torch.Tensor) or total.dim() != 0:
            raise LossInputError(
                f"the loss must be a scalar tensor, got {spec(total)}; use reduction='mean' or "
                "reduce the loss to a scalar"
            )


class ModelLoss:
    """``loss=None``: the model's own loss, its output's ``loss`` (an attribute, as in a
    ``ModelOutput``, or a key of a dict); :class:`LossSet`'s interface, with one loss."""

    fns: tuple = (None,)  # one loss, which the model computes
    keys: tuple[OutputKey, ...] = (0,)
    named = False
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
                f"{spec(output)}, with no loss in it: give a loss function (e.g. loss=nn.CrossEntropyLoss()), "
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
            raise LossInputError(f"the loss the model computed must be a scalar tensor, got {spec(total)}")


@dataclass(frozen=True)
class Losses:
    """An estimator's resolved losses (``estimator.losses``): ``train``, fit's, and ``validate``, evaluate's
    (``val_loss``, else the same): each a ``LossSet``, or a ``ModelLoss`` for ``loss=None``."""

    train: LossSet | ModelLoss
    validate: LossSet | ModelLoss

    def of(self, phase: str) -> LossSet | ModelLoss:
        """The loss of ``phase``: ``"validate"``'s, else training's."""
        return self.validate if phase == "validate" else self.train


def loss_sets(
    loss: Any, val_loss: Any, weights: Sequence[float] | Mapping[str, float] | None, device: torch.device
) -> Losses:
    """The training and validation losses: ``LossSet`` objects, or ``ModelLoss`` for ``loss=None``.
    ``val_loss``, when given, matches outputs as ``loss`` does: both dicts by output name, or neither."""
    if loss is None:
        if val_loss is not None or weights is not None:
            given = "val_loss" if val_loss is not None else "loss_weights"
            raise FitforgeValueError(
                f"loss=None trains and evaluates on the loss the model computes itself, so {given} cannot be "
                "given with it; give loss a function to use your own"
            )
        return Losses(ModelLoss(), ModelLoss())
    if val_loss is not None and isinstance(val_loss, Mapping) != isinstance(loss, Mapping):
        raise FitforgeTypeError(
            f"loss and val_loss must match outputs alike, by name (both dicts) or by position (neither), got "
            f"loss {describe(loss)} and val_loss {describe(val_loss)}"
        )
    train = LossSet(loss, weights).to(device)
    return Losses(train, train if val_loss is None else LossSet(val_loss, weights, "val_loss").to(device))

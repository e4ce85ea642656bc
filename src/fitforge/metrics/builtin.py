"""Built-in on-device metrics: loss mean, accuracy, top-k, binary accuracy, MSE/RMSE/MAE."""

from __future__ import annotations

import torch

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.metrics.base import SumCountMetric


def is_builtin(metric: object) -> bool:
    """Whether ``metric`` is one of these classes exactly (not a subclass of one)."""
    return type(metric).__module__ == __name__


# Dtypes every operation of the built-in metrics takes on these devices (not uint16-64, float8, quantized...).
_PLAIN_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool}
    | {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
)
_PLAIN_DEVICES = frozenset(("cpu", "cuda", "meta"))


def takes_batch(metric: SumCountMetric, pred: object, label: object) -> bool:
    """The class's ``_takes`` for a built-in ``metric``, but False where only running ``batch_stats`` can
    tell (two devices, another backend, sparse tensors, unusual dtypes). Reads metadata only."""
    if not (
        type(pred) is torch.Tensor
        and type(label) is torch.Tensor
        and pred.dtype in _PLAIN_DTYPES
        and label.dtype in _PLAIN_DTYPES
        and pred.device == label.device
        and pred.device.type in _PLAIN_DEVICES
        and pred.layout == label.layout == torch.strided
        and not (pred.is_nested or label.is_nested)
    ):
        return False
    return metric._takes(pred, label)


def _compares(value: object) -> bool:
    """Whether torch compares a tensor of any dtype with ``value``: None, a float, or an int within int64."""
    if value is None or type(value) is float:
        return True
    return type(value) is int and -(2**63) <= value < 2**63


def _same_shape(metric: SumCountMetric, pred: torch.Tensor, label: torch.Tensor) -> None:
    if pred.shape != label.shape:
        raise FitforgeValueError(
            f"{metric.name}: pred shape {tuple(pred.shape)} must equal label shape {tuple(label.shape)}"
        )


class Mean(SumCountMetric):
    """Sample-weighted running mean of a per-batch scalar (the loss): ``update(value, weight)``."""

    name = "mean"
    higher_is_better = False

    def update(self, value: torch.Tensor, weight: int = 1) -> None:  # type: ignore[override]
        self._accumulate(value.detach() if value.requires_grad else value, weight, weight)


class Accuracy(SumCountMetric):
    """Fraction of correct class predictions.

    ``pred`` is scores (N, C, ...) compared by argmax over dim 1 with class labels (N, ...) or one-hot
    labels of its shape, or class indices of the label's shape; elementwise over extra dims.

    Args:
        ignore_index: a class-index label left out of the count, e.g. sequence padding (the default
            metric of a ``CrossEntropyLoss``/``NLLLoss`` takes the loss's).
    """

    name = "accuracy"
    higher_is_better = True

    def __init__(self, ignore_index: int | None = None) -> None:
        super().__init__()
        if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
            raise FitforgeTypeError(f"Accuracy: ignore_index must be an int label value or None, got {ignore_index!r}")
        self.ignore_index = ignore_index
        self._kind: str | None = None  # "scores", "one-hot" or "indices": checked on the first batch

    def reset(self) -> None:
        super().reset()
        self._kind = None

    def update(self, pred: torch.Tensor, label: torch.Tensor) -> None:
        # No detach: argmax and comparisons record no autograd graph.
        total, count = self.batch_stats(pred, label)
        self._accumulate(total, count)

    def batch_stats(self, pred, label):
        kind = self._kind
        if kind is None:  # the shapes are checked on the first batch after each reset, not every batch
            kind, self._mask_correct = self._kind_of(pred, label)
            self._kind = kind
        if kind == "one-hot":  # one-hot (any dtype) or probability labels: nothing to ignore
            return (pred.argmax(dim=1) == label.argmax(dim=1)).sum(), label.numel() // label.shape[1]
        if kind == "scores":
            pred = pred.argmax(dim=1)
        if self.ignore_index is None:
            return (pred == label).sum(), label.numel()
        kept = label != self.ignore_index
        correct = pred == label
        if self._mask_correct:
            correct &= kept
        return correct.sum(), kept.sum()

    def _takes(self, pred: torch.Tensor, label: torch.Tensor) -> bool:
        if (pred.dim() >= 2 and pred.shape[1] == 0) or not _compares(self.ignore_index):
            return False  # no class to take the argmax of; an ignore_index torch cannot compare
        kind, _ = self._kind_of(pred, label)
        return not (kind == "one-hot" and label.dtype is torch.bool)  # argmax of bool labels is not implemented

    def _kind_of(self, pred: torch.Tensor, label: torch.Tensor) -> tuple[str, bool]:
        """The batch's kind ("scores", "one-hot", "indices") and whether ``ignore_index`` must mask it."""
        kind, classes = "indices", None
        if pred.is_floating_point():  # scores: the class is their argmax over dim 1
            if pred.dim() < 2 or pred.shape[1] == 1:
                raise FitforgeValueError(
                    f"{self.name}: pred of shape {tuple(pred.shape)} has one score per sample, so there is no "
                    "class axis to take the argmax of; for a binary output use the 'binary_accuracy' metric"
                )
            if pred.shape == label.shape:
                return "one-hot", False
            kind, classes = "scores", pred.shape[1]
        compared = pred.shape[:1] + pred.shape[2:] if kind == "scores" else pred.shape
        if compared != label.shape:
            raise FitforgeValueError(
                f"{self.name}: pred of shape {tuple(compared)} (after argmax over dim 1) does not match "
                f"label of shape {tuple(label.shape)}; pass scores (N, C, ...) and class labels (N, ...)"
            )
        # An ignore_index no class can equal (such as -100) never matches a prediction: no mask needed.
        return kind, classes is None or (self.ignore_index is not None and 0 <= self.ignore_index < classes)

    def __repr__(self) -> str:
        return "Accuracy()" if self.ignore_index is None else f"Accuracy(ignore_index={self.ignore_index})"


class TopKAccuracy(SumCountMetric):
    """Fraction of samples whose label is among the ``k`` highest scores (pred (N, C), label (N,))."""

    higher_is_better = True

    def __init__(self, k: int = 5) -> None:
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise FitforgeValueError(f"k must be a positive int, got {k!r}")
        self.k = k
        self.name = f"top{k}_accuracy"

    def batch_stats(self, pred, label):
        self._check(pred, label)
        topk = pred.topk(self.k, dim=1).indices
        return (topk == label.unsqueeze(1)).any(dim=1).sum(), label.numel()

    def _takes(self, pred: torch.Tensor, label: torch.Tensor) -> bool:
        if not pred.is_floating_point():
            return False  # topk of bool scores is not implemented
        self._check(pred, label)
        return True

    def _check(self, pred: torch.Tensor, label: torch.Tensor) -> None:
        if pred.dim() < 2 or pred.shape[1] < self.k:
            raise FitforgeValueError(
                f"{self.name}: needs scores of shape (N, C) with C >= {self.k}, got {tuple(pred.shape)}"
            )
        expected = (pred.shape[0], *pred.shape[2:])
        if tuple(label.shape) != expected:
            raise FitforgeValueError(
                f"{self.name}: label shape {tuple(label.shape)} does not fit scores of shape "
                f"{tuple(pred.shape)}; expected class labels of shape {expected}"
            )

    def __repr__(self) -> str:
        return f"TopKAccuracy(k={self.k})"


class BinaryAccuracy(SumCountMetric):
    """Fraction of correct binary predictions: ``pred > threshold`` (after a sigmoid with ``logits``)."""

    name = "binary_accuracy"
    higher_is_better = True

    def __init__(self, threshold: float = 0.5, logits: bool = False) -> None:
        super().__init__()
        self.threshold = threshold
        self.logits = logits

    def batch_stats(self, pred, label):
        _same_shape(self, pred, label)
        prob = pred.sigmoid() if self.logits else pred
        return ((prob > self.threshold) == (label > 0.5)).sum(), label.numel()

    def _takes(self, pred: torch.Tensor, label: torch.Tensor) -> bool:
        if (self.logits and not pred.is_floating_point()) or self.threshold is None or not _compares(self.threshold):
            return False  # sigmoid of integer logits is not implemented; a threshold must compare
        _same_shape(self, pred, label)
        return True

    def __repr__(self) -> str:
        return f"BinaryAccuracy(threshold={self.threshold}, logits={self.logits})"


class _Elementwise(SumCountMetric):
    higher_is_better = False

    def batch_stats(self, pred, label):
        _same_shape(self, pred, label)
        return self.error(pred.float() - label.float()).sum(), label.numel()

    def _takes(self, pred: torch.Tensor, label: torch.Tensor) -> bool:
        _same_shape(self, pred, label)
        return True


class MeanSquaredError(_Elementwise):
    """Mean of squared differences over all elements."""

    name = "mse"

    @staticmethod
    def error(diff):
        return diff.square()


class RootMeanSquaredError(MeanSquaredError):
    """Square root of the mean squared error over the epoch (not a mean of batch RMSEs)."""

    name = "rmse"

    def finish(self, mean):
        return mean.sqrt()


class MeanAbsoluteError(_Elementwise):
    """Mean of absolute differences over all elements."""

    name = "mae"

    @staticmethod
    def error(diff):
        return diff.abs()

"""What a loss's inputs that do not fit it mean, and how to fix them: the messages of
:class:`fitforge.losses.loss.LossSet` and :class:`~fitforge.losses.loss.ModelLoss`, and the shape tests
they rest on."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fitforge.exceptions import describe

ELEMENTWISE = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss)
CLASSIFIERS = (nn.CrossEntropyLoss, nn.NLLLoss)


def spec(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} {dtype_name(value.dtype)}"
    return describe(value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hint(fn: Callable, pred: Any, label: Any) -> str:
    if isinstance(label, Mapping):
        return (
            f"; the label is a dict (keys: {quoted(label)}): to give each output its own loss by name, pass loss "
            "as a dict by the same names and return a dict of outputs from forward"
        )
    if not tensors(pred, label):
        return ""
    classifier = isinstance(fn, CLASSIFIERS)
    classes = (pred.shape[0], *pred.shape[2:])
    indices = classifier and not label.is_floating_point() and label.shape == classes
    if indices and label.dtype not in (torch.int64, torch.uint8):  # labels beyond the classes: _failure's check
        return f"; class-index labels must be int64, got {dtype_name(label.dtype)}: use label.long()"
    if classifier and label.is_floating_point() and label.shape != pred.shape:
        return f"; class-index labels must be int64 of shape {classes}: use label.long()"
    if classifier and label.dim() == pred.dim() and label.shape[1:2] == (1,):
        return f"; class-index labels must have shape {classes}, without the class axis: use label.squeeze(1)"
    if isinstance(fn, ELEMENTWISE) and not label.is_floating_point():
        return "; this loss needs a floating-point label: use label.float()"
    return ""


def labelless(names: Sequence[str]) -> str:
    """Why a given loss cannot train on batches of data alone, and the two ways that work."""
    return (
        f"the loss {', '.join(names)} compares the net's output with a label, but the batches are data alone (a "
        "tensor, a 1-tuple (x,) as TensorDataset(X) gives, or a dict without a 'labels' or 'label' key). To "
        "reconstruct the input (an autoencoder), give it as its own label: fit((X, X), batch_size=...) "
        "(evaluate((X, X))) or DataLoader(TensorDataset(X, X), ...); for a net that computes its own loss from "
        "its inputs (a VAE, a language model), Estimator(net, loss=None) with forward returning the loss (a dict "
        "{'loss': ..., 'logits': ...} or an object with a loss attribute; the logits are what metrics and "
        "predict read). A dict batch's label goes under 'labels' (or name its key with "
        "BatchProcessor(label_key=...))"
    )


def tensors(*values: Any) -> bool:
    return all(isinstance(value, torch.Tensor) for value in values)


def class_indices(pred: torch.Tensor, label: torch.Tensor) -> bool:
    """Whether ``label`` holds class indices for scores ``pred`` of shape (N, C, ...)."""
    return (
        pred.dim() >= 2
        and not label.is_floating_point()
        and label.dtype != torch.bool
        and label.shape == (pred.shape[0], *pred.shape[2:])
    )


def sequence_scores(pred: torch.Tensor, label: torch.Tensor) -> bool:
    """Scores ``(N, T, C)`` (classes last, as a sequence model returns them) for class indices ``(N, T)``:
    the classification losses take the classes on dim 1, ``(N, C, T)``."""
    # As many positions as classes fits both readings: torch takes dim 1 as the classes, silently.
    return pred.dim() == 3 and pred.shape[1] != pred.shape[2] and class_indices(pred.transpose(1, 2), label)


def sequence_fix(which: str, fn: Callable, pred: torch.Tensor, label: torch.Tensor) -> str:
    n, steps, classes = pred.shape
    name = type(fn).__name__
    return (
        f"{which} takes the class scores on dim 1, (N, C, T), but pred has shape {tuple(pred.shape)} and the class "
        f"labels {tuple(label.shape)}: scores of {classes} classes on the last dim for {steps} positions, as a "
        f"sequence model returns them. Move the classes to dim 1 in forward, return logits.transpose(1, 2) (shape "
        f"({n}, {classes}, {steps})); or flatten both for the loss, keeping its settings: loss = nn.{name}(...), "
        f"then Estimator(net, lambda pred, label: loss(pred.reshape(-1, {classes}), label.reshape(-1)), ...)"
    )


def elementwise_fix(pred: torch.Tensor, label: torch.Tensor) -> str:
    """How to give an elementwise loss pred and label of one shape: a view, one-hot labels or a
    classification loss for class scores and indices, else the output's shape."""
    if [d for d in pred.shape if d != 1] == [d for d in label.shape if d != 1]:
        return f"make them equal (e.g. label.view({', '.join(str(d) for d in pred.shape)}) or squeeze the output)"
    if class_indices(pred, label):
        classes = pred.shape[1]
        one_hot = f"nn.functional.one_hot(label, {classes})" + (".movedim(-1, 1)" if pred.dim() > 2 else "")
        return (
            f"pred looks like scores of {classes} classes (dim 1) and label like class indices: use a "
            f"classification loss such as nn.CrossEntropyLoss, or give one-hot labels ({one_hot}.float())"
        )
    return f"the net's output must have the label's shape {tuple(label.shape)} for this loss"


def not_a_tensor(output: Any) -> str:
    """The fix for a net output a loss cannot take: a model's output object, or a forgotten return."""
    if output is None:
        return "the net must return a tensor, or a tuple of tensors for several losses (did forward() forget a return?)"
    items = list(output) if isinstance(output, Mapping) else [k for k in ("loss", "logits") if hasattr(output, k)]
    if items:
        named = (
            f", or a dict loss={{{', '.join(f'{k!r}: ...' for k in items[:2])}}} to train each output with its own loss"
            if isinstance(output, Mapping) and "loss" not in output
            else ""
        )
        return (
            f"it holds {', '.join(map(str, items))}: use Estimator(loss=None) to train on the loss the model "
            "computes itself, or BatchProcessor(output_key=...) to give this loss one of its items "
            f"(e.g. output_key='logits'){named}"
        )
    return "the net must return a tensor, or a tuple of tensors for several losses"


def quoted(keys: Iterable[Any]) -> str:
    """Keys or names for a message: ``'cls', 'reg'``."""
    return ", ".join(map(repr, keys))

"""How many items a batch's mean loss averages over, so that accumulated batches weigh as one big batch.

With a loss that is a mean over counted items (tokens that are not padding, say), the mean of
``k`` micro-batch means is not the mean over their concatenation: a short micro-batch weighs as
much as a long one. :class:`~fitforge.handlers.GradientUpdateHandler` (``accumulate > 1``) makes
them equal: the default ``fit_batch`` backpropagates ``loss * items`` (the batch's sum) and the
step divides the accumulated gradients by the window's item count (on every rank together under
DDP). The count stays on the device: no host read.

:func:`item_counter` finds the count of the losses whose denominator is known:

- ``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` with ``reduction="mean"``: the targets not equal to
  ``ignore_index``, each counted by its class ``weight`` when one is given (torch's denominator);
  for probability targets of ``CrossEntropyLoss``, every sample (and position).
- a model's own loss (``Estimator(loss=None)``) whose ``forward`` accepts ``num_items_in_batch``
  (Hugging Face models): the labels not equal to -100, after the one-token shift of a causal LM
  (``loss_type`` ``"ForCausalLM"``, or none: Hugging Face's default). The count is passed to the
  model as ``num_items_in_batch``, so its loss is its sum over them divided by that count.

Any other loss is not counted (a counter of your own: ``GradientUpdateHandler(items=...)``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_IGNORED_LABEL = -100  # Hugging Face's label of a position that has no loss


@dataclass(frozen=True)
class ItemCounter:
    """``count(inputs, label)``: the batch's item count, a 0-d tensor on the device.

    Attributes:
        count: the counting function.
        to_model: whether the count goes to the net as ``num_items_in_batch``.
    """

    count: Callable[[Any, Any], torch.Tensor]
    to_model: bool = False


def item_counter(loss: Any, net: nn.Module) -> tuple[ItemCounter | None, str]:
    """The counter of ``loss`` (the estimator's, None for the net's own) and, when there is none,
    why not (for the info line at fit start)."""
    if loss is None:
        return _model_counter(net)
    if isinstance(loss, (nn.CrossEntropyLoss, nn.NLLLoss)):
        if loss.reduction != "mean":
            return None, f"its {type(loss).__name__} has reduction={loss.reduction!r}, not a mean"
        return ItemCounter(_TargetCount(loss.ignore_index, loss.weight)), ""
    return None, f"its loss {_name(loss)} is not a mean over items fitforge can count"


class _TargetCount:
    """The denominator of a mean cross-entropy: targets not equal to ``ignore_index`` (by class
    ``weight``); every sample (and position) for probability targets."""

    def __init__(self, ignore_index: int, weight: torch.Tensor | None) -> None:
        self.ignore_index, self.weight = ignore_index, weight

    def __call__(self, inputs: Any, label: Any) -> torch.Tensor:
        if label.is_floating_point():  # class probabilities: the mean is over every sample and position
            return torch.tensor(label.numel() // label.shape[1], device=label.device, dtype=torch.float32)
        kept = label != self.ignore_index
        if self.weight is None:
            return kept.sum().to(torch.float32)
        return (self.weight.to(label.device)[label.clamp(min=0)] * kept).sum()


def _model_counter(net: nn.Module) -> tuple[ItemCounter | None, str]:
    model = getattr(net, "module", net)  # a DDP wrapper's model
    if not _accepts_items(model):
        return None, f"the net {type(model).__name__} computes its loss, and its forward takes no num_items_in_batch"
    # A Hugging Face model without a loss type of its own computes a causal LM's loss (its default).
    causal = getattr(model, "loss_type", None) in (None, "ForCausalLM") and _from_hugging_face(model)
    return ItemCounter(_causal_labels if causal else _labels, to_model=True), ""


def _from_hugging_face(model: nn.Module) -> bool:
    return hasattr(type(model), "loss_function")  # PreTrainedModel's: the loss its forward computes


def _accepts_items(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``num_items_in_batch``: by name, or (a Hugging Face model)
    through ``**kwargs`` unless the model says it passes none to its loss (``accepts_loss_kwargs``)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if "num_items_in_batch" in parameters:
        return True
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return takes_kwargs and _from_hugging_face(model) and bool(getattr(model, "accepts_loss_kwargs", True))


def _labels(inputs: Any, label: Any) -> torch.Tensor:
    return (label != _IGNORED_LABEL).sum()


def _causal_labels(inputs: Any, label: Any) -> torch.Tensor:
    return (label[..., 1:] != _IGNORED_LABEL).sum()


def _name(loss: Any) -> str:
    return type(loss).__name__ if not inspect.isfunction(loss) else loss.__name__

"""How many items a batch's mean loss averages over, so that accumulated batches weigh as one big batch
(the losses counted, and ``items=`` of your own: docs/handlers.md, "Gradient accumulation by items").
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fitforge.core.processor import BatchProcessor

log = logging.getLogger("fitforge")
_IGNORED_LABEL = -100  # Hugging Face's label of a position that has no loss
_SAID: set[str] = set()  # the reasons the info line gave in this process: each once


@dataclass(frozen=True)
class ItemCounter:
    """``count(inputs, label)``: the batch's item count, a 0-d tensor on the device;
    ``to_model``: whether the count goes to the net as ``num_items_in_batch``."""

    count: Callable[[Any, Any], torch.Tensor | None]
    to_model: bool = False


def fit_counter(items: Any, estimator: Any) -> tuple[ItemCounter | None, str]:
    """The counter a fit's default ``fit_batch`` weighs its batches with for ``GradientUpdateHandler(items=items)``:
    ``items`` of the user's, or the loss's own (``"auto"``); else None and why (empty for ``items=None``)."""
    if items is None:
        return None, ""
    counter, why = (ItemCounter(items), "") if callable(items) else item_counter(estimator.loss, estimator.net)
    if len(estimator.optimizers) > 1:
        return None, "several optimizers step"
    if type(estimator.batch_processor).fit_batch is not BatchProcessor.fit_batch:
        return None, "a fit_batch of your own runs the step (return BatchOutput(items=...) from it)"
    return counter, why


class UnweightedNote:
    """The info line saying that a fit's accumulated batches weigh alike, once per process and reason,
    when the first group's shapes (no host read) show that their counts may differ: batches of
    different shapes, or padded ones (an ``attention_mask``)."""

    def __init__(self, why: str, accumulate: int) -> None:
        self.why, self.accumulate = why, accumulate
        self._shapes: set[tuple] = set()
        self._batches = 0
        self._padded = False

    def seen(self, output: Any) -> bool:
        """Take one batch's output; True once the first group is seen (and the line said if it must be)."""
        data, label = output.data, output.label
        parts = list(data.values()) if isinstance(data, dict) else list(data)
        parts += list(label.values()) if isinstance(label, dict) else list(_as_tuple(label))
        self._shapes.add(tuple(getattr(part, "shape", None) for part in parts))
        self._padded = self._padded or (isinstance(data, dict) and "attention_mask" in data)
        self._batches += 1
        if len(self._shapes) > 1 or self._padded:
            self._say()
            return True
        return self._batches >= self.accumulate

    def _say(self) -> None:
        if self.why in _SAID:
            return
        _SAID.add(self.why)
        log.info(
            f"GradientUpdateHandler: accumulate={self.accumulate} averages its {self.accumulate} batches' losses "
            f"alike, not weighted by their items: {self.why}. To weigh them (one step then equals one on the "
            "concatenated batches), pass GradientUpdateHandler(items=lambda inputs, label: <the batch's item count, "
            "a tensor>)"
        )


def _as_tuple(label: Any) -> tuple:
    return tuple(label) if isinstance(label, (tuple, list)) else (label,)


def item_counter(loss: Any, net: nn.Module) -> tuple[ItemCounter | None, str]:
    """The counter of ``loss`` (the estimator's, None for the net's own), or None and why not."""
    if loss is None:
        return _model_counter(net)
    if isinstance(loss, (nn.CrossEntropyLoss, nn.NLLLoss)):
        if loss.reduction != "mean":
            return None, f"its {type(loss).__name__} has reduction={loss.reduction!r}, not a mean"
        return ItemCounter(_TargetCount(loss.ignore_index, loss.weight)), ""
    name = loss.__name__ if inspect.isfunction(loss) else type(loss).__name__
    return None, f"its loss {name} is not a mean over items fitforge can count"


class _TargetCount:
    """The denominator of a mean cross-entropy (torch's): targets not ignored, by class ``weight`` if given."""

    def __init__(self, ignore_index: int, weight: torch.Tensor | None) -> None:
        self.ignore_index, self.weight = ignore_index, weight

    def __call__(self, inputs: Any, label: Any) -> torch.Tensor:
        if label.is_floating_point():  # class probabilities: the mean is over every sample and position
            return torch.tensor(label.numel() // label.shape[1], device=label.device, dtype=torch.float32)
        kept = label != self.ignore_index
        if self.weight is None:
            return kept.sum().to(torch.float32)
        classes = label.masked_fill(~kept, 0)  # ignore_index may be any value, 255 or -100
        return (self.weight.to(label.device)[classes] * kept).sum()


def _model_counter(model: nn.Module) -> tuple[ItemCounter | None, str]:
    name = type(model).__name__
    if hasattr(type(model), "loss_function"):  # PreTrainedModel's: the loss its forward computes
        return _hugging_face_counter(model)
    try:
        named = "num_items_in_batch" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        named = False
    if not named:
        return None, f"the net {name} computes its loss, and its forward takes no num_items_in_batch"
    return ItemCounter(_labels, to_model=True), ""


def _hugging_face_counter(model: nn.Module) -> tuple[ItemCounter | None, str]:
    """A Hugging Face model's counter: its loss type's function must divide by ``num_items_in_batch``."""
    name = type(model).__name__
    if "_loss_function" in vars(model) or getattr(model, "accepts_loss_kwargs", True) is False:
        return None, f"the net {name} computes its loss with a function of its own"
    parameters = inspect.signature(model.forward).parameters
    if "num_items_in_batch" not in parameters and all(p.kind is not p.VAR_KEYWORD for p in parameters.values()):
        return None, f"the net {name}'s forward takes no num_items_in_batch"
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return None, f"the net {name}'s loss functions could not be imported from transformers"
    loss_type = getattr(model, "loss_type", None)
    function: Any = LOSS_MAPPING.get(loss_type if loss_type in LOSS_MAPPING else "ForCausalLM")
    if function is None or "num_items_in_batch" not in inspect.signature(function).parameters:
        return None, f"the net {name}'s loss ({loss_type}) does not divide by num_items_in_batch"
    return ItemCounter(_causal_labels if function is ForCausalLMLoss else _labels, to_model=True), ""


def _labels(inputs: Any, label: Any) -> torch.Tensor | None:
    return (label != _IGNORED_LABEL).sum() if isinstance(label, torch.Tensor) else None


def _causal_labels(inputs: Any, label: Any) -> torch.Tensor | None:
    if not isinstance(label, torch.Tensor) or label.dim() < 2:
        return None
    return (label[..., 1:] != _IGNORED_LABEL).sum()

"""What fit, evaluate and predict read: an iterable of batches, re-iterable where read again, not empty."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.utils.data

from fitforge.core.batches import is_array
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe


def _data_hint(data: object, argument: str) -> str:
    if isinstance(data, int) and argument == "val_data":
        return f"; did you mean epochs={data}? fit's second positional argument is val_data"
    if isinstance(data, torch.utils.data.Dataset):
        return "; wrap the dataset: DataLoader(dataset, batch_size=...)"
    if is_array(data):  # a tensor or a NumPy array: iterable by rows, which are no batches
        return (
            "; fit, evaluate and predict take whole arrays of one row per sample, with their labels as one "
            "tuple, fit((X, y), batch_size=32), or alone, fit(X, batch_size=32), for a net that computes its "
            "own loss; anywhere else pass batches, DataLoader(TensorDataset(X, y), batch_size=...)"
        )
    return ""


def _looks_like_inputs_and_labels(data: object) -> bool:
    """``(X, Y)``: two tensors with one row per sample each, given where batches were expected."""
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        return False
    x, y = data
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() > 0 and y.shape[:1] == x.shape[:1]


def _length(data: object, argument: str) -> int | None:
    """``len(data)``, None for data without one (an IterableDataset's loader); an error for 0."""
    try:
        size = len(data)  # type: ignore[arg-type]
    except TypeError:
        return None
    if size == 0:
        raise FitforgeValueError(f"{argument} is empty (len 0): it must yield at least one batch")
    return size


def check_data(data: object, argument: str, passes: int | None) -> int | None:
    """Check ``data`` is batches usable for ``passes`` passes (None: unknown); return ``len(data)`` or None."""
    if type(data) is torch.utils.data.DataLoader:  # the usual case, checked every fit: re-iterable, no (X, Y)
        return _length(data, argument)
    if isinstance(data, (torch.Tensor, Mapping, str, bytes)) or is_array(data) or not isinstance(data, Iterable):
        raise FitforgeTypeError(
            f"{argument} must be an iterable of (data, label) batches such as a DataLoader or a list, "
            f"got {describe(data)}{_data_hint(data, argument)}"
        )
    if isinstance(data, Iterator) and passes != 1:
        raise FitforgeValueError(
            f"{argument} is a one-shot iterator ({type(data).__name__}), which is exhausted after one "
            f"pass, but it {'may be read more than once' if passes is None else f'would be read {passes} times'}; "
            "pass a re-iterable such as a DataLoader or a list"
        )
    size = _length(data, argument)
    if argument != "data" and _looks_like_inputs_and_labels(data):
        # fit and evaluate take (data, label) batches; predict ("data") also takes bare tensors
        raise FitforgeTypeError(
            f"{argument} is a {type(data).__name__} of {size} tensor(s), not of (data, label) batches: "
            "pass (X, Y) as batches, e.g. DataLoader(TensorDataset(X, Y), batch_size=...) or [(X, Y)] "
            "for one batch"
        )
    return size

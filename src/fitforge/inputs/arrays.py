"""Whole arrays as data, as scikit-learn and Keras take them: ``fit((X, y), batch_size=32)`` becomes a
``DataLoader`` over their rows (the rules: docs/getting-started.md, "Whole arrays"); a stream,
``fit(iterable_dataset, batch_size=32)``, one over its samples (docs/data-at-scale.md)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from fitforge.core.batches import is_array
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

DEFAULT_BATCH_SIZE = 32


def _rows(item: object) -> bool:
    return is_array(item) and len(item.shape) > 0  # type: ignore[attr-defined]


def _label_arrays(label: object) -> bool:
    """An array, or several as a tuple/list (outputs by position) or a dict (outputs by name)."""
    if isinstance(label, Mapping):
        return bool(label) and all(isinstance(k, str) and _rows(v) for k, v in label.items())
    if isinstance(label, (tuple, list)):
        return bool(label) and all(_rows(item) for item in label)
    return _rows(label)


def is_arrays(data: object) -> bool:
    """Whether ``data`` is ``(X, y)`` rather than batches (``y`` one array, or several in a tuple or dict)."""
    return isinstance(data, (tuple, list)) and len(data) == 2 and _rows(data[0]) and _label_arrays(data[1])


def _flat(data: Any) -> tuple[list[Any], Callable[[Sequence[Any]], Any]]:
    """``(X, y)``'s arrays in a flat list, and the function that puts such a list back into ``(X, y)``'s shape."""
    if _rows(data):
        return [data], lambda items: items[0]
    if not is_arrays(data) or _rows(data[1]):  # plain arrays: a flat tuple already
        return list(data), tuple
    x, label = data
    if isinstance(label, Mapping):
        keys = list(label)
        return [x, *label.values()], lambda items: (items[0], dict(zip(keys, items[1:])))
    return [x, *label], lambda items: (items[0], tuple(items[1:]))


class LabelledArrays(Dataset):
    """The rows of ``X`` with those of several label arrays: ``(x, (y1, y2))`` or ``(x, {"cls": y1, ...})``."""

    def __init__(self, tensors: Sequence[torch.Tensor], shape: Callable[[Sequence[Any]], Any]) -> None:
        self.tensors, self.shape = tensors, shape

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> Any:
        return self.shape([t[index] for t in self.tensors])


def _from_pandas(item: Any, argument: str, name: str) -> Any:
    """A pandas DataFrame or Series as one NumPy array of its numeric columns; anything else as it is."""
    if not hasattr(item, "to_numpy") or all(kind.__module__.split(".")[0] != "pandas" for kind in type(item).__mro__):
        return item
    columns = item.dtypes.items() if hasattr(item, "columns") else [(getattr(item, "name", None) or name, item.dtype)]
    # (column, dtype, its NumPy dtype): a nullable column's (Int64, boolean, Float32) differs from its dtype
    typed = [(column, dtype, getattr(dtype, "numpy_dtype", dtype)) for column, dtype in columns]
    other = [(column, dtype) for column, dtype, plain in typed if getattr(plain, "kind", "O") not in "biuf"]
    if other:
        shown = ", ".join(f"{column!r} ({dtype})" for column, dtype in other)
        raise FitforgeTypeError(
            f"{argument}: {name} has columns that are not numbers: {shown}; encode them first "
            "(pandas.get_dummies(df, columns=[...]) for categories, .astype('category').cat.codes for labels) or "
            "drop them"
        )
    missing = [column for column, dtype, plain in typed if dtype is not plain]  # nullable: pd.NA is no number
    if missing and bool(item.isna().to_numpy().any()):
        raise FitforgeValueError(
            f"{argument}: {name} has missing values (NA) in its nullable columns {missing}; fill them "
            "(df.fillna(...)) or drop those rows first"
        )
    # One type for mixed columns (float, int, bool: float), as NumPy promotes them.
    return item.to_numpy(dtype=numpy.result_type(*(plain for _, _, plain in typed)), copy=True)


def from_pandas(data: Any, argument: str) -> Any:
    """``data`` with its pandas DataFrames and Series (``X``, ``y``, several ``y``) as NumPy arrays."""
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        return _from_pandas(data, argument, "X")
    x, label = data
    if isinstance(label, Mapping):
        label = {key: _from_pandas(value, argument, f"y[{key!r}]") for key, value in label.items()}
    elif isinstance(label, (tuple, list)):
        label = type(label)(_from_pandas(value, argument, f"y[{i}]") for i, value in enumerate(label))
    else:
        label = _from_pandas(label, argument, "y")
    pair = (_from_pandas(x, argument, "X"), label)
    return list(pair) if isinstance(data, list) else pair


def _tensor(item: Any, argument: str, name: str) -> torch.Tensor:
    if isinstance(item, torch.Tensor):
        return item
    try:
        tensor = torch.as_tensor(item)  # shares NumPy's memory where it can
    except TypeError as error:  # object or str dtype (pandas' strings), float128...
        raise FitforgeTypeError(_untakeable(item, argument, name)) from error
    if tensor.is_floating_point():
        return tensor.to(torch.get_default_dtype())
    if tensor.dim() == 1 and tensor.dtype not in (torch.bool, torch.int64) and not tensor.is_complex():
        return tensor.long()  # one integer per sample: class labels, which the losses take as int64
    return tensor


def _untakeable(item: Any, argument: str, name: str) -> str:
    """Why torch refused the array ``name`` of ``argument``, and the conversion that fixes it."""
    dtype = getattr(item, "dtype", None)
    try:
        first = next(iter(item), None)
    except TypeError:
        first = None
    text = getattr(dtype, "kind", "") in ("U", "S") or isinstance(first, (str, bytes))
    if name == "X":
        fix = (
            "encode the text as numbers first (a tokenizer, or one-hot columns)" if text else "X.astype(numpy.float32)"
        )
    elif text:  # class names
        fix = f"number the class names: classes, codes = numpy.unique({name}, return_inverse=True), and pass codes"
    else:
        fix = f"{name}.astype(numpy.int64) for class indices, {name}.astype(numpy.float32) for values"
    return (
        f"{argument}: {name} has dtype {dtype}, which torch cannot take (it takes bool, integer, float16/32/64 "
        f"and complex arrays); convert it first: {fix}"
    )


def _names(count: int, label: Any = None) -> list[str]:
    """The names in messages of ``(X, y)``'s ``count`` flat arrays: X, y, or y[0], y['cls'] for several."""
    if isinstance(label, Mapping):
        return ["X", *(f"y[{key!r}]" for key in label)]
    if isinstance(label, (tuple, list)):
        return ["X", *(f"y[{i}]" for i in range(len(label)))]
    return ["X", "y", *(f"array {i}" for i in range(2, count))][:count]


def _tensors(data: Any, argument: str, names: Sequence[str] | None = None) -> tuple[torch.Tensor, ...]:
    names = names or _names(len(data))
    tensors = tuple(_tensor(item, argument, name) for item, name in zip(data, names))
    lengths = [len(t) for t in tensors]
    if len(set(lengths)) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise FitforgeValueError(
            f"{argument}: the arrays must have one row per sample each, but their lengths differ: shapes {shapes}"
        )
    if not lengths[0]:
        raise FitforgeValueError(f"{argument}: the arrays are empty (0 samples)")
    return tensors


def check_batch_size(batch_size: Any) -> int:
    if batch_size is None:
        return DEFAULT_BATCH_SIZE
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):  # NumPy's ints too
        raise FitforgeTypeError(f"batch_size must be a positive int, got {describe(batch_size)}")
    if batch_size < 1:
        raise FitforgeValueError(f"batch_size must be a positive int, got {batch_size}")
    return int(batch_size)


def array_loader(data: Any, batch_size: int, shuffle: bool, argument: str, bare: bool = False) -> DataLoader:
    """A DataLoader of ``(X, y)``'s rows (``X`` alone: batches ``[x]``, or bare tensors with ``bare``)."""
    if is_arrays(data) and not _rows(data[1]):
        flat, shape = _flat(data)
        dataset: Any = LabelledArrays(_tensors(flat, argument, _names(len(flat), data[1])), shape)
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)
    tensors = _tensors(data if isinstance(data, (tuple, list)) else (data,), argument)
    if bare:  # predict(X): each batch a bare tensor, not a 1-tuple
        return DataLoader(tensors[0], batch_size=batch_size, shuffle=shuffle)  # type: ignore[arg-type]
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=shuffle)


def split_off(data: Any, fraction: Any) -> tuple[Any, Any]:
    """``(first part, last fraction)`` of the arrays ``data``, for ``validation_split``."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise FitforgeValueError(
            f"validation_split must be a fraction between 0 and 1 (e.g. 0.2), got {describe(fraction)}"
        )
    flat, shape = _flat(data)
    tensors = _tensors(flat, "train_data", _names(len(flat), None if _rows(data) else data[1]))
    size = len(tensors[0])
    held = math.floor(size * fraction)
    if held == 0 or held == size:
        raise FitforgeValueError(
            f"validation_split={fraction} of {size} samples leaves {'no validation' if held == 0 else 'no training'} "
            "sample; use more samples or another fraction"
        )
    return shape([t[: size - held] for t in tensors]), shape([t[size - held :] for t in tensors])


def fit_loaders(train_data: Any, val_data: Any, batch_size: Any, validation_split: Any) -> tuple[Any, Any]:
    """fit's ``(train_data, val_data)``, arrays made into DataLoaders (other data returned as it is)."""
    train_data, val_data = from_pandas(train_data, "train_data"), from_pandas(val_data, "val_data")
    # Keras's fit(X, y): two arrays of as many rows, the second landing in val_data
    if _rows(train_data) and _rows(val_data) and train_data.shape[0] == val_data.shape[0]:
        raise FitforgeTypeError(
            "fit got the inputs and the labels as two arguments, but its second one is val_data: pass them "
            "as one tuple, fit((X, y), batch_size=32, epochs=...); validation data alone (for a net that computes "
            "its own loss) of as many rows as the training arrays goes as batches, "
            "val_data=DataLoader(X_val, batch_size=...)"
        )
    arrays = is_arrays(train_data) or _rows(train_data)
    # A stream of samples (a Hugging Face datasets.IterableDataset...): batched in this process, which reads
    # it on demand, so that its own state is its position (fitforge.inputs.stateful).
    stream = batch_size is not None and isinstance(train_data, IterableDataset)
    val_stream = batch_size is not None and isinstance(val_data, IterableDataset)
    if batch_size is not None and not (arrays or stream or val_stream) and not (is_arrays(val_data) or _rows(val_data)):
        raise FitforgeValueError(
            "batch_size is for data given as arrays, fit((X, y), batch_size=32), or as an IterableDataset of "
            "samples, fit(dataset, batch_size=32); a DataLoader or a list of batches has its batches already: "
            "set the batch size in DataLoader(..., batch_size=...)"
        )
    size = check_batch_size(batch_size)
    if validation_split is not None:
        if not arrays:
            raise FitforgeValueError(
                "validation_split splits arrays, fit((X, y), validation_split=0.2); for a DataLoader, pass "
                "the validation data as val_data (e.g. from torch.utils.data.random_split)"
            )
        if val_data is not None:
            raise FitforgeValueError("give either val_data or validation_split, not both")
        train_data, val_data = split_off(train_data, validation_split)
    if arrays:
        train_data = array_loader(train_data, size, shuffle=True, argument="train_data")
    if stream:
        train_data = DataLoader(train_data, batch_size=size)
    if is_arrays(val_data) or _rows(val_data):
        val_data = array_loader(val_data, size, shuffle=False, argument="val_data")
    if val_stream:
        val_data = DataLoader(val_data, batch_size=size)
    return train_data, val_data


def eval_loader(data: Any, batch_size: Any, argument: str, bare: bool = False) -> Any:
    """evaluate's or predict's arrays, or a stream of samples with ``batch_size``, as an ordered DataLoader;
    other data is returned as it is."""
    data = from_pandas(data, argument)
    arrays = _rows(data) or (not bare and is_arrays(data))
    if not arrays:
        if batch_size is not None and isinstance(data, IterableDataset):
            return DataLoader(data, batch_size=check_batch_size(batch_size))
        if batch_size is not None:
            raise FitforgeValueError(
                f"batch_size is for data given as arrays; {argument} already has batches: set the batch size "
                "in DataLoader(..., batch_size=...) (an IterableDataset of samples takes batch_size too)"
            )
        return data
    return array_loader(data, check_batch_size(batch_size), shuffle=False, argument=argument, bare=bare)

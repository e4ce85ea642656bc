"""``Estimator.load_weights``: weights from safetensors files (one file, or a Hugging Face model's folder, whole
or sharded) into the net, under any engine.

Read through torch's DCP with its Hugging Face reader, which copies each file's slices straight into the tensors
the net holds: under FSDP2 every rank reads only its own shards, so no rank ever holds the whole model. A net built
on the meta device (``with torch.device("meta"): net = Net()``) is given memory here, only for what this rank
holds, then the file's values.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fitforge.checkpoint.folder import describe_tensors
from fitforge.distributed.hf_weights import load_names, saved_shapes
from fitforge.exceptions import DeviceMismatchError, FitforgeTypeError, FitforgeValueError, describe

log = logging.getLogger("fitforge")
SUFFIX = ".safetensors"
INDEX = ".safetensors.index.json"


def load_weights(estimator: Any, path: str | os.PathLike, strict: bool = True) -> None:
    """Load the safetensors weights at ``path`` into ``estimator.net`` (see :meth:`Estimator.load_weights`)."""
    if not isinstance(path, (str, os.PathLike)):
        raise FitforgeTypeError(f"load_weights: path must be a safetensors file or folder, got {describe(path)}")
    net = estimator.net
    with _folder(Path(path)) as folder:
        names = _check_names(net, saved_shapes(folder), strict, path)
        if materialize(net, estimator.device) and estimator.channels_last:  # as the Estimator places a built net
            net.to(memory_format=torch.channels_last)
        load_names(net, folder, names)


@contextlib.contextmanager
def _folder(path: Path) -> Iterator[Path]:
    """A temporary folder of links to the files to read (DCP's reader reads every ``*.safetensors`` file of its
    folder): the one file given; a folder's files its index names (``*.safetensors.index.json``, as Hugging Face
    writes beside sharded weights), else all its ``.safetensors`` files."""
    if path.is_file() and path.name.endswith(INDEX):
        path = path.parent
    if path.is_dir():
        files = _indexed(path) or sorted(entry for entry in path.iterdir() if entry.suffix == SUFFIX)
        if not files:
            raise FileNotFoundError(f"load_weights: no {SUFFIX} file in the folder {path}")
    elif not path.is_file():
        raise FileNotFoundError(f"load_weights: no safetensors file or folder at {path}")
    elif path.suffix != SUFFIX:
        raise FitforgeValueError(
            f"load_weights reads safetensors files ({SUFFIX}) or a folder of them, got {path.name}: for a fitforge "
            "checkpoint use estimator.load_checkpoint(path)"
        )
    else:
        files = [path]
    with tempfile.TemporaryDirectory(prefix="fitforge-weights-") as temporary:
        for file in files:
            (Path(temporary) / file.name).symlink_to(file.resolve())
        yield Path(temporary)


def _indexed(folder: Path) -> list[Path]:
    """The files the folder's index names (none without an index): other files there are not the model's."""
    indexes = sorted(folder.glob(f"*{INDEX}"))
    if not indexes:
        return []
    if len(indexes) > 1:
        raise FitforgeValueError(
            f"load_weights: {folder} holds several indexes ({', '.join(index.name for index in indexes)}): "
            "give the path of the one to load"
        )
    files = sorted({folder / name for name in json.loads(indexes[0].read_text())["weight_map"].values()})
    missing = [file.name for file in files if not file.is_file()]
    if missing:
        raise FileNotFoundError(f"load_weights: {indexes[0].name} names {_few(missing)}, not in {folder}")
    return files


def _check_names(net: nn.Module, saved: dict[str, tuple[int, ...]], strict: bool, path: Any) -> set[str]:
    """The net's names to load: each of the file's names the net has, with its shape checked. Tied weights
    (one tensor, several names) count as found when the file has any of their names."""
    held = net.state_dict(keep_vars=True)
    ties: dict[int, list[str]] = {}
    for name, tensor in held.items():
        ties.setdefault(id(tensor), []).append(name)
    wrong = [
        f"{name} {tuple(saved[name])} in the file, {tuple(held[name].shape)} in the net"
        for name in held
        if name in saved and tuple(saved[name]) != tuple(held[name].shape)
    ]
    if wrong:
        raise FitforgeValueError(f"load_weights: {path} does not fit the net: shapes differ: {_few(wrong)}")
    missing = [name for name, tensor in held.items() if not any(alias in saved for alias in ties[id(tensor)])]
    unexpected = sorted(set(saved) - set(held))
    empty = [name for name in missing if held[name].is_meta]
    if empty:
        raise FitforgeValueError(
            f"load_weights: {path} lacks {_few(empty)}, which the net built on the meta device holds no values for: "
            "load a file that has them, or build those modules on a real device"
        )
    if strict and (missing or unexpected):
        raise FitforgeValueError(
            f"load_weights: {path} does not fit the net: missing {_few(missing) or 'none'}; unexpected "
            f"{_few(unexpected) or 'none'}. Pass strict=False to load the names both have (the rest keep their values)"
        )
    if missing or unexpected:
        log.info(
            "load_weights: %s; kept the net's own %s; ignored the file's %s", path, _few(missing), _few(unexpected)
        )
    return set(held) & set(saved)


def place_built(net: nn.Module, device: torch.device) -> nn.Module:
    """Move ``net``'s tensors that are not on the meta device to ``device`` (those wait for :func:`materialize`)."""
    return net._apply(lambda tensor: tensor if tensor.is_meta else tensor.to(device))


def materialize(net: nn.Module, device: torch.device) -> bool:
    """Give the tensors of ``net`` that are on the meta device memory on ``device`` (values unset; a sharded
    parameter only its shard): what ``to_empty`` does, to those alone. Whether there were any."""
    tensors = [*net.parameters(), *net.buffers()]
    if not any(tensor.is_meta for tensor in tensors):
        return False
    lost = [
        f"{prefix}.{name}".lstrip(".")
        for prefix, module in net.named_modules()
        for name in module._non_persistent_buffers_set
        if getattr(module, name) is not None and getattr(module, name).is_meta
    ]
    if lost:
        raise FitforgeValueError(
            f"load_weights: the net was built on the meta device, and its buffers {_few(lost)} are saved in no file "
            "(persistent=False): build the net with only its parameters on the meta device (e.g. accelerate's "
            "init_empty_weights()), so that those buffers keep their values"
        )
    # Swapped in place, as torch's own swap_tensors path does: each Parameter stays the object the optimizers
    # and tied modules hold (a plain to_empty makes new ones, so the optimizers would step the meta tensors).
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        net._apply(lambda tensor: torch.empty_like(tensor, device=device) if tensor.is_meta else tensor)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    return True


def refuse_meta(net: nn.Module, argument: str) -> None:
    """No parameter or buffer of ``net`` may be on the meta device (built without memory)."""
    for kind, named in (("parameter", net.named_parameters()), ("buffer", net.named_buffers())):
        for name, tensor in named:
            if tensor.is_meta:
                raise DeviceMismatchError(
                    f"{kind} {name!r} of {argument} is on the meta device, which holds no values: load the net's "
                    "weights first, estimator.load_weights(path) (safetensors), or build the net on a real device"
                )


def _few(names: list[str]) -> str:
    return describe_tensors(names, shown=8)

"""Safetensors folders through torch's DCP and its Hugging Face reader: each rank copies only the slices of the
tensors it holds (its shards under FSDP2) straight from the files (:mod:`fitforge.checkpoint.load_weights`)."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fitforge.distributed.fsdp import dcp_failure
from fitforge.distributed.ranks import initialized, run_on_main_and_share
from fitforge.exceptions import FitforgeValueError


def _reader(folder: Path) -> Any:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        import safetensors  # noqa: F401  (the reader imports it only as it reads)
    except ImportError as err:
        raise ImportError("load_weights reads safetensors: pip install 'fitforge[safetensors]'") from err

    return HuggingFaceStorageReader(str(folder))


def saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The whole shape of each tensor the ``*.safetensors`` files of ``folder`` hold, by name."""
    saved = _reader(folder).read_metadata().state_dict_metadata  # safetensors holds tensors only
    twice = [name for name, meta in saved.items() if len({tuple(c.offsets) for c in meta.chunks}) < len(meta.chunks)]
    if twice:  # whole in two files (a DCP writer's shards have other offsets): which to load is not known
        raise FitforgeValueError(
            f"load_weights: {', '.join(sorted(twice)[:8])} are in two files of the folder: remove the files that "
            "are not the model's, or keep the index (*.safetensors.index.json) that names its files"
        )
    return {name: tuple(getattr(meta, "size", ())) for name, meta in saved.items()}


def load_names(net: nn.Module, folder: Path, names: set[str]) -> None:
    """Copy the tensors ``names`` of ``folder`` into ``net``'s own (sharded or not), on every rank at once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = {name: value for name, value in get_model_state_dict(net).items() if name in names}
    with warnings.catch_warnings():  # in one process, DCP warns that it loads in one process
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=_reader(folder), no_dist=not initialized())  # into the net's own tensors


def write_consolidated(net: nn.Module, target: Path) -> bool:
    """Write ``net``'s whole weights to the one safetensors file ``target``, called on every rank of a sharded
    net: each rank writes its shards beside ``target``, then rank 0 joins them into ``target`` tensor by tensor
    through memory-mapped files (DCP's consolidation), so no rank gathers the model. The ranks must share
    ``target``'s folder, as they share their checkpoints' shards. False, with nothing written, for a net holding
    tensors that are not floating point (a BatchNorm's counter): torch 2.13's consolidation cannot size them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(net)
    if not all(isinstance(value, torch.Tensor) and value.is_floating_point() for value in state.values()):
        return False
    parts = target.with_name(target.name + ".parts")

    def clear() -> None:
        shutil.rmtree(parts, ignore_errors=True)  # a failed export's leftovers would be consolidated too
        target.parent.mkdir(parents=True, exist_ok=True)

    def move() -> None:
        (whole,) = parts.glob("*.safetensors")  # DCP's consolidated file, beside the ranks' in parts/sharded
        os.replace(whole, target)
        shutil.rmtree(parts)

    run_on_main_and_share(clear, FitforgeValueError)
    writer = HuggingFaceStorageWriter(str(parts), save_distributed=True, enable_consolidation=True)
    try:
        dcp.save(_untied(state), storage_writer=writer)
    except (Exception, dcp_failure()) as err:  # DCP raises on every rank, so every rank clears
        run_on_main_and_share(lambda: shutil.rmtree(parts, ignore_errors=True), FitforgeValueError)
        raise FitforgeValueError(f"export: cannot write {target}: {type(err).__name__}: {err}") from err
    run_on_main_and_share(move, FitforgeValueError)  # every rank returns once the file is whole
    return True


def _untied(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with a copy of this rank's shard for each name of a tied weight after the first: safetensors
    refuses tensors that share memory, and the file holds the weight under each name."""
    seen: set[int] = set()
    untied = {}
    for name, value in state.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        where = local.untyped_storage().data_ptr() if local.numel() else None
        untied[name] = value.clone() if where in seen else value
        if where is not None:
            seen.add(where)
    return untied

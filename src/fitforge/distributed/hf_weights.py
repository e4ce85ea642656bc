"""Safetensors folders through torch's DCP and its Hugging Face reader: each rank copies only the slices of the
tensors it holds (its shards under FSDP2) straight from the files (:mod:`fitforge.checkpoint.load_weights`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from torch import nn

from fitforge.distributed.ranks import initialized


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
    return {name: tuple(getattr(meta, "size", ())) for name, meta in saved.items()}


def load_names(net: nn.Module, folder: Path, names: set[str]) -> None:
    """Copy the tensors ``names`` of ``folder`` into ``net``'s own (sharded or not), on every rank at once."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = {name: value for name, value in get_model_state_dict(net).items() if name in names}
    with warnings.catch_warnings():  # in one process, DCP warns that it loads in one process
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=_reader(folder), no_dist=not initialized())  # in place

"""``Estimator.export``: the net's weights for inference, in a file other tools load (safetensors), or as a
Hugging Face model's ``save_pretrained`` folder.

The weights are those evaluation uses (an ``EMAHandler``'s average, a schedule-free optimizer's evaluated
weights), consolidated whatever the engine: under FSDP each rank writes its shards and rank 0 joins them into the
file, with no rank gathering the model (``"hf"`` goes through ``save_pretrained``, so its weights are gathered
to rank 0's host memory first). Rank 0 writes; every rank returns once it is written, or raises its error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fitforge.checkpoint.adapters import is_adapted
from fitforge.core.roles import averaged_weights
from fitforge.distributed.hf_weights import write_consolidated
from fitforge.distributed.ranks import run_on_main_and_share
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

FORMATS = ("safetensors", "hf")


def export_weights(estimator: Any, path: str | os.PathLike, format: str = "safetensors") -> Path:
    """Write ``estimator.net``'s weights to ``path`` (a file for ``"safetensors"``, a folder for ``"hf"``)."""
    if format not in FORMATS:
        raise FitforgeValueError(f"export: format must be one of {FORMATS}, got {describe(format)}")
    if not isinstance(path, (str, os.PathLike)):
        raise FitforgeTypeError(f"export: path must be a file or folder path, got {describe(path)}")
    target, net = Path(path), estimator.net
    if format == "hf" and not callable(getattr(net, "save_pretrained", None)):
        raise FitforgeValueError(
            f"export(format='hf') writes a Hugging Face model's save_pretrained folder, and the net is "
            f"{type(net).__name__}, which has no save_pretrained: use format='safetensors'"
        )
    if format == "safetensors" and is_adapted(net):
        raise FitforgeValueError(
            "export: the net is a peft model: format='hf' writes its adapter as PeftModel.from_pretrained loads it; "
            "for one file of merged weights, export net.merge_and_unload() (an Estimator of it) instead"
        )
    if format == "safetensors" and target.is_dir():
        raise FitforgeValueError(
            f"export: {target} is a folder; format='safetensors' writes one file: give its path, e.g. "
            f"{target / 'model.safetensors'}"
        )

    def write() -> None:
        assert weights is not None  # rank 0 holds them
        if format == "hf":
            net.save_pretrained(target, state_dict=weights, safe_serialization=True)
        else:
            _save_safetensors(weights, target)

    with averaged_weights(estimator):  # written within: the state_dict's tensors are the net's own
        # Sharded: each rank writes its shards and rank 0 joins them, none gathering the model (where torch can).
        if format == "safetensors" and estimator.strategy.sharded and write_consolidated(net, target):
            return target
        weights = estimator.strategy.full_weights(net)  # every rank takes part (FSDP gathers)
        run_on_main_and_share(write, FitforgeValueError)
    return target


def _save_safetensors(weights: dict[str, torch.Tensor], target: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ImportError(
            "export(format='safetensors') needs safetensors: pip install 'fitforge[safetensors]'"
        ) from err

    # safetensors refuses tensors that share memory (tied weights): each key gets its own contiguous copy, so
    # that the file loads into a fresh net with load_state_dict whatever it ties.
    seen: set[int] = set()
    tensors = {}
    for key, value in weights.items():
        tensor = value.detach().cpu()
        where = tensor.untyped_storage().data_ptr()
        shared = where in seen or not tensor.is_contiguous()
        seen.add(where)
        tensors[key] = tensor.clone().contiguous() if shared else tensor
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    save_file(tensors, str(temporary), metadata={"format": "pt"})
    os.replace(temporary, target)  # a reader never sees half a file

"""Sharded training (``strategy="fsdp"``): FSDP2's ``fully_shard``, and checkpoints whose shards every rank
writes through ``torch.distributed.checkpoint`` (DCP) into a folder the checkpoint file names.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from fitforge.core.state import EstimatorLike
from fitforge.distributed.ranks import world_size
from fitforge.exceptions import CheckpointError, FitforgeTypeError, FitforgeValueError

Where = str | os.PathLike  # a shard folder: a local path, or an fsspec URL


def _storage(folder: Where, options: dict, write: bool) -> Any:
    """DCP's writer (or reader) of ``folder``: its local file system's, or fsspec's for a URL."""
    import torch.distributed.checkpoint as dcp

    if isinstance(folder, os.PathLike):
        return dcp.FileSystemWriter(folder) if write else dcp.FileSystemReader(folder)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    # No fsync per file (fsspec's streams have none: torch would os.sync() the machine); the
    # checkpoint's commit, written after the shards, is what makes them count.
    return FsspecWriter(folder, sync_files=False, **options) if write else FsspecReader(folder, **options)


def _fsdp2() -> Any:
    """torch's module of FSDP2 (``fully_shard``, ``FSDPModule``); None in a torch without it."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):  # torch >= 2.6; 2.4 and 2.5
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if hasattr(module, "fully_shard"):
                return module
    return None  # pragma: no cover - torch without FSDP2


def hold_shards(net: nn.Module) -> None:
    """Make every unit of the sharded ``net`` hold the sharded parameters the optimizers step, not gathered
    ones kept after a forward, carrying ``requires_grad`` changes made on those over to the shards."""
    flags = {name: p.requires_grad for name, p in net.named_parameters()}
    fsdp_module = _fsdp2().FSDPModule
    for module in net.modules():
        if isinstance(module, fsdp_module):
            module.reshard()
    for name, parameter in net.named_parameters():
        if parameter.requires_grad != flags[name]:
            parameter.requires_grad_(flags[name])


def supported() -> bool:
    """Whether this torch has FSDP2."""
    return _fsdp2() is not None


def shard(
    net: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device, options: dict | None
) -> nn.Module:
    """``fully_shard`` the net's units and root; point ``optimizers`` at the sharded parameters."""
    fsdp2 = _fsdp2()
    if fsdp2 is None:  # pragma: no cover - torch without FSDP2
        raise FitforgeValueError(
            f"strategy='fsdp' needs FSDP2 (fully_shard), which torch {torch.__version__} "
            "lacks: upgrade torch, or use strategy='ddp'"
        )
    from torch.distributed.device_mesh import init_device_mesh

    options = dict(options or {})
    units = options.pop("shard", ())
    units = (units,) if isinstance(units, type) else tuple(units)
    if not all(isinstance(unit, type) and issubclass(unit, nn.Module) for unit in units):
        raise FitforgeTypeError(
            f"strategy_options['shard'] must be nn.Module classes, e.g. (nn.TransformerEncoderLayer,), got {units!r}"
        )
    if any(any(optimizer.state.values()) for optimizer in optimizers):
        raise FitforgeValueError(
            "strategy='fsdp' shards the net's parameters, so the optimizer must not have "
            "stepped yet: build a fresh one for the Estimator"
        )
    names: dict[int, str] = {}
    for name, parameter in net.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), name)
    mesh = init_device_mesh(device.type, (world_size(),))
    if units:  # inner units before the ones that hold them
        targets = [m for m in reversed(list(net.modules())) if m is not net and isinstance(m, units)]
    else:
        targets = [child for child in net.children() if any(True for _ in child.parameters())]
    for module in [*targets, net]:
        fsdp2.fully_shard(module, mesh=mesh, **options)
    sharded = dict(net.named_parameters(remove_duplicate=False))
    for optimizer in optimizers:  # by name: fully_shard made new Parameter objects
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] if id(p) in names else p for p in group["params"]]
    return net


def _state(estimator: EstimatorLike, grads: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(estimator.net, estimator.optimizers)
    state: dict[str, Any] = {"model": model, "optim": optim}
    average = estimator.weight_average  # an EMAHandler's average, sharded as the weights
    averages = {} if average is None else average.sharded_averages()
    if averages:
        state["averages"] = averages
    if grads:
        state["grads"] = {
            name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in estimator.net.named_parameters()
        }
    return state


def dcp_failure() -> type[BaseException]:
    # DCP's CheckpointException derives from BaseException: an ``except Exception`` lets it through.
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def shards_failed(err: BaseException, name: str) -> CheckpointError:
    """DCP's failure to save the shards ``name`` (every rank's cause) as the CheckpointError a save raises."""
    failures = getattr(err, "failures", None)  # DCP's: rank -> (its exception, its traceback)
    causes = (
        "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(failures.items()))
        if isinstance(failures, dict) and failures
        else f"{type(err).__name__}: {err}"
    )
    return CheckpointError(f"cannot write the shards {name}: {causes}; the checkpoints saved before are intact")


def save_sharded(estimator: EstimatorLike, folder: Where, grads: bool, options: dict) -> None:
    """Every rank writes its shard of the weights and optimizer states (and gradients) to ``folder``."""
    import torch.distributed.checkpoint as dcp

    state = _state(estimator, grads)
    try:
        dcp.save(state, storage_writer=_storage(folder, options, write=True))
    except (Exception, dcp_failure()) as err:
        raise shards_failed(err, str(folder).rstrip("/").rsplit("/", 1)[-1]) from err


def save_sharded_async(estimator: EstimatorLike, folder: Where, grads: bool, options: dict, group: Any) -> Future:
    """:func:`save_sharded` through DCP's ``async_save`` (staged to CPU memory before this returns).
    ``group``: a gloo group of the save's own, whose collectives neither need a GPU backend nor
    interleave with training's. Every rank's future ends once every rank's shards are written."""
    import torch.distributed.checkpoint as dcp

    writer = _storage(folder, options, write=True)
    saving = dcp.async_save(_state(estimator, grads), storage_writer=writer, process_group=group)
    return cast(Future, saving)  # a response object comes only with an async stager, which this does not pass


def load_sharded(
    estimator: EstimatorLike, folder: Where, optimizers: bool, grads: bool, options: dict
) -> dict[str, torch.Tensor]:
    """Load ``folder`` into the estimator's net (and optimizers); return the saved gradients by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if isinstance(folder, os.PathLike):
        exists = Path(folder).is_dir()
    else:
        from fsspec.core import url_to_fs

        fs, key = url_to_fs(folder, **options)
        fs.invalidate_cache(key)
        exists = bool(fs.isdir(key))
    if not exists:
        raise FileNotFoundError(f"no sharded checkpoint folder at {folder}")
    state = _state(estimator, grads)
    if not optimizers:
        del state["optim"]
    reader = _storage(folder, options, write=False)
    saved = reader.read_metadata().state_dict_metadata if "averages" in state else {}
    if "averages" in state and not any(key.startswith("averages.") for key in saved):  # saved before averaging
        del state["averages"]  # the run's average starts anew
    try:
        dcp.load(state, storage_reader=reader)
        if optimizers:
            set_state_dict(
                estimator.net, estimator.optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        else:
            set_model_state_dict(estimator.net, state["model"])
    except (RuntimeError, ValueError, KeyError, dcp_failure()) as err:
        raise CheckpointError(
            f"the sharded checkpoint {folder} does not fit this net or its optimizers: {type(err).__name__}: {err}"
        ) from err
    return state.get("grads", {})

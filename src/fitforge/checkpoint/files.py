"""Atomic save and safe load of training checkpoints: a save writes a temporary file, fsyncs it, renames
it over the target and fsyncs the folder, so a crash leaves the old file or the new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fitforge.checkpoint.adapters import check_base
from fitforge.checkpoint.format import FORMAT_VERSION as FORMAT_VERSION  # where callers have imported it from
from fitforge.checkpoint.format import parse_checkpoint, with_checksum
from fitforge.checkpoint.locations import TEMP_SUFFIX, ObjectPath, is_url, local_path
from fitforge.core.state import EstimatorLike
from fitforge.exceptions import CheckpointError


def save_atomic(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (see the module docstring); returns the path."""
    return replace_atomically(path, lambda file: torch.save(obj, file))


def write_text_atomic(text: str, path: str | os.PathLike) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, as :func:`save_atomic` does; returns the path."""
    return replace_atomically(path, lambda file: file.write(text.encode()))


def replace_atomically(path: str | os.PathLike, write: Callable[[Any], object]) -> Path:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it, rename it over ``path`` and fsync
    the folder; a failure leaves ``path`` as it was."""
    path = Path(path)
    try:
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    except OSError as err:  # a folder made read-only, or removed, during the run
        raise _cannot_write(path, f"{err.strerror or err}; make the folder writable or save elsewhere") from err
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            umask = os.umask(0)  # the only portable way to read it is to set it
            os.umask(umask)
            os.fchmod(file.fileno(), 0o666 & ~umask)  # mkstemp makes 0600; a plain save would not
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException as err:
        Path(temp).unlink(missing_ok=True)
        full = _disk_full(err)
        if full is not None:
            raise _cannot_write(
                path, f"{full.strerror or 'no space left on the device'}; free space or save elsewhere"
            ) from err
        if isinstance(err, OSError):
            raise _cannot_write(path, err.strerror or err) from err
        raise
    # Makes the rename itself durable; not possible on every platform (e.g. Windows), where it is skipped.
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path


def _cannot_write(path: Path, why: object) -> CheckpointError:
    return CheckpointError(f"cannot write {path}: {why} (the files already there are intact)")


def _disk_full(error: BaseException) -> OSError | None:
    """The out-of-space error behind ``error``: torch.save wraps the OSError of a failed write in a
    RuntimeError that keeps it only as its context."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def save_checkpoint(checkpoint: dict, path: str | os.PathLike) -> Path:
    """``save_atomic`` a checkpoint with the ``checksum`` :func:`load_checkpoint` verifies (torch.load would
    not notice bytes flipped inside tensor data)."""
    return save_atomic(with_checksum(checkpoint), path)


def load_checkpoint(path: str | os.PathLike | ObjectPath, map_location: Any = "cpu") -> dict:
    """Read a checkpoint written by a ``CheckpointHandler`` (a local path, or the URL of a committed
    object): FileNotFoundError when there is none; a CheckpointError when it is empty, truncated,
    corrupt, not a fitforge checkpoint, of a newer format version, or not committed."""
    if isinstance(path, ObjectPath) or is_url(path):
        from fitforge.checkpoint.objects import load_url  # imports fsspec: only for a URL

        return load_url(str(path), map_location=map_location)
    path = local_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty")
    return parse_checkpoint(path, path, map_location)


Shards = Callable[[str], tuple[str | os.PathLike, dict]]  # a shard folder's name -> its path or URL, and options
Folder = Path | str | Shards | None  # where a sharded checkpoint's shard folders are


def shards_in(folder: Folder) -> Shards:
    """Where the shard folders named in ``folder``'s checkpoints are: beside them, or as a CheckpointFolder says."""
    if callable(folder):
        return folder
    base = Path(".") if folder is None else folder
    if is_url(base):
        return lambda name: (f"{str(base).rstrip('/')}/{name}", {})
    return lambda name: (local_path(base) / name, {})


def restore_weights(
    estimator: EstimatorLike,
    checkpoint: dict | str | os.PathLike | ObjectPath,
    optimizers: bool = True,
    folder: Folder = None,
) -> dict:
    """Load a checkpoint's net weights (and optimizer states) into ``estimator``, all or nothing; return
    the checkpoint. A sharded (FSDP) checkpoint's weights are in the folder its file names, beside it (in
    ``folder`` when ``checkpoint`` is a dict already loaded)."""
    source = "the checkpoint"
    if not isinstance(checkpoint, dict):
        folder = str(checkpoint).rsplit("/", 1)[0] if is_url(checkpoint) else local_path(checkpoint).parent  # type: ignore[arg-type]
        source = f"checkpoint {checkpoint}"
        # Loaded on the CPU: load_state_dict copies weights to the parameters' device and moves
        # optimizer state as each optimizer expects (a CUDA step counter would sync every step).
        checkpoint = load_checkpoint(checkpoint, map_location="cpu")
    if "sharded" in checkpoint:  # the weights (optimizer states, gradients) are in its DCP folder
        where, options = shards_in(folder)(checkpoint["sharded"])
        try:
            checkpoint["grads"] = estimator.strategy.load_shards(
                estimator, where, optimizers, grads=bool(checkpoint.get("accumulated_batches")), storage_options=options
            )
        except FileNotFoundError as err:
            raise CheckpointError(
                f"the sharded weights of this checkpoint are missing: {err}; keep the .dcp folder "
                "beside the checkpoint file"
            ) from err
        return checkpoint
    check_fits(estimator, checkpoint, folder, optimizers, source)
    if estimator.strategy.sharded:  # whole weights, each rank keeping its shard (check_fits refused optimizers)
        estimator.strategy.load_weights(estimator.net, checkpoint["model"])
        return checkpoint
    # What a failed load puts back: the weights copied to the host (the load writes into the
    # parameters), the optimizers' and scaler's state dicts (a load replaces their tensors: references suffice).
    previous: dict = {
        "model": {key: value.detach().to("cpu", copy=True) for key, value in estimator.net.state_dict().items()}
    }
    if optimizers:
        previous["optimizers"] = [optimizer.state_dict() for optimizer in estimator.optimizers]
        if estimator.scaler is not None:
            previous["scaler"] = estimator.scaler.state_dict()
    try:
        _load_state(estimator, checkpoint, optimizers, source)
    except BaseException:
        _load_state(estimator, previous, optimizers, "the state before the load")
        raise
    return checkpoint


def _load_state(estimator: EstimatorLike, checkpoint: dict, optimizers: bool, source: str) -> None:
    if "frozen_base" in checkpoint:  # an adapter's weights only (check_fits compared its base)
        estimator.net.load_state_dict(checkpoint["model"], strict=False)
    else:
        estimator.strategy.load_weights(estimator.net, checkpoint["model"])
    if not optimizers:
        return
    for optimizer, state in zip(estimator.optimizers, checkpoint.get("optimizers", [])):
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError) as err:
            raise CheckpointError(
                f"the optimizer state in {source} does not fit {type(optimizer).__name__}: "
                f"{err}; nothing was loaded (pass optimizers=False to load the weights only)"
            ) from err
    if "scaler" in checkpoint and estimator.scaler is not None:
        estimator.scaler.load_state_dict(checkpoint["scaler"])


def check_fits(
    estimator: EstimatorLike,
    checkpoint: dict,
    folder: Folder,
    optimizers: bool = True,
    source: str = "the checkpoint",
) -> None:
    """Raise a :class:`CheckpointError` unless ``checkpoint`` (called ``source`` in messages) can
    load into ``estimator`` (read only: names and shapes of the weights, the number of optimizers, a
    sharded checkpoint's folder)."""
    if "sharded" in checkpoint:  # DCP's metadata is written last: with it, the shards are whole
        where, options = shards_in(folder)(checkpoint["sharded"])
        if isinstance(where, os.PathLike):
            whole = (Path(where) / ".metadata").is_file()
        else:
            from fitforge.checkpoint.objects import open_store  # imports fsspec: only for a URL

            fs, key = open_store(str(where), options)
            fs.invalidate_cache(key)
            whole = bool(fs.exists(f"{key}/.metadata"))
        if not whole:
            raise CheckpointError(
                f"the sharded weights of {source} are missing: no folder {checkpoint['sharded']} "
                "with DCP metadata beside it"
            )
        return
    own, weights = estimator.net.state_dict(), checkpoint["model"]
    adapter = check_base(estimator.net, checkpoint, source)  # an adapter's keys: its base is the net's own
    if adapter is not None:
        own = {key: value for key, value in own.items() if key in adapter}
    shapes = [
        f"{k}: checkpoint {tuple(weights[k].shape)} vs net {tuple(own[k].shape)}"
        for k in own
        if k in weights and weights[k].shape != own[k].shape
    ]
    parts = {
        "missing keys": sorted(set(own) - set(weights)),
        "unexpected keys": sorted(set(weights) - set(own)),
        "shape mismatches": shapes,
    }
    if any(parts.values()):
        problem = "; ".join(f"{what} {found}" for what, found in parts.items() if found)
        raise CheckpointError(f"the weights in {source} do not fit this net: {problem}")
    if not optimizers:
        return
    saved = checkpoint.get("optimizers", [])
    if len(saved) != len(estimator.optimizers):
        raise CheckpointError(
            f"{source} holds {len(saved)} optimizer state(s) but the estimator has "
            f"{len(estimator.optimizers)} optimizer(s); pass optimizers=False to load weights only"
        )
    if estimator.strategy.sharded:
        raise CheckpointError(
            "this checkpoint of an unsharded run holds optimizer states that cannot be sharded here; "
            "load its weights only (estimator.load_checkpoint(path, optimizers=False)) and train on"
        )
    # torch loads one optimizer's state into another class without a word (it fails at the next step)
    for i, (name, optimizer) in enumerate(zip(checkpoint.get("optimizer_classes", []), estimator.optimizers)):
        if name != type(optimizer).__name__:
            raise CheckpointError(
                f"{source} holds the state of a {name} for optimizer {i}, but the estimator's "
                f"optimizer {i} is a {type(optimizer).__name__}; use a {name}, or pass "
                "optimizers=False to load the weights only"
            )

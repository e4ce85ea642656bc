"""What a run's ``manifest.json`` says about the run (docs/reproducibility.md): the process that ran it
(command, script's commit, versions, hardware), its arguments or config, seeds, and each epoch's values
and data order. :class:`~fitforge.handlers.ManifestHandler` writes it; ``fitforge diff`` compares two."""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import re
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from fitforge.checkpoint.resume import fit_data_order
from fitforge.core.history import is_timing
from fitforge.core.state import TrainState
from fitforge.distributed.ranks import world_size
from fitforge.reporting.hparams import run_params
from fitforge.reporting.source import repository_of

NAME = "manifest.json"
FORMAT = 1
# Recorded when installed, besides Python, torch and fitforge: what changes a run's numbers or its data.
PACKAGES = (
    "numpy",
    "torchvision",
    "torchaudio",
    "torchmetrics",
    "torchdata",
    "datasets",
    "transformers",
    "peft",
    "safetensors",
    "triton",
    "jsonargparse",
    "fsspec",
)


def now() -> str:
    """The time in UTC, to the second, as ISO 8601."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@functools.cache  # one per process: what is installed does not change while it runs
def environment() -> dict[str, Any]:
    """The versions of Python, torch (its CUDA and cuDNN), fitforge and the :data:`PACKAGES` installed."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    packages = {name: version for name in PACKAGES if (version := _version(name)) is not None}
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "fitforge": _version("fitforge"),
        "packages": packages,
    }


def hardware(device: torch.device) -> dict[str, Any]:
    """The machine: its platform, CPUs, and the accelerator ``device`` is on."""
    found: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "device": str(device),
        "world_size": world_size(),
    }
    if device.type == "cuda":
        found["accelerator"] = torch.cuda.get_device_name(device)
        found["accelerators"] = torch.cuda.device_count()
    return found


def process() -> dict[str, Any]:
    """The command line, the folder it ran in, and the git repository of its script (of that folder when
    there is no script file: a notebook, ``python -c``)."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    where = script if script is not None and script.is_file() else Path.cwd()
    return {"command": redacted(sys.argv), "cwd": os.getcwd(), "repository": repository_of(where)}


_SECRET = re.compile(r"token|secret|passw|api.?key|credential", re.IGNORECASE)


def redacted(argv: list[str]) -> list[str]:
    """``argv`` as a manifest keeps it: the value of an option named like a secret (``--api-key=...``,
    ``--token ...``) and a URL's password replaced by ``***`` (manifests sit beside checkpoints, often shared)."""
    kept: list[str] = []
    for i, arg in enumerate(argv):
        name, equals, _ = arg.partition("=")
        if equals and name.startswith("-") and _SECRET.search(name):
            arg = f"{name}=***"
        elif i and argv[i - 1].startswith("-") and "=" not in argv[i - 1] and _SECRET.search(argv[i - 1]):
            arg = "***"
        kept.append(re.sub(r"(://[^/:@\s]+:)[^@/\s]+@", r"\1***@", arg))
    return kept


def attempt(state: TrainState) -> dict[str, Any]:
    """What one process running the run (its start, or a resume's) was: started, command, versions, hardware."""
    return {"started": now(), **process(), "environment": environment(), "hardware": hardware(state.estimator.device)}


def new_manifest(state: TrainState) -> dict[str, Any]:
    """The manifest of a run starting (at ``train_begin``): this process's :func:`attempt`, the resolved config
    (a run from a config), the Estimator's arguments and the seeds (torch's, the data order's); epochs,
    checkpoints and resumes to come."""
    arguments = {key: value for key, value in run_params(state).items() if not key.startswith("config.")}
    order = fit_data_order(state)
    return {
        "format": FORMAT,
        **attempt(state),
        "config": state.estimator.run_config,
        "arguments": arguments,
        "seeds": {"torch": torch.initial_seed(), "data": None if order is None else order.seed},
        "resumes": [],
        "epochs": [],
        "metrics": {},
        "checkpoints": {},
    }


def epoch_entry(state: TrainState) -> dict[str, Any]:
    """The current epoch, at its end: its number (from 1), the steps after it, the digest of its data order,
    and its history row (keys without a value left out); ``partial`` when a stop cut it short."""
    order = fit_data_order(state)
    history = state.history
    entry = {
        "epoch": state.epoch + 1,
        "step": state.global_step,
        "order": None if order is None else order.epoch_digest(state.epoch),
        "metrics": history.current_row(finite=True),
    }
    return entry if state.run.epoch_finished else {**entry, "partial": True}


def with_epochs(manifest: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``manifest`` with the :func:`epoch_entry` s given, in order: each epoch's number, step and data order in
    ``epochs``, and their values in ``metrics`` as columns aligned to it (a key's name written once). Times and
    speeds keep 4 significant digits: they differ between two runs anyway, and whole they would fill half of it."""
    keys = list(dict.fromkeys(key for entry in entries for key in entry["metrics"]))
    metrics = {key: [entry["metrics"].get(key) for entry in entries] for key in keys}
    for key in filter(is_timing, keys):
        metrics[key] = [None if value is None else float(f"{value:.4g}") for value in metrics[key]]
    epochs = [{key: value for key, value in entry.items() if key != "metrics"} for entry in entries]
    return {**manifest, "epochs": epochs, "metrics": metrics}


def epoch_entries(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The :func:`epoch_entry` s of a manifest (what :func:`with_epochs` put in it)."""
    columns = manifest.get("metrics") or {}

    def row(i: int) -> dict[str, Any]:
        return {key: values[i] for key, values in columns.items() if i < len(values) and values[i] is not None}

    return [{**epoch, "metrics": row(i)} for i, epoch in enumerate(manifest.get("epochs") or [])]


def outcome(state: TrainState) -> str:
    """How the run ended: ``finished``, the stop's reason, the signal, or the error."""
    error, reason = state.run.error, state.history.stop_reason
    if error is not None:
        return f"error: {type(error).__name__}: {str(error)[:200]}"
    if state.run.preempted is not None:
        return f"preempted by signal {state.run.preempted}"
    return f"finished ({reason})" if reason else "finished"


def plain(value: Any) -> Any:
    """``value`` as strict JSON takes it: nan and inf as None, unknown objects as their text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def to_json(manifest: dict[str, Any]) -> str:
    """The text of ``manifest``: indented, with an epoch, a resume or a fingerprint on one line each."""
    return _text(plain(manifest), 0) + "\n"


def _text(value: Any, depth: int) -> str:
    pad = " " * (depth + 1)
    if isinstance(value, dict) and value:
        inner = ",\n".join(f"{pad}{json.dumps(key)}: {_text(item, depth + 1)}" for key, item in value.items())
        return f"{{\n{inner}\n{' ' * depth}}}"
    if isinstance(value, list) and value and all(isinstance(item, (dict, list)) for item in value):
        inner = ",\n".join(pad + json.dumps(item, separators=(",", ":"), allow_nan=False) for item in value)
        return f"[\n{inner}\n{' ' * depth}]"
    return json.dumps(value, allow_nan=False)

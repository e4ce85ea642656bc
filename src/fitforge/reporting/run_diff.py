"""``fitforge diff RUN_A RUN_B``: what differs between two runs' manifests (config keys, arguments, versions,
seeds, hardware, the script's commit, the data order) and the first recorded step where they diverge."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from fitforge.checkpoint.locations import is_url, local_path
from fitforge.checkpoint.objects import FsspecCheckpointIO
from fitforge.core.history import is_timing
from fitforge.exceptions import FitforgeValueError
from fitforge.reporting.manifest import NAME, epoch_entries

COMPARED = ("config", "arguments", "environment", "seeds", "hardware", "repository")  # the sections, in this order
_NOT_COMPARED = {"repository.root"}  # where a checkout is says nothing of what ran


class RunDiff(NamedTuple):
    """Two runs compared: ``differences`` (``"seeds.data: 1 -> 2"``...), ``order`` (where their data orders
    part, or None), ``divergence`` (the verdict on their steps) and ``identical``: nothing differs and every
    step or epoch both recorded matches."""

    differences: list[str]
    order: str | None
    divergence: str
    identical: bool

    def text(self, run_a: str, run_b: str) -> str:
        lines = [f"A: {run_a}", f"B: {run_b}"]
        if self.differences:
            lines += ["differences (A -> B):", *(f"  {line}" for line in self.differences)]
        if self.order is not None:
            lines.append(self.order)
        return "\n".join([*lines, self.divergence])


def read_manifest(run: str | os.PathLike) -> dict[str, Any]:
    """The manifest of ``run``: a run's folder, its ``manifest.json``, or an object-store folder's URL."""
    where = str(run)
    try:
        if is_url(where):
            folder, name = (
                (where.rsplit("/", 1)[0], where.rsplit("/", 1)[1]) if where.endswith(".json") else (where, NAME)
            )
            text = FsspecCheckpointIO(folder).read_text(name)
        else:
            path = local_path(run)
            text = (path / NAME if path.is_dir() else path).read_text()
    except FileNotFoundError:
        raise FitforgeValueError(
            f"fitforge diff: no {NAME} in {where}; a run writes one beside its checkpoints or logs (a fit with a "
            "CheckpointHandler or a CSVLoggerHandler): pass that folder"
        ) from None
    try:
        manifest = json.loads(text)
    except ValueError as err:
        raise FitforgeValueError(f"fitforge diff: {where} is not a run's {NAME} ({err})") from None
    if not isinstance(manifest, dict) or "format" not in manifest:
        raise FitforgeValueError(f"fitforge diff: {where} is not a run's {NAME} (no format)")
    return manifest


def diff_runs(run_a: str | os.PathLike, run_b: str | os.PathLike) -> RunDiff:
    """Compare the manifests of two runs (folders, manifest files or URLs)."""
    return compare(read_manifest(run_a), read_manifest(run_b), (_folder_of(run_a), _folder_of(run_b)))


def compare(a: dict[str, Any], b: dict[str, Any], folders: tuple[Path | None, Path | None] = (None, None)) -> RunDiff:
    """Compare two manifests (see :class:`RunDiff`); ``folders``: where each was read, so that a config value
    naming the run's own folder (a CLI run's ``model_dir``) is not a difference."""
    differences = []
    for section in COMPARED:
        flat_a, flat_b = dict(_flat(a.get(section), section)), dict(_flat(b.get(section), section))
        for key in dict.fromkeys([*flat_a, *flat_b]):
            value_a, value_b = flat_a.get(key, _ABSENT), flat_b.get(key, _ABSENT)
            if key in _NOT_COMPARED or value_a == value_b:
                continue
            if section == "config" and _own_place(value_a, a, folders[0]) and _own_place(value_b, b, folders[1]):
                continue
            differences.append(f"{key}: {_shown(value_a)} -> {_shown(value_b)}")
    order, orders_differ = _orders(a, b)
    divergence, same_steps = _divergence(a, b)
    return RunDiff(differences, order, divergence, not differences and not orders_differ and same_steps)


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _folder_of(run: str | os.PathLike) -> Path | None:
    """The local folder a run's manifest was read from (None for a URL)."""
    if is_url(str(run)):
        return None
    path = local_path(run).resolve()
    return path if path.is_dir() else path.parent


def _own_place(value: Any, manifest: dict[str, Any], folder: Path | None) -> bool:
    """Whether ``value`` is a path to the run's own folder ``folder`` or into it (relative to the run's cwd)."""
    if folder is None or not isinstance(value, str) or not value or is_url(value):
        return False
    path = (Path(manifest.get("cwd") or ".") / value).resolve()
    return path == folder or folder in path.parents


def _flat(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of each leaf of nested dicts, keys joined by dots (an empty dict has none)."""
    if isinstance(value, dict):
        for name, item in value.items():
            yield from _flat(item, f"{key}.{name}")
    else:
        yield key, value


def _shown(value: Any) -> str:
    text = repr(value) if value is _ABSENT else json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _orders(a: dict[str, Any], b: dict[str, Any]) -> tuple[str | None, bool]:
    """Where the data orders of the epochs both recorded part: a line, and whether they do."""
    orders_a = {epoch["epoch"]: epoch.get("order") for epoch in a.get("epochs") or []}
    orders_b = {epoch["epoch"]: epoch.get("order") for epoch in b.get("epochs") or []}
    common = sorted(set(orders_a) & set(orders_b))
    known = [epoch for epoch in common if orders_a[epoch] is not None and orders_b[epoch] is not None]
    if not known:
        return (
            "data order: not recorded (a sampler of its own, or data keeping its own position)" if common else None
        ), False
    differing = [epoch for epoch in known if orders_a[epoch] != orders_b[epoch]]
    if not differing:
        return None, False
    return f"data order: differs from epoch {differing[0]} on ({len(differing)} of {len(known)} epochs)", True


def _divergence(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, bool]:
    """The first recorded step (fingerprints) or else epoch (values) where the runs differ; whether none does."""
    prints_a = {entry[0]: entry[1:] for entry in (a.get("fingerprints") or {}).get("steps", [])}
    prints_b = {entry[0]: entry[1:] for entry in (b.get("fingerprints") or {}).get("steps", [])}
    if prints_a and prints_b:
        common = sorted(set(prints_a) & set(prints_b))
        every = (a["fingerprints"].get("every"), b["fingerprints"].get("every"))
        intervals = f" (recorded every {every[0]} and every {every[1]} steps)" if every[0] != every[1] else ""
        if not common:
            return f"no step was fingerprinted in both runs{intervals}: not compared", False
        for step in common:
            (loss_a, params_a), (loss_b, params_b) = prints_a[step], prints_b[step]
            if (loss_a, params_a) != (loss_b, params_b):
                what = [f"loss {loss_a!r} -> {loss_b!r}"] if loss_a != loss_b else []
                what += ["the parameters differ"] if params_a != params_b else []
                return f"diverge at step {step} (the first recorded step that differs): {', '.join(what)}", False
        more = "" if len(common) == max(len(prints_a), len(prints_b)) else " (one run recorded more steps)"
        span = f"step {common[0]}" if len(common) == 1 else f"steps {common[0]} to {common[-1]}"
        shared = (
            "the fingerprint both runs recorded matches"
            if len(common) == 1
            else (f"the {len(common)} fingerprints both runs recorded match")
        )
        return f"bitwise identical: {shared}, {span}{more}{intervals}", True
    return _epochs_diverge(a, b)


def _epochs_diverge(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, bool]:
    """Without fingerprints in both: the first epoch whose values (not its timings) differ."""
    epochs_a = {entry["epoch"]: entry["metrics"] for entry in epoch_entries(a)}
    epochs_b = {entry["epoch"]: entry["metrics"] for entry in epoch_entries(b)}
    common = sorted(set(epochs_a) & set(epochs_b))
    for epoch in common:
        values_a, values_b = _values(epochs_a[epoch]), _values(epochs_b[epoch])
        if values_a != values_b:
            key = next(k for k in dict.fromkeys([*values_a, *values_b]) if values_a.get(k) != values_b.get(k))
            return f"diverge at epoch {epoch}: {key} {_shown(values_a.get(key))} -> {_shown(values_b.get(key))}", False
    if not common:
        return "no epoch recorded by both runs: not compared", False
    return (
        f"the same values at each of the {len(common)} epochs both recorded (no fingerprints in both: add a "
        "FingerprintHandler to both runs to compare them bitwise)"
    ), True


def _values(metrics: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in metrics.items() if not is_timing(key)}  # they differ between identical runs

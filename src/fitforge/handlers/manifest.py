"""ManifestHandler: the run's ``manifest.json``, beside the files of the handlers that keep them."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from fitforge.checkpoint.resume import fit_data_order
from fitforge.checkpoint.storage import LocalCheckpointIO
from fitforge.core.events import EpochEnd, Stage, TrainBegin, TrainEnd
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.reporting.manifest import (
    NAME,
    attempt,
    epoch_entries,
    epoch_entry,
    new_manifest,
    now,
    outcome,
    to_json,
    with_epochs,
)

log = logging.getLogger("fitforge")


class ManifestHandler(TrainBegin, EpochEnd, TrainEnd):
    """Write the run's ``manifest.json`` (docs/reproducibility.md) into the folder of each handler that keeps
    the run's files (``services.run_folders``: a CheckpointHandler's, a CSVLoggerHandler's...): at
    ``train_begin``, after a checkpoint saved mid-epoch, at each epoch end and at ``train_end``, each time
    whole (replaced atomically). A resumed run appends its resume to the manifest it finds. Every fit has
    one; it writes nothing where no handler keeps files, and never reads a device value."""

    priority = Stage.REPORT  # the epoch's row complete, its checkpoints saved
    main_rank_only = True
    reads = ("estimator", "phase", "epoch", "global_step", "history", "services", "run")
    writes = ()

    def __init__(self) -> None:
        self._stores: list[Any] = []
        self._manifest: dict[str, Any] = {}
        self._epochs: dict[int, dict[str, Any]] = {}  # by epoch number
        self._failed: set[int] = set()  # the stores whose write failed (warned once)

    def offer(self, services: Services) -> None:
        services.after_save.append(self._after_save)

    def train_begin(self, state: TrainState) -> None:
        self._stores = _stores(state.services.run_folders)
        self._failed = set()
        if not self._stores:
            return
        resumed = [told.resumed_from for saver in state.services.checkpoints if (told := saver.saved_checkpoints())]
        resumed_from = next((where for where in resumed if where is not None), None)
        earlier = None if resumed_from is None else self._read()
        if resumed_from is None or earlier is None:
            self._manifest = new_manifest(state)
            if resumed_from is not None:  # of a run whose start wrote no manifest
                self._manifest["resumes"].append({"started": self._manifest["started"], "from": resumed_from.name})
        else:  # one manifest per run: the resume is appended
            self._manifest = earlier
            self._manifest["resumes"].append({**attempt(state), "from": resumed_from.name})
        self._epochs = {entry["epoch"]: entry for entry in epoch_entries(self._manifest)}
        self._write(state)

    def _after_save(self, state: TrainState) -> None:
        if self._stores and state.run.ranks.main:
            self._write(state)

    def epoch_end(self, state: TrainState) -> None:
        if self._stores and state.phase == "train":
            self._settle_resume(state)
            entry = epoch_entry(state)
            self._epochs[entry["epoch"]] = entry
            self._write(state)

    def train_end(self, state: TrainState) -> None:
        if self._stores:
            self._manifest.update(ended=now(), outcome=outcome(state))
            self._write(state)
        self._stores = []  # a later fit whose train_begin never ran (an error before it) writes nothing here

    def _read(self) -> dict[str, Any] | None:
        """The manifest of the run being resumed, from the first folder that holds one."""
        for store in self._stores:
            try:
                manifest = json.loads(store.read_text(NAME))
            except FileNotFoundError:
                continue
            except Exception as err:  # a store's own error (botocore's...) too: a manifest never ends a run
                log.warning("ManifestHandler: %s in %r cannot be read (%s): starting a new one", NAME, store, err)
                continue
            if isinstance(manifest, dict) and isinstance(manifest.get("resumes"), list):
                return manifest
        return None

    def _settle_resume(self, state: TrainState) -> None:
        """Once the run resumed: where, the data's seed (the checkpoint's), and its epochs: those it does again
        left out, those a kill kept from the manifest (written after the checkpoint) taken from its history."""
        resumes, at = self._manifest["resumes"], state.run.resumed_at
        if at is None or not resumes or "at" in resumes[-1]:
            return
        resumes[-1]["at"] = list(at)
        order = fit_data_order(state)
        if order is not None and order.seed is not None:
            self._manifest.setdefault("seeds", {})["data"] = order.seed
        self._epochs = {number: entry for number, entry in self._epochs.items() if number <= at[0]}
        for number, row in enumerate(state.history.rows()[: at[0]], start=1):
            if number not in self._epochs:  # its step and order are not known any more
                metrics = {key: value for key, value in row.items() if math.isfinite(value)}
                self._epochs[number] = {"epoch": number, "step": None, "order": None, "metrics": metrics}

    def _write(self, state: TrainState) -> None:
        self._settle_resume(state)
        manifest = self._manifest = with_epochs(self._manifest, [self._epochs[n] for n in sorted(self._epochs)])
        manifest["checkpoints"] = _checksums(state, manifest.get("checkpoints", {}))
        manifest["time"] = {cause: round(seconds, 3) for cause, seconds in state.run.clock.totals().items()}
        for section in state.services.manifest_sections:
            manifest.update(section())
        text = to_json(manifest)
        for store in self._stores:
            try:
                store.write_text(NAME, text)
            except Exception as err:  # a manifest never ends a run: the checkpoints are what must be written
                if id(store) not in self._failed:
                    self._failed.add(id(store))
                    log.warning("ManifestHandler: cannot write %s to %r: %s: %s", NAME, store, type(err).__name__, err)

    def __repr__(self) -> str:
        return "ManifestHandler()"


def _stores(folders: list[Any]) -> list[Any]:
    """The stores of ``services.run_folders`` that can hold a text file, each once (a folder as an absolute path)."""
    stores, seen = [], set()
    for folder in folders:
        store = LocalCheckpointIO(Path(folder).absolute()) if isinstance(folder, (str, os.PathLike)) else folder
        if not callable(getattr(store, "write_text", None)) or not callable(getattr(store, "read_text", None)):
            log.info("ManifestHandler: %r has no write_text(name, text) and read_text(name): no %s there", store, NAME)
        elif repr(store) not in seen:  # a store's repr names its folder (LocalCheckpointIO's, FsspecCheckpointIO's)
            seen.add(repr(store))
            stores.append(store)
    return stores


def _checksums(state: TrainState, known: dict[str, str | None]) -> dict[str, str | None]:
    """The checksum of each checkpoint kept (regular ones and the best), by name: this fit's, or the earlier
    attempt's; None for one written in the background and not yet whole."""
    checksums: dict[str, str | None] = {}
    for saver in state.services.checkpoints:
        told = saver.saved_checkpoints()
        if told is None:
            continue
        for location in [*told.saved, *([told.best] if told.best is not None else [])]:
            checksums[location.name] = told.checksums.get(location.name) or known.get(location.name)
    return checksums

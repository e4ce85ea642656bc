"""The uninterrupted reference runs (one subprocess per num_workers setting, for the whole
session); the suite's figures are printed by tests/conftest.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import (
    in_parallel,
    journal,
    losses,
    regular_checkpoints,
    run_trainer,
    weights,
)


@dataclass
class Reference:
    weights: dict
    losses: dict[int, str]  # global step -> loss.hex()
    folder: Path  # its checkpoint folder as the run left it


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> dict[int, Reference]:
    """The uninterrupted run, by num_workers; both compute the same (the data order does not
    depend on the workers), which the kill test checks."""
    root = tmp_path_factory.mktemp("reference")

    def uninterrupted(workers: int) -> Reference:
        folder = root / f"workers{workers}"
        folder.mkdir()
        run_trainer(folder / "checkpoints", folder / "log.jsonl", out=folder / "out.pt", workers=workers)
        found = losses(journal(folder / "log.jsonl"))
        assert sorted(found) == list(range(32)) and regular_checkpoints(folder / "checkpoints")
        return Reference(weights(folder / "out.pt"), found, folder / "checkpoints")

    return dict(zip((0, 2), in_parallel(lambda: uninterrupted(0), lambda: uninterrupted(2))))

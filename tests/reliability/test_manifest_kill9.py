"""manifest.json after a SIGKILL: a trainer process kills itself inside a manifest write (its temporary file
written but not synced, synced but not renamed, just renamed) or is killed from outside while it trains; the
manifest left is valid JSON each time, and the run resumed from its checkpoints appends to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,  # starts trainer processes and kills them
    pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="tells the manifest's file by /proc/self/fd"),
]

TRAINER = """
import os, signal, sys
from fitforge.handlers import CheckpointHandler, FingerprintHandler
from fitforge.testing import linear_data, linear_problem

folder, where, at, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
real = {"fsync": os.fsync, "replace": os.replace}
writes = 0

def manifest(target):
    return str(target).endswith("manifest.json") or ".manifest.json." in str(target)

def die_at(point):
    global writes
    if point == where:
        writes += 1
        if writes == at:
            os.kill(os.getpid(), signal.SIGKILL)

def fsync(fd):
    if manifest(os.readlink(f"/proc/self/fd/{fd}")):
        die_at("fsync")  # the temporary file written, not yet synced
    real["fsync"](fd)

def replace(source, target):
    if manifest(target):
        die_at("replace")  # synced, not renamed
    real["replace"](source, target)
    if manifest(target):
        die_at("replaced")

os.fsync, os.replace = fsync, replace
estimator, _, _ = linear_problem()
handlers = [CheckpointHandler(folder, resume_from_checkpoint=True), FingerprintHandler(2)]
estimator.fit(linear_data(n=64, batch_size=16), epochs=epochs, event_handlers=handlers)
"""


def start(folder: Path, where: str = "none", at: int = 0, epochs: int = 6) -> subprocess.Popen:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", TRAINER, str(folder), where, str(at), str(epochs)]
    return subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())  # raises if torn


@pytest.mark.parametrize("where", ["fsync", "replace", "replaced"])
def test_a_kill_inside_a_manifest_write_leaves_a_whole_manifest(tmp_path, where):
    trainer = start(tmp_path, where, at=4)  # the 4th write: at the end of epoch 3
    _, errors = trainer.communicate(timeout=300)
    assert trainer.returncode == -signal.SIGKILL, errors
    manifest = manifest_of(tmp_path)
    written = 3 if where == "replaced" else 2  # the epochs the last whole write held
    assert [epoch["epoch"] for epoch in manifest["epochs"]] == list(range(1, written + 1))
    if where != "replace":
        return
    resumed = start(tmp_path)  # the checkpoint of epoch 3 was saved before the manifest's write: from it
    _, errors = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, errors
    manifest = manifest_of(tmp_path)
    assert len(manifest["resumes"]) == 1 and manifest["resumes"][0]["at"] == [3, 12]
    assert [e["epoch"] for e in manifest["epochs"]] == [1, 2, 3, 4, 5, 6]  # epoch 3's values from the checkpoint
    assert manifest["outcome"] == "finished (reached epochs=6)"


def test_a_kill_from_outside_while_training_leaves_a_whole_manifest(tmp_path):
    trainer = start(tmp_path, epochs=100_000)
    try:
        while not (tmp_path / "manifest.json").exists() or len(manifest_of(tmp_path)["epochs"]) < 3:
            assert trainer.poll() is None, trainer.stderr.read() if trainer.stderr else ""
            time.sleep(0.05)
        time.sleep(0.37)  # somewhere in the epochs that follow
    finally:
        trainer.kill()
        trainer.communicate(timeout=60)
    assert len(manifest_of(tmp_path)["epochs"]) >= 3

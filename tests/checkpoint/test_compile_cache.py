"""A compiled fit keeps what torch.compile built beside its checkpoints: killed with SIGKILL and resumed in a
process with a fresh Inductor cache folder (as on another machine), it compiles nothing again (no FX graph cache
miss), reaches its first step at least 3x sooner than the cold run, and ends with the uninterrupted run's
weights bitwise (compiled_trainer.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration  # its own processes, each compiling (about 20 s cold on a CPU)
TRAINER = Path(__file__).with_name("compiled_trainer.py")


def run(tmp_path, folder, out, cache, *kill_at):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache)}  # fmt: skip
    command = [sys.executable, str(TRAINER), str(tmp_path / folder), str(tmp_path / out), *map(str, kill_at)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def test_a_resumed_compiled_fit_compiles_nothing_again_and_ends_bitwise(tmp_path):
    whole = run(tmp_path, "whole", "whole.pt", "cache-whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    # Killed after the save of step 2; compiled from the first run's Inductor folder (quick), whose kernels it keeps.
    killed = run(tmp_path, "run", "killed.pt", "cache-whole", 3)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "run" / "compile-cache").iterdir()) == ["artifacts.bin", "inductor.tar"]
    resumed = run(tmp_path, "run", "resumed.pt", "cache-resumed")
    assert resumed.returncode == 0 and "compile cache: loaded" in resumed.stderr, resumed.stderr[-3000:]
    cold, warm = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    assert warm["misses"] == 0 and warm["hits"] > 0, (warm["hits"], warm["misses"])
    assert warm["first_step_s"] * 3 <= cold["first_step_s"], (warm["first_step_s"], cold["first_step_s"])
    assert all(torch.equal(cold["weights"][k], warm["weights"][k]) for k in cold["weights"])

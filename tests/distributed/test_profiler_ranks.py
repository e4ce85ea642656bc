"""ProfilerHandler under torchrun (profiler_run.py, 2 CPU ranks on gloo): by default only rank 0 writes a
trace; with ranks=None each rank writes its own, named by its rank, of the same scheduled step."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

SCRIPT = str(Path(__file__).resolve().parent / "profiler_run.py")
TIMEOUT = 240  # seconds for the launch; it takes 5-15 s on 2 busy cores

pytestmark = [
    pytest.mark.integration,  # torchrun ranks
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
    ),
]


def launch(out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT, str(out)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # torchrun stops its workers first (they run in sessions of their own)
        stdout, stderr = process.communicate(timeout=60)
        pytest.fail(f"the launch ran past {TIMEOUT} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def marks(path: Path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith(("batch", "ProfilerStep#"))})


def test_rank_zero_by_default_and_every_rank_when_asked(tmp_path):
    done = launch(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    main = sorted((tmp_path / "main").iterdir())
    every = sorted((tmp_path / "all").iterdir())
    assert [path.name.split(".")[0] for path in main] == ["rank0"]
    assert [path.name.split(".")[0] for path in every] == ["rank0", "rank1"]
    assert all(marks(path) == ["ProfilerStep#2", "batch2"] for path in main + every)

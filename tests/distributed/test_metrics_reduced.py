"""Under torchrun, loss and metric sums are reduced across ranks at epoch end: 2 processes record
the values of 1 process over the same data, and evaluate returns the same dict on every rank."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def torchrun(processes: int, out: Path) -> list[dict]:
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               str(HERE / "metrics_run.py"), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(processes)]


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
def test_two_ranks_record_the_single_process_values(tmp_path):
    single, = torchrun(1, tmp_path / "one")
    ranks = torchrun(2, tmp_path / "two")
    assert ranks[0] == ranks[1]  # every rank logs, monitors and returns the same values
    assert sorted(p.name for p in (tmp_path / "two").glob("*.csv")) == ["log-rank0.csv"]  # rank 0 reports
    for key, values in single["history"].items():
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(ranks[0]["history"][key], values)), key
    assert set(ranks[0]["evaluate"]) == set(single["evaluate"]) == {"val_loss", "val_accuracy"}
    assert all(math.isclose(ranks[0]["evaluate"][k], v, rel_tol=1e-6) for k, v in single["evaluate"].items())

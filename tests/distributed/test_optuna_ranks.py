"""OptunaPruningHandler under torchrun (optuna_run.py, 2 CPU ranks on gloo): rank 0 runs a study
of 2 trials, the other rank the same objective with no trial; the trial pruned at step 6 (validation
every 2 batches) stops at that same batch on both ranks, fit raises optuna.TrialPruned on both, and
the study records it as PRUNED after the trial that was not pruned completed."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("optuna")
SCRIPT = str(Path(__file__).resolve().parent / "optuna_run.py")
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


def test_a_pruned_trial_stops_at_the_same_batch_on_both_ranks(tmp_path):
    done = launch(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    main, other = (json.loads((tmp_path / f"result-rank{r}.json").read_text()) for r in (0, 1))
    assert [t["state"] for t in main] == ["COMPLETE", "PRUNED"]
    assert [t["lr"] for t in other] == [t["lr"] for t in main]  # rank 0's suggestions reached rank 1
    completed, pruned = main[1 - 1], main[1]
    assert completed["batches"] == other[0]["batches"] == list(range(1, 17)) and "raised" not in other[0]
    # Pruned at step 6 (the 2nd batch of the 2nd epoch of 4 batches): both ranks trained batches
    # 1-6 and stopped there, and fit raised TrialPruned on both.
    assert pruned["batches"] == other[1]["batches"] == [1, 2, 3, 4, 5, 6]
    for seen in (pruned, other[1]):
        assert (seen["epoch"], seen["batch_idx"], seen["steps"]) == (1, 1, 6)
        assert seen["raised"].startswith("Optuna pruned trial 1 at step 6 (val_loss=")
    assert pruned["reported"] == [2, 4, 6]
    assert "Pruned in epoch 2/4 at batch 2 of 4 (2 epochs, 6 batches in " in done.stderr

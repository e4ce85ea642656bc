"""Gradient accumulation under torchrun (accumulation_run.py, 2 CPU ranks on gloo, accumulate=3,
7 batches per epoch): only the batch that completes a group all-reduces, and the weights are those
of syncing every batch: with data of known length, without len, after a stop mid-group, after
``batches=N``, and with mid-group checkpoints written along the way. A run stopped by SIGTERM in the
middle of a group resumes, on 2 ranks and in one process, to the weights of the run never
stopped. ``benchmarks/accumulation.py`` counts 1 all-reduce per step instead of 4 with accumulate=4.

The launches are independent processes, so the module runs them in parallel once and the tests
read their results."""

import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "accumulation_run.py")
BENCHMARK = str(HERE.parents[1] / "benchmarks" / "accumulation.py")
TIMEOUT = 240  # seconds for one launch; each takes 5-20 s on 2 busy cores
STEPS = 6  # 2 epochs of 7 batches in groups of 3, 3 and 1

pytestmark = [
    pytest.mark.integration,  # torchrun ranks
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
    ),
]


def launch(
    out: Path, config: dict | None, processes: int, script: str = SCRIPT, args: tuple = ()
) -> subprocess.CompletedProcess:
    """``script`` on ``processes`` ranks under torchrun --standalone (0: the plain script, no
    launcher), given ``out`` and ``config`` (as JSON), or ``args`` when ``config`` is None."""
    out.mkdir(parents=True, exist_ok=True)
    prefix = [sys.executable] if processes == 0 else [sys.executable, "-m", "torch.distributed.run"]
    if processes:
        prefix += ["--standalone", f"--nproc_per_node={processes}"]
    arguments = [*args] if config is None else [str(out), json.dumps(config)]
    process = subprocess.Popen(
        [*prefix, script, *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # torchrun stops its workers first (they run in sessions of their own)
        stdout, stderr = process.communicate(timeout=60)
        pytest.fail(f"the launch writing to {out} ran past {TIMEOUT} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"result-rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("accumulation")
    saved, for_one = root / "saved", root / "for_one"
    fits = {
        "sized": {},
        "sized_each": {"sync_each_batch": True},
        "unsized": {"unsized": True},
        "unsized_each": {"unsized": True, "sync_each_batch": True},
        "stopped": {"stop_at": 4},
        "stopped_each": {"stop_at": 4, "sync_each_batch": True},
        "batches": {"batches": 5},
        "batches_each": {"batches": 5, "sync_each_batch": True},
        "saving": {"model_dir": str(root / "saving"), "batch_period": 2},
        "two_optimizers": {"optimizers": 2},
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        compared = pool.submit(launch, root / "compared", fits, 2)
        # Rank 1 gets SIGTERM after batch 5 of 7, two batches into the second group: every rank
        # stops there, and the epoch's end saves the open group.
        preempted = pool.submit(launch, root / "preempted", {"sized": {"sigterm_at": 4, "model_dir": str(saved)}}, 2)
        benchmark = pool.submit(launch, root / "benchmark", None, 2, BENCHMARK, ("--tiny", "--json"))
        stopped = preempted.result()
        assert stopped.returncode != 0, "the SIGTERM'd run went on to the end"
        shutil.copytree(saved, for_one)
        resumed = {
            "resumed_two": pool.submit(
                launch, root / "resumed_two", {"sized": {"model_dir": str(saved), "resume": True}}, 2
            ),
            "resumed_one": pool.submit(
                launch, root / "resumed_one", {"sized": {"model_dir": str(for_one), "resume": True}}, 0
            ),
        }
        ok(compared.result())
        for future in resumed.values():
            ok(future.result())
        measured = ok(benchmark.result())
    return {"root": root, "benchmark": json.loads(measured.stdout.splitlines()[-1])}


def close(a: dict, b: dict, tolerance: float = 1e-6) -> bool:
    return set(a) == set(b) and all(torch.allclose(torch.tensor(a[k]), torch.tensor(b[k]), atol=tolerance) for k in a)


def test_only_the_batch_completing_a_group_all_reduces(runs):
    ranks = results(runs["root"] / "compared", 2)
    counts = {name: (fit["allreduces"], fit["optimizer_steps"]) for name, fit in ranks[0].items()}
    assert counts == {
        "sized": (STEPS, STEPS),  # the epoch's trailing group of 1 syncs as its last batch
        "sized_each": (14, STEPS),
        "unsized": (4, STEPS),  # the trailing groups are averaged at the epoch end, outside DDP's hook
        "unsized_each": (14, STEPS),
        "stopped": (1, 2),  # stopped after batch 5: the second group's 2 batches are averaged at the epoch end
        "stopped_each": (5, 2),
        "batches": (2, 2),  # batches=5: the fifth batch is known to be the last
        "batches_each": (5, 2),
        "saving": (STEPS, STEPS),
        "two_optimizers": (14, STEPS),  # a batch picks its optimizers after the forward: every batch syncs
    }
    assert ranks[1] == ranks[0]  # identical replicas, counts and steps
    assert all(fit["sync_given_back"] for fit in ranks[0].values())


def test_the_weights_are_those_of_syncing_every_batch(runs):
    (fits, _) = results(runs["root"] / "compared", 2)
    for name in ("sized", "unsized", "stopped", "batches"):
        assert close(fits[name]["params"], fits[f"{name}_each"]["params"]), name
    assert close(fits["unsized"]["params"], fits["sized"]["params"])
    # Checkpoints of open groups (after batches 2, 4, 8...) average them early: the same weights.
    assert close(fits["saving"]["params"], fits["sized"]["params"])


def test_a_run_stopped_mid_group_resumes_to_the_weights_of_the_run_never_stopped(runs):
    root = runs["root"]
    (reference, _) = results(root / "compared", 2)
    assert (root / "saved" / "model-epoch0batch5.pt").is_file()
    saved = torch.load(root / "saved" / "model-epoch0batch5.pt", weights_only=True)
    assert saved["accumulated_batches"] == 2
    resumed = results(root / "resumed_two", 2)
    assert resumed[0]["sized"]["started"] == [5, 2]  # after batch 5, with two batches of the group open
    assert resumed[0]["sized"]["params"] == resumed[1]["sized"]["params"]
    assert close(resumed[0]["sized"]["params"], reference["sized"]["params"])
    (one,) = results(root / "resumed_one", 1)  # rank 0's saved gradients are every rank's: also one process's
    assert close(one["sized"]["params"], reference["sized"]["params"])


def test_the_benchmark_counts_one_all_reduce_per_step_instead_of_four(runs):
    measured = runs["benchmark"]
    assert measured["accumulate"] == 4
    assert measured["variants"]["sync each batch"]["allreduces_per_step"] == 4
    assert measured["variants"]["group's last batch"]["allreduces_per_step"] == 1

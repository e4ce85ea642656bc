"""CheckpointHandler(async_save=True) on 2 CPU ranks under torchrun (train_run.py): rank 0 writes in
the background the same checkpoints a synchronous run writes, and a failed background write reaches
every rank as a CheckpointError at the next agreement (the next save or train_end)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_data_parallel import BASE, launch, ok, results

from fitforge.checkpoint.files import load_checkpoint

ASYNC = {**BASE, "batch_period": 3}  # 5 batches an epoch: saves after 3, 5, 6, 9, 10, 12 and 15


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("async_ranks")
    configs = {
        "sync": {**ASYNC, "model_dir": str(root / "sync_checkpoints")},
        "async": {**ASYNC, "async_save": True, "model_dir": str(root / "async_checkpoints")},
        "failing": {**ASYNC, "async_save": True, "fail_write": 2, "model_dir": str(root / "failing_checkpoints")},
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = {name: pool.submit(launch, root / name, config, 2) for name, config in configs.items()}
        return {"root": root, **{name: future.result() for name, future in done.items()}}


def test_two_ranks_save_in_the_background_what_a_synchronous_run_saves(runs):
    ok(runs["sync"]), ok(runs["async"])
    root = runs["root"]
    sync, background = results(root / "sync", 2), results(root / "async", 2)
    assert background[0]["params"] == background[1]["params"] == sync[0]["params"]
    names = sorted(p.name for p in (root / "async_checkpoints").iterdir())
    assert names == sorted(p.name for p in (root / "sync_checkpoints").iterdir()) and names
    for name in names:
        got = load_checkpoint(root / "async_checkpoints" / name)
        want = load_checkpoint(root / "sync_checkpoints" / name)
        assert got["global_step"] == want["global_step"]
        assert all(torch.equal(got["model"][key], value) for key, value in want["model"].items())


def test_a_failed_background_write_of_rank_0_fails_every_rank(runs):
    assert runs["failing"].returncode != 0
    ranks = results(runs["root"] / "failing", 2)
    assert ranks[0]["error"].startswith("CheckpointError: cannot write") and "No space left" in ranks[0]["error"]
    assert ranks[1]["error"].startswith("CheckpointError: rank 0 failed (CheckpointError: cannot write")
    # Raised by the next save, in the 6th batch's batch_end (so 5 batches completed), on both ranks.
    assert ranks[0]["steps"] == ranks[1]["steps"] == 5

"""CheckpointHandler(async_save=True) on 2 CPU ranks under torchrun (train_run.py): rank 0 writes in
the background the same checkpoints a synchronous run writes, and a failed background write reaches
every rank as a CheckpointError at the next agreement (the next save or train_end). Under FSDP every
rank's shards go through DCP's async_save, and the checkpoints equal a synchronous run's."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_data_parallel import BASE, launch, ok, results
from torch import nn

from fitforge import Estimator
from fitforge.checkpoint.files import load_checkpoint
from fitforge.distributed import fsdp
from helpers import checkpoint_files

pytestmark = pytest.mark.integration  # torchrun ranks

ASYNC = {**BASE, "batch_period": 3}  # 5 batches an epoch: saves after 3, 5, 6, 9, 10, 12 and 15


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("async_ranks")
    configs = {
        "sync": {**ASYNC, "model_dir": str(root / "sync_checkpoints")},
        "async": {**ASYNC, "async_save": True, "model_dir": str(root / "async_checkpoints")},
        "failing": {**ASYNC, "async_save": True, "fail_write": 2, "model_dir": str(root / "failing_checkpoints")},
    }
    if fsdp.supported():
        sharded = {**ASYNC, "strategy": "fsdp"}
        configs["fsdp_sync"] = {**sharded, "model_dir": str(root / "fsdp_sync_checkpoints")}
        configs["fsdp_async"] = {**sharded, "async_save": True, "model_dir": str(root / "fsdp_async_checkpoints")}
    with ThreadPoolExecutor(max_workers=len(configs)) as pool:
        done = {name: pool.submit(launch, root / name, config, 2) for name, config in configs.items()}
        return {"root": root, **{name: future.result() for name, future in done.items()}}


def test_two_ranks_save_in_the_background_what_a_synchronous_run_saves(runs):
    ok(runs["sync"]), ok(runs["async"])
    root = runs["root"]
    sync, background = results(root / "sync", 2), results(root / "async", 2)
    assert background[0]["params"] == background[1]["params"] == sync[0]["params"]
    names = checkpoint_files(root / "async_checkpoints")  # the run's manifest.json aside
    assert names == checkpoint_files(root / "sync_checkpoints") and names
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


@pytest.mark.skipif(not fsdp.supported(), reason=f"torch {torch.__version__} has no FSDP2 (fully_shard)")
def test_two_fsdp_ranks_save_their_shards_in_the_background_as_a_synchronous_run_does(runs):
    ok(runs["fsdp_sync"]), ok(runs["fsdp_async"])
    root = runs["root"]
    sync, background = results(root / "fsdp_sync", 2), results(root / "fsdp_async", 2)
    assert background[0]["params"] == background[1]["params"] == sync[0]["params"]
    folders = {mode: root / f"fsdp_{mode}_checkpoints" for mode in ("sync", "async")}
    names = checkpoint_files(folders["async"])
    assert names == checkpoint_files(folders["sync"]) and any(n.endswith(".dcp") for n in names)
    for name in (n for n in names if n.endswith(".pt")):
        loaded = []
        for folder in folders.values():  # one process reads the 2 ranks' shards
            net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))  # train_run.py's
            estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
            loaded.append((estimator.load_checkpoint(folder / name, optimizers=False)["global_step"], estimator))
        (step, want), (async_step, got) = loaded
        assert step == async_step
        assert all(torch.equal(got.net.state_dict()[k], v) for k, v in want.net.state_dict().items())

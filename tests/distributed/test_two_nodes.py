"""The unchanged script (train_run.py) launched as two "nodes" on this machine: two torchrun agents,
one rank each, meeting through a c10d rendezvous on the loopback address, as two machines would
(``--nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:PORT``). It trains like one process,
global rank 0 alone writes the checkpoints, and a SIGTERM to one node's agent makes both ranks save
once and exit with 143. Kubernetes launches too, as their operators set them up: Kubeflow's
PyTorchJob starts ``python train.py`` in each pod with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and
RANK set (no LOCAL_RANK); Kubeflow Trainer's torch runtime starts ``torchrun train.py`` with its
arguments in PET_* variables."""

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from test_data_parallel import BASE, RUN, SCRIPT, finish, free_port, launch, max_difference, ok, results, start

from fitforge.checkpoint.files import load_checkpoint

pytestmark = pytest.mark.integration  # two torchrun agents meeting on the loopback


def two_nodes(out: Path, config: dict) -> list:
    """Both agents started (not waited for), node 0 first; each rank's checkpoints go to ``out/rank<r>``."""
    out.mkdir(parents=True)
    port = free_port()
    command = [
        *RUN,
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=fitforge-two-nodes",
        "--max-restarts=0",
    ]
    return [
        start([*command, f"--node_rank={node}", SCRIPT, str(out), json.dumps({**config, "per_rank_dirs": True})])
        for node in (0, 1)
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("two_nodes")
    config = {**BASE, "batch_period": 2}
    single = launch(root / "one", {**config, "per_rank_dirs": True}, 0)
    nodes = [finish(agent) for agent in two_nodes(root / "nodes", config)]
    # Slow batches, and SIGTERM to node 1's agent once rank 0 has saved a checkpoint: torchrun passes
    # it on to its rank, and the ranks agree to stop.
    agents = two_nodes(root / "stopped", {**config, "epochs": 20, "batch_seconds": 0.05})
    checkpoints = root / "stopped" / "rank0" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints.exists() and any(checkpoints.glob("*.pt"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    agents[1].send_signal(signal.SIGTERM)
    stopped = [finish(agent) for agent in agents]
    return {"root": root, "single": single, "nodes": nodes, "stopped": stopped, **kubernetes(root, config)}


def kubernetes(root: Path, config: dict) -> dict:
    """Two "pods" as PyTorchJob starts them, and two as Kubeflow Trainer's torch runtime does."""
    port, agents_port = free_port(), free_port()
    arguments = json.dumps({**config, "per_rank_dirs": True})
    for job in ("pytorchjob", "trainjob"):
        (root / job).mkdir()
    pods = []
    for rank in (0, 1):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank)}
        pods.append(start([sys.executable, SCRIPT, str(root / "pytorchjob"), arguments], env))
    trainer = []
    for node in (0, 1):
        env = {
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": "1",
            "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(agents_port),
        }
        trainer.append(start([*RUN, SCRIPT, str(root / "trainjob"), arguments], env))
    return {"pytorchjob": [finish(pod) for pod in pods], "trainjob": [finish(agent) for agent in trainer]}


def test_two_nodes_with_a_c10d_rendezvous_train_like_one_process_and_rank_0_alone_saves(runs):
    ok(runs["single"])
    for node in runs["nodes"]:
        ok(node)
    root = runs["root"]
    (single,) = results(root / "one", 1)
    ranks = results(root / "nodes", 2)
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["params"] == ranks[1]["params"]
    assert max_difference(ranks[0]["params"], single["params"]) <= 1e-6
    saved = sorted(p.name for p in (root / "nodes" / "rank0" / "checkpoints").iterdir())
    assert saved and not any((root / "nodes" / "rank1" / "checkpoints").glob("*"))  # written once, by rank 0
    assert load_checkpoint(root / "nodes" / "rank0" / "checkpoints" / saved[-1])["data_order"]["world"] == 2


def test_sigterm_to_one_node_s_agent_saves_once_and_both_ranks_exit_143(runs):
    root = runs["root"] / "stopped"
    ranks = results(root, 2)
    stderr = "\n".join(agent.stderr[-2000:] for agent in runs["stopped"])
    assert [r.get("exit") for r in ranks] == [143, 143], stderr
    assert ranks[0]["steps"] == ranks[1]["steps"] < 20 * 5 and ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["reason"] == ranks[1]["reason"] == "preempted by SIGTERM (on at least one rank)"
    newest = max((root / "rank0" / "checkpoints").glob("*.pt"), key=lambda p: load_checkpoint(p)["global_step"])
    assert load_checkpoint(newest)["global_step"] == ranks[0]["steps"]  # the state the ranks stopped at
    assert not any((root / "rank1" / "checkpoints").glob("*"))


@pytest.mark.parametrize("job", ["pytorchjob", "trainjob"])
def test_kubernetes_launches_train_like_one_process(runs, job):
    for pod in runs[job]:
        ok(pod)
    root = runs["root"]
    (single,) = results(root / "one", 1)
    ranks = results(root / job, 2)
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["params"] == ranks[1]["params"]
    assert max_difference(ranks[0]["params"], single["params"]) <= 1e-6
    assert any((root / job / "rank0" / "checkpoints").glob("*.pt"))
    assert not any((root / job / "rank1" / "checkpoints").glob("*"))

"""fitforge under torchrun with no change to the script (train_run.py): 2 CPU ranks on gloo train
like 1 process with the same global batch (also with optimizer="muon"), reduce their metrics, gather
predictions on rank 0, write files from rank 0 only, save together when one rank gets SIGTERM, and resume on 2 ranks and
on 1 process; a two-"node" launch on loopback agrees too, and so does a torchrun elastic restart after
one rank was killed. A layer unfrozen between two fits trains alike on both ranks.

The launches are independent processes, so the module runs them in parallel once and the tests
read their results."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from figures import FIGURES
from fitforge.distributed import fsdp
from helpers import checkpoint_files

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "train_run.py")
EXIT_SCRIPT = str(HERE / "exit_run.py")
EXITS = 4  # launches of exit_run.py; each aborted about every other time without the wait at exit
RUN = [sys.executable, "-m", "torch.distributed.run"]
BASE = {"epochs": 3, "global_batch": 16}
FSDP = fsdp.supported()
TIMEOUT = 240  # seconds for one launch; each takes 5-30 s on 2 busy cores
# torch 2.13's agent otherwise hands the restarted workers the rendezvous store of the round that
# failed, and their gloo group can meet a dead peer or hang (see docs/distributed.md).
ELASTIC = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

pytestmark = [
    pytest.mark.integration,  # torchrun ranks
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
    ),
]


def _env(extra: dict | None = None) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **(extra or {})}


def start(command: list[str], extra_env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(extra_env))


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    """Wait for a launch; past TIMEOUT, stop it and fail. torchrun starts its workers in sessions of
    their own, so killing it would leave them running: SIGTERM makes it stop them first."""
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(f"the launch writing to {process.args[-2]} ran past {TIMEOUT} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def launch(
    out: Path, config: dict, processes: int, elastic: bool = False, script: str = SCRIPT
) -> subprocess.CompletedProcess:
    """``processes`` ranks under torchrun --standalone (``elastic``: restarted once if one fails); 0:
    the plain script, no launcher."""
    out.mkdir(parents=True, exist_ok=True)
    prefix = [sys.executable] if processes == 0 else [*RUN, "--standalone", f"--nproc_per_node={processes}"]
    if elastic:
        prefix.append("--max-restarts=1")
    return finish(start([*prefix, script, str(out), json.dumps(config)], ELASTIC if elastic else None))


def free_port() -> int:
    """A TCP port free on the loopback address now (for a rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_two_nodes(out: Path, config: dict) -> list[subprocess.CompletedProcess]:
    """Two launchers, one process each, meeting at a loopback rendezvous as two machines would."""
    out.mkdir(parents=True)
    port = free_port()
    nodes = [
        start(
            [
                *RUN,
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={node}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                SCRIPT,
                str(out),
                json.dumps(config),
            ]
        )
        for node in (0, 1)
    ]
    return [finish(node) for node in nodes]


def results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"result-rank{rank}.json").read_text()) for rank in range(world)]


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("data_parallel")
    paths = {
        name: root / name
        for name in (
            "one",
            "two",
            "nodes",
            "preempted",
            "resumed_two",
            "resumed_one",
            "fsdp_stopped",
            "muon_fsdp",
            "muon_fsdp_stopped",
            "muon_fsdp_resumed",
            "fsdp_resumed_two",
            "fsdp_resumed_one",
            "one_stops",
            "bypass",
            "one_cancels",
            "one_stops_early",
            "user_ddp",
            "elastic",
            "finetune_one",
            "finetune_two",
            "muon_one",
            "muon_two",
            "checkpointing_ddp",
            "checkpointing_fsdp",
        )
    }
    folders = {
        name: root / name
        for name in (
            "checkpoints",
            "saved",
            "for_one",
            "fsdp",
            "fsdp_saved",
            "fsdp_for_one",
            "elastic_checkpoints",
            "muon_fsdp",
        )
    }
    fsdp = {**BASE, "strategy": "fsdp"}
    with ThreadPoolExecutor(max_workers=3) as pool:
        first = {
            "one": pool.submit(launch, paths["one"], {**BASE, "edge_eval": True}, 0),
            "two": pool.submit(launch, paths["two"], {**BASE, "per_rank_dirs": True, "edge_eval": True}, 2),
            "preempted": pool.submit(
                launch,
                paths["preempted"],
                {**BASE, "sigterm_at": 6, "agree_every": 4, "model_dir": str(folders["checkpoints"])},
                2,
            ),
            "nodes": pool.submit(launch_two_nodes, paths["nodes"], BASE),
            "one_stops": pool.submit(launch, paths["one_stops"], {**BASE, "stop_at": 6, "agree_every": 4}, 2),
            "bypass": pool.submit(launch, paths["bypass"], {**BASE, "bypass_ddp": True}, 2),
            "one_cancels": pool.submit(launch, paths["one_cancels"], {**BASE, "cancel_fit_at": 6, "agree_every": 4}, 2),
            "one_stops_early": pool.submit(launch, paths["one_stops_early"], {**BASE, "stop_at_epoch_begin": 1}, 2),
            "user_ddp": pool.submit(launch, paths["user_ddp"], {**BASE, "user_ddp": True, "per_rank_dirs": True}, 2),
            "finetune_one": pool.submit(launch, paths["finetune_one"], {**BASE, "finetune": True}, 0),
            "finetune_two": pool.submit(launch, paths["finetune_two"], {**BASE, "finetune": True}, 2),
            "muon_one": pool.submit(launch, paths["muon_one"], {**BASE, "epochs": 4, "muon": True}, 0),
            "muon_two": pool.submit(launch, paths["muon_two"], {**BASE, "epochs": 4, "muon": True, "export": True}, 2),
            "checkpointing_ddp": pool.submit(launch, paths["checkpointing_ddp"], {**BASE, "checkpointing": True}, 2),
        }
        if FSDP:
            first["checkpointing_fsdp"] = pool.submit(
                launch, paths["checkpointing_fsdp"], {**fsdp, "checkpointing": True}, 2
            )
        muon_fsdp = {**fsdp, "epochs": 4, "muon": True}
        if FSDP:  # Muon over sharded weights; and stopped in epoch 2, then resumed
            first["muon_fsdp"] = pool.submit(launch, paths["muon_fsdp"], muon_fsdp, 2)
            first["muon_fsdp_stopped"] = pool.submit(
                launch,
                paths["muon_fsdp_stopped"],
                {**muon_fsdp, "epochs": None, "batches": 6, "model_dir": str(folders["muon_fsdp"])},
                2,
            )
        if FSDP:  # stopped by batches=7, in the middle of epoch 2: its epoch end saves a mid-epoch checkpoint
            first["fsdp_stopped"] = pool.submit(
                launch,
                paths["fsdp_stopped"],
                {**fsdp, "epochs": None, "batches": 7, "model_dir": str(folders["fsdp"])},
                2,
            )
        # Judged by their own tests, so that a failure there is reported there, not by every test.
        # Rank 1 is killed in batch 7 of 15 in the first round; the newest checkpoint is of batch 6.
        judged = {
            "elastic": pool.submit(
                launch,
                paths["elastic"],
                {
                    **BASE,
                    "batch_period": 2,
                    "resume": True,
                    "model_dir": str(folders["elastic_checkpoints"]),
                    "kill_at": 6,
                },
                2,
                elastic=True,
            )
        }
        judged.update(
            {f"exit{i}": pool.submit(launch, root / f"exit{i}", {}, 2, script=EXIT_SCRIPT) for i in range(EXITS)}
        )
        preempted = first.pop("preempted").result()
        assert preempted.returncode != 0, "the SIGTERM'd run went on to the end"
        # Each resumed run adds its checkpoints to its folder: keep copies as the first runs left them.
        resumes = [
            ("resumed_two", {**BASE, "model_dir": str(folders["checkpoints"])}, 2),
            ("resumed_one", {**BASE, "model_dir": str(folders["for_one"])}, 0),
        ]
        copies = [("checkpoints", "saved"), ("checkpoints", "for_one")]
        if FSDP:
            ok(first.pop("fsdp_stopped").result())
            ok(first.pop("muon_fsdp_stopped").result())
            resumes += [
                ("muon_fsdp_resumed", {**muon_fsdp, "model_dir": str(folders["muon_fsdp"])}, 2),
                ("fsdp_resumed_two", {**fsdp, "model_dir": str(folders["fsdp"]), "export": True}, 2),
                ("fsdp_resumed_one", {**BASE, "model_dir": str(folders["fsdp_for_one"])}, 0),
            ]
            copies += [("fsdp", "fsdp_saved"), ("fsdp", "fsdp_for_one")]
        for source, copy in copies:
            shutil.copytree(folders[source], folders[copy])
        resumed = [
            pool.submit(launch, paths[name], {**config, "resume": True}, processes)
            for name, config, processes in resumes
        ]
        bypass = first.pop("bypass").result()
        assert bypass.returncode != 0 and "bypasses DistributedDataParallel" in bypass.stderr, bypass.stderr[-3000:]
        for name, future in first.items():
            for done in future.result() if name == "nodes" else [future.result()]:
                ok(done)
        for future in resumed:
            ok(future.result())
        done = {name: future.result() for name, future in judged.items()}
    return {**paths, **folders, "done": done}


def max_difference(a: dict, b: dict) -> float:
    return max(float((torch.tensor(a[key]) - torch.tensor(b[key])).abs().max()) for key in a)


def close(a: dict, b: dict, tolerance: float = 1e-6) -> bool:
    return set(a) == set(b) and all(
        abs(x - y) <= tolerance * max(1.0, abs(y))
        for key in a
        for x, y in zip(
            a[key] if isinstance(a[key], list) else [a[key]], b[key] if isinstance(b[key], list) else [b[key]]
        )
    )


def test_two_ranks_train_like_one_process_with_the_same_global_batch(runs):
    (single,) = results(runs["one"], 1)
    ranks = results(runs["two"], 2)
    assert ranks[0]["params"] == ranks[1]["params"]  # DDP keeps the replicas identical
    assert max_difference(ranks[0]["params"], single["params"]) <= 1e-6
    # The loss and metrics, reduced over both ranks' halves, are the single process's.
    assert ranks[0]["history"] == ranks[1]["history"]
    assert close(ranks[0]["history"], single["history"])
    # Throughput is the job's: every rank's samples (the whole data each epoch), the same on every rank.
    assert ranks[0]["samples"] == ranks[1]["samples"] == single["samples"] > 0
    assert ranks[0]["samples_per_s"] == ranks[1]["samples_per_s"] and min(ranks[0]["samples_per_s"]) > 0


def test_muon_and_adamw_on_two_ranks_train_like_one_process_after_20_steps(runs):
    (single,) = results(runs["muon_one"], 1)
    ranks = results(runs["muon_two"], 2)  # optimizer="muon": the hidden layer's weight Muon's, the rest AdamW's
    assert ranks[0]["params"] == ranks[1]["params"]
    assert max_difference(ranks[0]["params"], single["params"]) <= 1e-6


@pytest.mark.skipif(not FSDP, reason="needs FSDP2")
def test_muon_over_fsdp_shards_trains_like_one_process_and_resumes_exactly(runs):
    (single,) = results(runs["muon_one"], 1)
    whole = results(runs["muon_fsdp"], 2)
    resumed = results(runs["muon_fsdp_resumed"], 2)  # stopped after 6 steps, in epoch 2
    assert whole[0]["params"] == whole[1]["params"]
    # Muon's Newton-Schulz runs in bfloat16 on the sharded matrices (DTensor gathers them): not bit for bit.
    assert max_difference(whole[0]["params"], single["params"]) <= 1e-4
    assert resumed[0]["params"] == whole[0]["params"] and resumed[0]["history"] == whole[0]["history"]


def test_an_export_on_two_ranks_holds_the_whole_net_ddp_and_fsdp(runs):
    from safetensors.torch import load_file

    for name in ("muon_two", *(("fsdp_resumed_two",) if FSDP else ())):  # FSDP: consolidated from the shards
        first, _ = results(runs[name], 2)
        exported = load_file(runs[name] / "model.safetensors")
        assert set(exported) == set(first["params"])
        assert all(torch.equal(exported[key], torch.tensor(value)) for key, value in first["params"].items()), name


def test_activation_checkpointing_under_ddp_and_fsdp_trains_like_one_process(runs):
    (single,) = results(runs["one"], 1)
    for name in ("checkpointing_ddp", *(("checkpointing_fsdp",) if FSDP else ())):
        ranks = results(runs[name], 2)
        assert max_difference(ranks[0]["params"], single["params"]) <= 1e-6, name
        assert close(ranks[0]["history"], single["history"]), name


def test_evaluate_returns_the_same_reduced_dict_on_every_rank(runs):
    (single,) = results(runs["one"], 1)
    ranks = results(runs["two"], 2)
    assert ranks[0]["evaluate"] == ranks[1]["evaluate"]
    assert close(ranks[0]["evaluate"], single["evaluate"])


def test_predict_returns_every_output_in_dataset_order_on_rank_0(runs):
    (single,) = results(runs["one"], 1)
    ranks = results(runs["two"], 2)
    assert ranks[1]["predict"] is None
    assert len(ranks[0]["predict"]) == 50  # 25 rows from each rank, interleaved back
    assert float((torch.tensor(ranks[0]["predict"]) - torch.tensor(single["predict"])).abs().max()) <= 1e-5


def test_a_share_smaller_than_the_ranks_and_drop_last_are_evaluated_whole(runs):
    (single,) = results(runs["one"], 1)
    ranks = results(runs["two"], 2)
    assert ranks[0]["tiny_evaluate"] == ranks[1]["tiny_evaluate"]  # rank 1's share of 1 sample is empty
    assert close(ranks[0]["tiny_evaluate"], single["tiny_evaluate"])
    assert ranks[1]["dropped_predict"] is None
    assert len(single["dropped_predict"]) == 6 and len(ranks[0]["dropped_predict"]) == 7  # every sample
    assert (
        float((torch.tensor(ranks[0]["dropped_predict"][:6]) - torch.tensor(single["dropped_predict"])).abs().max())
        <= 1e-5
    )


def test_only_rank_0_writes_files(runs):
    rank0, rank1 = runs["two"] / "rank0", runs["two"] / "rank1"
    assert not rank1.exists()  # no CSV log, no checkpoint folder
    assert (rank0 / "log.csv").is_file()
    assert checkpoint_files(rank0 / "checkpoints") == [
        "model-epoch1batch5.pt",
        "model-epoch2batch10.pt",
        "model-epoch3batch15.pt",
    ]


def test_sigterm_on_one_rank_makes_every_rank_save_at_the_same_batch(runs):
    # Rank 1 alone got SIGTERM in batch 7 (step 6). The ranks agree after batch 1, then every 4
    # batches (agree_every=4): at batch 9 both learn of it and stop there, one checkpoint of 9
    # batches, written by rank 0 while rank 1 waited for it.
    rank1 = json.loads((runs["preempted"] / "result-rank1.json").read_text())
    assert rank1["exit"] == 143 and rank1["steps"] == 9 and "SIGTERM" in rank1["reason"]
    assert set(checkpoint_files(runs["saved"])) == {"model-epoch1batch5.pt", "model-epoch1batch9.pt"}


def test_a_stop_requested_on_one_rank_stops_every_rank_at_the_same_batch(runs):
    # Rank 1 alone asks in batch 7; the next agreement is at batch 9, where both stop.
    ranks = results(runs["one_stops"], 2)
    assert ranks[0]["steps"] == ranks[1]["steps"] == 9
    assert ranks[1]["reason"] == "rank 1's own reason" and ranks[0]["reason"] == "another rank requested a stop"
    assert ranks[0]["params"] == ranks[1]["params"]
    # CancelFit on rank 1 alone, in batch 7's batch_end (after the optimizer step): rank 1 holds it
    # and trains on in step; at batch 9 both raise it, with the same weights and step counts.
    cancelled = results(runs["one_cancels"], 2)
    assert cancelled[0]["steps"] == cancelled[1]["steps"] == 9
    assert "CancelFit raised on another rank" in cancelled[0]["reason"] and "rank 1 alone" in cancelled[1]["reason"]
    assert cancelled[0]["params"] == cancelled[1]["params"]
    early = results(runs["one_stops_early"], 2)  # a stop in epoch_begin: neither trains epoch 2
    assert early[0]["steps"] == early[1]["steps"] == 5 and early[0]["reason"] == "another rank requested a stop"


def test_a_checkpoint_of_two_ranks_resumes_exactly_on_two_ranks_and_on_one_process(runs):
    uninterrupted = results(runs["two"], 2)[0]
    on_two = results(runs["resumed_two"], 2)
    assert on_two[0]["params"] == on_two[1]["params"] == uninterrupted["params"]  # bit for bit
    assert on_two[0]["history"] == uninterrupted["history"]  # the resumed epoch's sums came back per rank
    (on_one,) = results(runs["resumed_one"], 1)
    assert max_difference(on_one["params"], uninterrupted["params"]) <= 1e-6
    assert close(on_one["history"], uninterrupted["history"])  # both ranks' running sums, merged on one


def test_a_script_that_wraps_ddp_and_splits_the_data_itself_gets_the_same(runs):
    (single,) = results(runs["one"], 1)
    ranks = results(runs["user_ddp"], 2)
    assert ranks[0]["params"] == ranks[1]["params"] and max_difference(ranks[0]["params"], single["params"]) <= 1e-6
    assert ranks[0]["history"] == ranks[1]["history"] and close(ranks[0]["history"], single["history"])
    assert ranks[0]["evaluate"] == ranks[1]["evaluate"] and close(ranks[0]["evaluate"], single["evaluate"])
    assert not (runs["user_ddp"] / "rank1").exists()  # the reporting and saving stay on rank 0


def test_a_layer_unfrozen_between_fits_trains_alike_on_every_rank_and_like_one_process(runs):
    # DDP made while the layer was frozen would leave its gradients unaveraged: fit wraps the net anew.
    (single,) = results(runs["finetune_one"], 1)
    (plain,) = results(runs["one"], 1)
    ranks = results(runs["finetune_two"], 2)
    assert ranks[0]["params"] == ranks[1]["params"] and max_difference(ranks[0]["params"], single["params"]) <= 1e-6
    assert ranks[0]["history"] == ranks[1]["history"] and close(ranks[0]["history"], single["history"])
    assert max_difference(single["params"], plain["params"]) > 1e-3  # the frozen first fit made a difference


def test_two_nodes_on_loopback_train_like_one_process(runs):
    (single,) = results(runs["one"], 1)
    nodes = results(runs["nodes"], 2)
    assert nodes[0]["params"] == nodes[1]["params"]
    assert max_difference(nodes[0]["params"], single["params"]) <= 1e-6
    assert close(nodes[0]["evaluate"], single["evaluate"])


def test_an_elastic_restart_resumes_from_the_newest_checkpoint_exactly(runs):
    # torchrun --max-restarts=1 restarted both workers after rank 1 was SIGKILLed in batch 7; they went
    # on from the checkpoint of batch 6 (not from scratch) and ended as the run that was never stopped.
    FIGURES["elastic"] = False
    ok(runs["done"]["elastic"])
    uninterrupted = results(runs["two"], 2)[0]
    ranks = results(runs["elastic"], 2)
    assert [r["restarts"] for r in ranks] == [1, 1] and [r["first_step"] for r in ranks] == [6, 6]
    assert ranks[0]["params"] == ranks[1]["params"] == uninterrupted["params"]  # bit for bit
    assert ranks[0]["history"] == ranks[1]["history"] == uninterrupted["history"]
    FIGURES["elastic"] = True


def test_a_finished_job_exits_with_0_on_every_rank(runs):
    # The group stays referenced (as by DDP or an FSDP mesh) and the scripts end right after their
    # last all-reduce: fitforge's wait at exit leaves no gloo thread to ask for the GIL at shutdown.
    aborted = [
        done.stderr[-2000:]
        for name, done in runs["done"].items()
        if name.startswith("exit") and (done.returncode != 0 or "terminate called" in done.stderr)
    ]
    assert not aborted, f"{len(aborted)} of {EXITS} launches failed:\n" + "\n".join(aborted)


@pytest.mark.skipif(not FSDP, reason=f"torch {torch.__version__} has no FSDP2 (fully_shard)")
def test_fsdp_on_two_cpu_ranks_trains_like_one_process_and_its_checkpoint_round_trips(runs):
    # Sharded weights and optimizer states, saved by both ranks through torch.distributed.checkpoint
    # in the middle of epoch 2, resumed on 2 ranks (FSDP) and on 1 process (no process group).
    assert set(checkpoint_files(runs["fsdp_saved"])) == {
        "model-epoch1batch5.pt",
        "model-epoch1batch5pos0.dcp",
        "model-epoch1batch7.pt",
        "model-epoch1batch7pos2.dcp",
    }
    assert {p.name for p in (runs["fsdp_saved"] / "model-epoch1batch7pos2.dcp").iterdir()} >= {
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    }
    uninterrupted = results(runs["two"], 2)[0]  # DDP, 3 epochs without a stop
    (single,) = results(runs["one"], 1)
    on_two = results(runs["fsdp_resumed_two"], 2)
    (on_one,) = results(runs["fsdp_resumed_one"], 1)
    assert on_two[0]["params"] == on_two[1]["params"]
    for resumed in (on_two[0], on_one):
        assert max_difference(resumed["params"], uninterrupted["params"]) <= 1e-6
        assert max_difference(resumed["params"], single["params"]) <= 1e-6
        assert close(resumed["history"], uninterrupted["history"])
    assert on_two[0]["evaluate"] == on_two[1]["evaluate"] and close(on_two[0]["evaluate"], single["evaluate"])
    assert on_two[1]["predict"] is None and len(on_two[0]["predict"]) == 50

"""FaultTolerantStrategy on torchft, end to end: three replica groups of one process (replica_group.py) and
a lighthouse on 127.0.0.1. Group 1 vetoes step 30, group 2 is SIGKILLed at step 50 and restarted at step 80;
groups 0 and 1 go on without a restart. Every committed step trains its global batch once, over the
groups in the quorum, so the final weights equal one process training the same global batches."""

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import replica_group as script
import torch

from fitforge import Estimator
from fitforge.fault_tolerance import FaultTolerantStrategy, NoQuorum, lighthouse
from fitforge.inputs.placement import epoch_permutation

pytestmark = pytest.mark.integration
torchft = pytest.importorskip("torchft")
HERE = Path(__file__).parent
STEPS = script.EPOCHS * script.SIZE // script.BATCH


def reference(
    seed: int = script.SEED, size: int = script.BATCH, epochs: int = script.EPOCHS
) -> dict[str, torch.Tensor]:
    """One process, plain torch: step t trains the mean loss of the t-th global batch of the seeded order."""
    x, y = script.data().tensors
    net = script.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    per_epoch = script.SIZE // size
    for step in range(epochs * per_epoch):
        epoch, k = divmod(step, per_epoch)
        order = epoch_permutation(script.SIZE, True, seed, epoch)
        batch = order[k * size : (k + 1) * size]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x[batch]), y[batch]).backward()
        optimizer.step()
    return net.state_dict()


def assert_like_one_process(out: Path, expected: dict[str, torch.Tensor]) -> None:
    """Every group's final weights are the same and within 1e-5 of ``expected``."""
    finals = [torch.load(out / f"final-{i}.pt") for i in range(3)]
    for final in finals:
        assert final["weights"].keys() == expected.keys()
        for name in expected:
            assert torch.equal(final["weights"][name], finals[0]["weights"][name])
            assert (final["weights"][name] - expected[name]).abs().max() < 1e-5, name


def records(out: Path, group: int) -> list[dict]:
    lines = []
    for path in sorted(out.glob(f"record-{group}-*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines()]
    return lines


@contextmanager
def running_lighthouse(out: Path, join_timeout_ms: int = 30_000) -> Iterator[str]:
    """torchft's own lighthouse command, on a free port of 127.0.0.1 (read from its log); its address."""
    log = out / "lighthouse.log"
    command = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", "127.0.0.1:0", "--min_replicas", "2"]
    command += ["--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", "1000"]
    env = {**os.environ, "RUST_LOG": "info"}  # it says where it listens at INFO
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while "listening on: http://" not in log.read_text():
            assert time.monotonic() < deadline, f"the lighthouse did not start: {log.read_text()}"
            time.sleep(0.05)
        port = log.read_text().split("listening on: http://", 1)[1].split()[0].rsplit(":", 1)[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def ended(out: Path, processes: list[subprocess.Popen]) -> dict[str, str]:
    """Wait for the groups, which must all exit with 0; their logs by file name."""
    codes = [process.wait(timeout=300) for process in processes]
    logs = {path.name: path.read_text() for path in out.glob("group-*.log")}
    assert codes == [0] * len(processes), logs
    return logs


def group(
    out: Path, index: int, address: str, plan: dict, life: int = 1, together: int = 3, torchrun: bool = False
) -> subprocess.Popen:
    """Replica group ``index``: a plain process, or (``torchrun``) a torchrun job of one process."""
    env = {
        **os.environ,
        "TORCHFT_LIGHTHOUSE": address,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "FT_PLAN": json.dumps(plan),
        "FT_LIFE": str(life),
        "FT_GROUPS": str(together),
    }
    log = (out / f"group-{index}-{life}.log").open("w")
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr", "127.0.0.1"]
        launcher += ["--master_port", str(free_port())]
    command = [*launcher, str(HERE / "replica_group.py"), str(out), str(index)]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_three_groups_survive_a_kill_a_veto_and_take_a_restarted_group_back(tmp_path):
    plans = [{"pause_at": 79, "pause_for": 2}, {"veto_at": 30}, {"kill_at": 50}]
    with running_lighthouse(tmp_path) as address:
        groups = [group(tmp_path, i, address, plan) for i, plan in enumerate(plans)]
        assert groups[2].wait(timeout=300) == -9  # SIGKILLed at step 50
        deadline = time.monotonic() + 300
        while not any(line.get("step") == 79 for line in records(tmp_path, 0)):
            assert time.monotonic() < deadline and groups[0].poll() is None, (tmp_path / "group-0-1.log").read_text()
            time.sleep(0.05)
        groups[2] = group(tmp_path, 2, address, plans[2], life=2, together=1)
        logs = ended(tmp_path, groups)

    # Groups 0 and 1 ran once, without a restart; every group ends on the same weights, those of one process.
    assert_like_one_process(tmp_path, reference())

    # The quorum: 3 groups until step 50, 2 from step 50 to 79, 3 again from step 80.
    committed = {i: [line for line in records(tmp_path, i) if "step" in line] for i in range(3)}
    assert [line["step"] for line in committed[0]] == list(range(STEPS))
    assert [line["step"] for line in committed[2]] == [*range(50), *range(80, STEPS)]
    sizes = {line["step"]: line["groups"] for line in committed[0]}
    assert {sizes[s] for s in range(50)} == {3} and {sizes[s] for s in range(50, 80)} == {2}
    assert {sizes[s] for s in range(80, STEPS)} == {3}

    # Every sample of every epoch trained exactly once, over the groups that committed each step.
    per_epoch = script.SIZE // script.BATCH
    for epoch in range(script.EPOCHS):
        seen = sorted(
            i
            for lines in committed.values()
            for line in lines
            if line["step"] // per_epoch == epoch and line["weight"]
            for i in line["indices"]
        )
        assert seen == list(range(script.SIZE)), epoch

    # The vetoed step 30 and the step 50 the kill broke were retried from unchanged weights, on every group.
    for i in range(3):
        attempts = [line for line in records(tmp_path, i) if "attempt" in line]
        for step in (30, 50) if i < 2 else (30,):
            tries = [line["digest"] for line in attempts if line["attempt"] == step]
            assert len(tries) == 2 and tries[0] == tries[1], (i, step, tries)

    # Group 2, restarted, received the live weights at step 80: the others' at that step's start.
    restarted = [line for line in records(tmp_path, 2) if line.get("attempt") == 80]
    live = [line for line in records(tmp_path, 0) if line.get("attempt") == 80]
    assert restarted[0]["digest"] == live[-1]["digest"]
    assert "fitforge_0002 joined its peers at step 80" in logs["group-2-2.log"]
    assert "ft_lost=1" in logs["group-0-1.log"] and "ft_joined=1" in logs["group-0-1.log"]


def test_a_whole_job_killed_resumes_from_each_groups_checkpoint(tmp_path):
    """Every group (a torchrun job of one process) SIGKILLed at step 65 and started again: each resumes
    from its checkpoint of step 63 and the run ends as if never stopped. The seed was drawn apart in
    each group: group 0's holds."""
    plan = {"kill_at": 65, "checkpoints": True, "seed": None}
    with running_lighthouse(tmp_path) as address:
        first = [group(tmp_path, i, address, plan, torchrun=True) for i in range(3)]
        assert all(process.wait(timeout=300) != 0 for process in first)  # torchrun: its worker was SIGKILLed
        for i in range(3):
            assert "Signal 9 (SIGKILL)" in (tmp_path / f"group-{i}-1.log").read_text()
        for up in tmp_path.glob("up-*"):
            up.unlink()
        logs = ended(tmp_path, [group(tmp_path, i, address, plan, life=2, torchrun=True) for i in range(3)])
    seeds = {torch.load(tmp_path / f"final-{i}.pt")["seed"] for i in range(3)}
    assert len(seeds) == 1  # the primary's, given to the others at step 0
    assert_like_one_process(tmp_path, reference(seeds.pop()))
    for i in range(3):
        assert "resuming from model-epoch2batch63.pt" in logs[f"group-{i}-2.log"], logs[f"group-{i}-2.log"]
        resumed = [line["step"] for line in records(tmp_path, i) if "step" in line][65:]
        assert resumed == list(range(63, STEPS))  # the steps after the checkpoint, trained again once


def test_a_group_the_others_went_on_without_catches_up_in_the_epoch(tmp_path):
    """Group 2 stalls for 2 s after step 15, longer than the lighthouse waits for a late group: groups 0
    and 1 go on alone, and at its next quorum group 2 receives their state and trains on with them, in
    the same epoch, without a restart."""
    plans = [{"batch": 6, "epochs": 1, "slow": 0.05}] * 2 + [{"batch": 6, "epochs": 1, "stall_at": 15, "stall_for": 2}]
    with running_lighthouse(tmp_path, join_timeout_ms=300) as address:
        logs = ended(tmp_path, [group(tmp_path, i, address, plan) for i, plan in enumerate(plans)])
    steps = script.SIZE // 6
    caught_up = [line["step"] for line in records(tmp_path, 2) if "step" in line]
    assert caught_up[:16] == list(range(16)) and 16 < caught_up[16] < steps - 1, caught_up
    assert caught_up[16:] == list(range(caught_up[16], steps))
    assert f"fitforge_0002 joined its peers at step {caught_up[16]}" in logs["group-2-1.log"]
    committed = [line for i in range(3) for line in records(tmp_path, i) if "step" in line and line["weight"]]
    assert sorted(i for line in committed for i in line["indices"]) == list(range(script.SIZE))
    assert_like_one_process(tmp_path, reference(size=6, epochs=1))


def test_a_group_alone_is_told_to_start_the_others():
    with lighthouse(min_replicas=2, heartbeat_timeout_ms=1000) as address:
        strategy = FaultTolerantStrategy(lighthouse=address, replica_id=0, quorum_timeout=1.0)
        estimator = Estimator(script.model(), torch.nn.MSELoss(), optimizer="sgd", strategy=strategy)
        loader = torch.utils.data.DataLoader(script.data(), batch_size=script.BATCH)
        with pytest.raises(NoQuorum, match="min_replicas=2 replica groups formed within quorum_timeout=1 s at step 0"):
            estimator.fit(loader, epochs=1)
        strategy.manager.shutdown(wait=False)

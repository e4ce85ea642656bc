"""Per-step cost of ``FaultTolerantStrategy`` (torchft replica groups) against DDP (``strategy="ddp"``).

    python benchmarks/fault_tolerance.py                         # 3 processes, 200 steps, 2 runs of each
    python benchmarks/fault_tolerance.py --steps 20 --runs 1     # a quick check that it runs
    python benchmarks/fault_tolerance.py --json                  # the raw figures

Both engines train the same MLP (``--layers`` x Linear(width, width) + ReLU, then Linear(width, 1);
MSE, SGD lr 0.01) on the same seeded random data, for the same global batch and number of steps, in
``--processes`` CPU processes on 127.0.0.1 talking gloo over the loopback:

  ddp   ``python -m torch.distributed.run --nproc_per_node P``; the DataLoader's batch_size is the
        per-rank batch (global / P), fitforge splits the data with a DistributedSampler.
  ft    a ``torchft_lighthouse`` (``--min_replicas 2``) and P plain processes, one replica group each
        (``REPLICA_GROUP_ID``); the DataLoader's batch_size is the global batch, split over the groups
        in each step's quorum.

Each fit is one epoch of ``--steps`` batches, with the lean handlers (``default_handlers=False``). A
handler after the optimizer step records ``time.perf_counter()`` at every batch_end of rank / group 0;
the figure is the median interval after ``--warmup`` steps (start-up, process group and quorum
set-up excluded). For ft, group 0 also times the three torchft calls each step makes (the quorum
round trip to the lighthouse, the gradients' all-reduce, should_commit's round trip), the first
quorum (all groups start together: the wall time to bring the quorum up) and, for both engines, the
time from the Estimator's construction to the end of the first step. The engines run interleaved
(ddp, ft, ddp, ft...) ``--runs`` times each; the table shows every run and the medians over runs.

Every process uses one thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``). With more
processes than cores (3 on a 2-core machine) they contend for the CPU, and each round trip waits for
a descheduled peer: such figures are an upper bound on the overhead. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED = 1234
TIMEOUT = 300  # seconds for one launch
FT_CALLS = ("quorum", "allreduce", "should_commit")


# -- the worker: one rank (ddp) or one replica group (ft) -----------------------------------------------
def make_net(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def make_data(samples: int, width: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(samples, width, generator=generator), torch.randn(samples, 1, generator=generator))


def step_timer() -> Any:
    from fitforge.core.events import BatchEnd, Stage

    class StepTimer(BatchEnd):
        """``time.perf_counter()`` at the end of every (committed) step, after the optimizer's."""

        priority = Stage.STEP + 1

        def __init__(self) -> None:
            self.ends: list[float] = []

        def batch_end(self, state: Any) -> None:
            self.ends.append(time.perf_counter())

    return StepTimer()


class TimedWork:
    """A torchft Work whose ``wait`` records the time since the all-reduce was called."""

    def __init__(self, work: Any, started: float, times: list[float]) -> None:
        self.work, self.started, self.times = work, started, times

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self.work.wait(*args, **kwargs)
        self.times.append(time.perf_counter() - self.started)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def time_manager_calls(manager: Any) -> dict[str, list[float]]:
    """Time each call of torchft's Manager the strategy makes per step (seconds, in call order)."""
    times: dict[str, list[float]] = {name: [] for name in FT_CALLS}

    def timed(method: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                times[name].append(time.perf_counter() - started)

        return call

    allreduce = manager.allreduce

    def timed_allreduce(*args: Any, **kwargs: Any) -> TimedWork:
        started = time.perf_counter()
        return TimedWork(allreduce(*args, **kwargs), started, times["allreduce"])

    manager.start_quorum = timed(manager.start_quorum, "quorum")
    manager.should_commit = timed(manager.should_commit, "should_commit")
    manager.allreduce = timed_allreduce
    return times


def wait_for_peers(folder: Path, rank: int, processes: int) -> None:
    """Start the replica groups' clocks together (torchrun's ranks meet in init_process_group)."""
    (folder / f"ready-{rank}").touch()
    while len(list(folder.glob("ready-*"))) < processes:
        time.sleep(0.005)


def worker(args: argparse.Namespace) -> None:
    from fitforge import Estimator
    from fitforge.fault_tolerance import FaultTolerantStrategy

    torch.set_num_threads(1)
    logging.getLogger("fitforge").setLevel(logging.WARNING)
    out = Path(args.out)
    net = make_net(args.width, args.layers)
    data = make_data(args.steps * args.batch, args.width)
    strategy: Any
    if args.worker == "ft":
        rank = int(os.environ["REPLICA_GROUP_ID"])
        strategy = FaultTolerantStrategy(seed=SEED, timeout=60.0, quorum_timeout=120.0)
        batch = args.batch  # the global batch, split over the groups at each step
        wait_for_peers(out.parent, rank, args.processes)
    else:
        rank = int(os.environ["RANK"])
        strategy = "ddp"
        batch = args.batch // args.processes  # per rank: fitforge gives each rank its part of the data
    started = time.perf_counter()
    estimator = Estimator(
        net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.01), device="cpu", strategy=strategy
    )
    calls = time_manager_calls(strategy.manager) if args.worker == "ft" else {}
    timer = step_timer()
    loader = DataLoader(data, batch_size=batch, shuffle=True)
    estimator.fit(loader, epochs=1, default_handlers=False, event_handlers=[timer])
    if rank == 0:
        result = {
            "engine": args.worker,
            "steps": len(timer.ends),
            "step_intervals_s": [b - a for a, b in zip(timer.ends, timer.ends[1:])],
            "first_step_s": timer.ends[0] - started,
            "calls_s": calls,
        }
        out.write_text(json.dumps(result))


# -- the driver -------------------------------------------------------------------------------------------
def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def finish(processes: list[subprocess.Popen], logs: list[Path]) -> None:
    """Wait for every process; past TIMEOUT, or when one fails, stop them all and raise with the logs."""
    deadline = time.monotonic() + TIMEOUT
    try:
        for process in processes:
            code = process.wait(timeout=max(deadline - time.monotonic(), 1))
            if code != 0:
                raise RuntimeError(f"a process exited with {code}")
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)  # torchrun then stops its workers
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
        raise RuntimeError(f"{error}\n{tails}") from None


def launch(engine: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One run of ``engine``: its rank/group 0's figures, and the launch's wall time."""
    folder.mkdir(parents=True)
    out = folder / "result.json"
    flags = [f"--{name}={getattr(args, name)}" for name in ("steps", "width", "layers", "batch", "processes")]
    script = [str(Path(__file__).resolve()), f"--worker={engine}", f"--out={out}", *flags]
    started = time.perf_counter()
    if engine == "ddp":
        log = folder / "torchrun.log"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.processes}"]
        command += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", *script]
        with log.open("w") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=_env({}))
        finish([process], [log])
    else:
        from fitforge.fault_tolerance import lighthouse

        with lighthouse(
            min_replicas=min(2, args.processes), join_timeout_ms=30_000, heartbeat_timeout_ms=1_000
        ) as address:
            logs = [folder / f"group-{i}.log" for i in range(args.processes)]
            groups = []
            for i, log in enumerate(logs):
                env = _env({"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(i)})
                with log.open("w") as sink:
                    groups.append(
                        subprocess.Popen([sys.executable, *script], stdout=sink, stderr=subprocess.STDOUT, env=env)
                    )
            finish(groups, logs)
    result = json.loads(out.read_text())
    result["launch_s"] = time.perf_counter() - started
    return result


def ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def summarize(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Median and mean ms per step after the warm-up; for ft, the median of each torchft call."""
    timed = result["step_intervals_s"][warmup:]
    summary = {
        "engine": result["engine"],
        "steps": result["steps"],
        "timed_steps": len(timed),
        "ms_per_step": ms(timed),
        "mean_ms_per_step": 1e3 * statistics.fmean(timed) if timed else float("nan"),
        "first_step_s": result["first_step_s"],
        "launch_s": result["launch_s"],
    }
    if result["calls_s"]:
        calls = result["calls_s"]
        summary["first_quorum_s"] = calls["quorum"][0]  # join's: every group asks at once
        summary["calls_ms"] = {name: ms(calls[name][1 + warmup :]) for name in FT_CALLS}
    return summary


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``args.runs`` runs of each engine, interleaved (ddp first)."""
    if args.batch % args.processes:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --processes {args.processes}")
    if args.steps <= args.warmup + 1:
        raise SystemExit(f"--steps {args.steps} leaves no step to time after --warmup {args.warmup}")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fitforge-ft-bench-") as root:
        for run in range(args.runs):
            for engine in ("ddp", "ft"):
                runs.append(summarize(launch(engine, args, Path(root) / f"{engine}-{run}"), args.warmup))
    by_engine = {engine: [r for r in runs if r["engine"] == engine] for engine in ("ddp", "ft")}
    medians = {engine: statistics.median(r["ms_per_step"] for r in rs) for engine, rs in by_engine.items()}
    parameters = sum(p.numel() for p in make_net(args.width, args.layers).parameters())
    return {
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("worker", "out", "json")},
            "parameters": parameters,
        },
        "runs": runs,
        "median_ms_per_step": medians,
        "ratio_ft_ddp": medians["ft"] / medians["ddp"],
        "paired_ratios": [f["ms_per_step"] / d["ms_per_step"] for d, f in zip(by_engine["ddp"], by_engine["ft"])],
    }


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    timed = result["runs"][0]["timed_steps"]
    lines = [
        f"{c['processes']} processes, gloo on 127.0.0.1, 1 thread each; "
        f"MLP {c['layers']} x {c['width']} ({c['parameters']:,} parameters), global batch {c['batch']}",
        f"{c['steps']} steps per run, {timed} timed (after {c['warmup']} warm-up), rank/group 0's median per run",
        "",
        "| run | engine | ms/step | mean ms/step | first step s | launch s |",
        "|----:|--------|--------:|-------------:|-------------:|---------:|",
    ]
    for i, r in enumerate(result["runs"]):
        lines.append(
            f"| {i // 2 + 1} | {r['engine']} | {r['ms_per_step']:.2f} | {r['mean_ms_per_step']:.2f} "
            f"| {r['first_step_s']:.2f} | {r['launch_s']:.1f} |"
        )
    medians = result["median_ms_per_step"]
    paired = ", ".join(f"{ratio:.2f}" for ratio in result["paired_ratios"])
    lines += [
        "",
        f"median over runs: ddp {medians['ddp']:.2f} ms/step, ft {medians['ft']:.2f} ms/step, "
        f"FT/DDP {result['ratio_ft_ddp']:.2f} (per pair: {paired})",
    ]
    for i, r in enumerate(r for r in result["runs"] if r["engine"] == "ft"):
        calls = ", ".join(f"{name} {value:.2f}" for name, value in r["calls_ms"].items())
        lines.append(
            f"ft run {i + 1}, group 0's torchft calls per step (median ms): {calls}; "
            f"first quorum (all groups at once) {r['first_quorum_s']:.2f} s"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps (batches) per fit")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the timing")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3, help="hidden Linear(width, width) layers")
    parser.add_argument("--batch", type=int, default=96, help="the global batch (a multiple of --processes)")
    parser.add_argument("--processes", type=int, default=3, help="DDP ranks, and replica groups")
    parser.add_argument("--runs", type=int, default=2, help="runs of each engine, interleaved")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--worker", choices=("ddp", "ft"), help=argparse.SUPPRESS)  # a launched process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    result = measure(args)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()

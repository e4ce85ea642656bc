"""The training stall per checkpoint save: synchronous against ``CheckpointHandler(async_save=True)``.

A net of a few big ``nn.Linear`` layers (≥ 50M parameters by default; Adam's two moments triple
the state, ~600 MB in float32) trains on random data, saving every ``--period`` batches. The stall
of a save is the time the training loop spends in the handler's ``batch_end`` that saves: the whole
save for a synchronous one; the host copy (and any wait for the previous write) for an async one.
The period leaves each background write time to end before the next save, as a run's should;
the wait in ``train_end`` for the last write is printed apart. Nothing is asserted: a measurement.

    python benchmarks/checkpoint_stall.py                 # CPU, 3 x Linear(4096, 4096), 3 saves each
    python benchmarks/checkpoint_stall.py --quick         # a tiny net: checks that it runs
    python benchmarks/checkpoint_stall.py --device cuda   # where a GPU is lent
    python benchmarks/checkpoint_stall.py --fsdp          # strategy="fsdp" on one gloo rank: DCP's async_save
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from fitforge import Estimator
from fitforge.handlers import CheckpointHandler


class TimedCheckpoint(CheckpointHandler):
    """A CheckpointHandler recording how long each saving ``batch_end`` and ``train_end`` block the loop."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stalls: list[float] = []
        self.end_wait = 0.0

    def _sync(self, state) -> None:
        if state.estimator.device.type == "cuda":  # the loop's queued work is not the save's
            torch.cuda.synchronize()

    def batch_end(self, state) -> None:
        if (state.global_step + 1) % (self.batch_period or 1):
            return super().batch_end(state)
        self._sync(state)
        started = time.perf_counter()
        super().batch_end(state)
        self.stalls.append(time.perf_counter() - started)

    def train_end(self, state) -> None:
        started = time.perf_counter()
        super().train_end(state)
        self.end_wait = time.perf_counter() - started


def measure(width: int, layers: int, saves: int, period: int, batch: int, device: str, strategy: str = "auto") -> dict:
    logging.getLogger("fitforge").setLevel(logging.ERROR)
    results: dict = {}
    for variant in ("sync", "async"):
        torch.manual_seed(0)
        net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        parameters = sum(p.numel() for p in net.parameters())
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
        estimator = Estimator(net, nn.MSELoss(), optimizer=optimizer, device=device, strategy=strategy)
        data = [(torch.randn(batch, width), torch.randn(batch, width)) for _ in range(saves * period)]
        with tempfile.TemporaryDirectory() as folder:
            saver = TimedCheckpoint(folder, epoch_period=None, batch_period=period, async_save=variant == "async")
            started = time.perf_counter()
            estimator.fit(data, epochs=1, event_handlers=[saver], default_handlers=False)
            results[variant] = {
                "stall_ms": [s * 1e3 for s in saver.stalls],
                "median_ms": statistics.median(saver.stalls) * 1e3,
                "train_end_wait_ms": saver.end_wait * 1e3,
                "fit_s": time.perf_counter() - started,
            }
    results["ratio"] = results["async"]["median_ms"] / results["sync"]["median_ms"]
    state_mb = parameters * 3 * 4 / 1e6  # weights and Adam's two moments, float32
    return {
        "parameters": parameters,
        "state_mb": state_mb,
        "device": device,
        "strategy": strategy,
        "torch": torch.__version__,
        **results,
    }


def table(result: dict) -> str:
    lines = [
        f"{result['parameters'] / 1e6:.1f}M parameters, Adam (~{result['state_mb']:.0f} MB of state), "
        f"{result['device']}, strategy {result['strategy']}, torch {result['torch']}",
        "",
        "| save | stall per save, median (ms) | each save (ms) | train_end waits (ms) |",
        "|---|---|---|---|",
    ]
    for variant in ("sync", "async"):
        row = result[variant]
        each = ", ".join(f"{s:.0f}" for s in row["stall_ms"])
        lines.append(f"| {variant} | {row['median_ms']:.0f} | {each} | {row['train_end_wait_ms']:.0f} |")
    lines += ["", f"async / sync: {result['ratio']:.1%}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--period", type=int, default=6, help="batches between saves")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny net, to check that it runs")
    parser.add_argument("--fsdp", action="store_true", help='strategy="fsdp" on a one-rank gloo process group')
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.saves, args.period, args.batch = 32, 2, 2, 2, 4
    strategy = "auto"
    if args.fsdp:  # one rank of its own: the saves go through torch.distributed.checkpoint
        store = tempfile.mkdtemp()
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        strategy = "fsdp"
    result = measure(args.width, args.layers, args.saves, args.period, args.batch, args.device, strategy)
    if args.fsdp:
        dist.destroy_process_group()
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()

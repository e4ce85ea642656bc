"""What NaNGuardHandler costs per batch, by policy and optimizer, against the same fit without it.

Each variant trains the same net with Adam on the same seeded data (``fit`` with the lean
handlers: stopping, gradient update, metrics), in one process, interleaved: every repeat runs
every variant once, in a rotating order. Printed per variant: the median paired ratio of its time
to the unguarded fit's with the same optimizer in the same repeat, the extra time per batch
(median of the paired differences) and the host reads per batch (counted, not timed).

    python benchmarks/nan_guard.py                       # CPU, MLP and CNN, 11 repeats
    python benchmarks/nan_guard.py --device cuda --json  # where a GPU is lent

Variants: ``none`` (no guard), ``stop`` (the default policy), ``skip``; each with a fused Adam
(the guard skips a bad step on the device: no host read per batch for "stop") and a foreach Adam
(the guard reads a flag per batch to cancel a bad step). Nothing is asserted: a measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.handlers import GradientUpdateHandler, MetricHandler, NaNGuardHandler, StoppingHandler
from fitforge.testing import HostReadCounter

GUARDS = {"none": None, "stop": "stop", "skip": "skip"}
WORKLOADS = {  # name -> (net factory, input shape, samples, batch size)
    "mlp": (lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), (32,), 8192, 64),
    "cnn": (
        lambda: nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        ),
        (1, 28, 28),
        2048,
        128,
    ),
}


def loader(workload: str, samples: int | None = None) -> DataLoader:
    _, shape, default, batch = WORKLOADS[workload]
    generator = torch.Generator().manual_seed(0)
    n = samples or default
    data = TensorDataset(torch.randn(n, *shape, generator=generator), torch.randint(0, 10, (n,), generator=generator))
    return DataLoader(data, batch_size=batch)


def prepare(workload: str, guard: str, fused: bool, data: DataLoader, device: str):
    """A function running the variant's fit once (a fresh net and optimizer from the same seed)."""

    def run() -> float:
        torch.manual_seed(0)
        net = WORKLOADS[workload][0]()
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True)
        estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer, device=device)
        handlers = [StoppingHandler(), GradientUpdateHandler(), MetricHandler()]
        handlers += [NaNGuardHandler(GUARDS[guard])] if GUARDS[guard] else []
        history = estimator.fit(data, epochs=1, event_handlers=handlers, default_handlers=False)
        return history["train_loss"][-1]

    return run


def measure(workloads: list[str], repeats: int, device: str = "cpu", samples: int | None = None) -> dict:
    logging.getLogger("fitforge").setLevel(logging.ERROR)
    results: dict = {}
    for workload in workloads:
        data = loader(workload, samples)
        variants = [(guard, fused) for fused in (True, False) for guard in GUARDS]
        runs = {v: prepare(workload, *v, data, device) for v in variants}
        times: dict = {v: [] for v in variants}
        for repeat in range(repeats):
            order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
            for variant in order:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                started = time.perf_counter()
                runs[variant]()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times[variant].append(time.perf_counter() - started)
        batches = len(data)
        rows = {}
        for guard, fused in variants:
            base = times[("none", fused)]
            mine = times[(guard, fused)]
            with HostReadCounter() as reads:
                runs[(guard, fused)]()
            rows[f"{guard}, {'fused' if fused else 'foreach'}"] = {
                "paired_ratio": statistics.median(m / b for m, b in zip(mine, base)),
                "us_per_batch": statistics.median(m - b for m, b in zip(mine, base)) / batches * 1e6,
                "host_reads_per_batch": reads.count / batches,
            }
        results[workload] = {"batches": batches, "repeats": repeats, "variants": rows}
    return {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(), "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1) if args.device == "cpu" else None
    result = measure(args.workloads, args.repeats, args.device)
    if args.json:
        print(json.dumps(result))
        return
    print(f"device {result['device']}, torch {result['torch']}, {result['threads']} thread(s)")
    for workload, found in result["results"].items():
        print(f"{workload}: {found['batches']} batches, {found['repeats']} paired repeats")
        for name, row in found["variants"].items():
            print(
                f"  {name:15s} ratio {row['paired_ratio']:.3f}  {row['us_per_batch']:+7.1f} us/batch  "
                f"{row['host_reads_per_batch']:.2f} host reads/batch"
            )


if __name__ == "__main__":
    main()

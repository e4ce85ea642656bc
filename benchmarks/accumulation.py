"""Gradient all-reduces per optimizer step, and time per step, of gradient accumulation under DDP.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/accumulation.py [--repeats N] [--tiny]

Workload: MLP 32->1024->1024->10 (1.1 M parameters) on 8,192 synthetic samples (4,096 per rank of
2), per-rank batch 32, ``GradientUpdateHandler(accumulate=4)``, 1 epoch (32 optimizer steps), SGD
lr 0.01, cross-entropy; CPU and gloo. ``--tiny``: MLP 32->16->16->10, 256 samples, for a smoke test.
Variants, timed interleaved in the same processes (every rank runs every variant together):
  sync each batch     ``sync_each_batch=True``: every micro-batch's backward all-reduces the
                      gradients (fitforge's behaviour before the group's last batch alone did)
  group's last batch  the default: only the batch that completes a group all-reduces (DDP's
                      ``require_backward_grad_sync``, what ``no_sync()`` clears, is off for the others)
A DDP comm hook (torch's ``allreduce_hook``, wrapped) counts the bucket all-reduces of each fit.
Rank 0 prints, per variant, the all-reduces per optimizer step and the median wall time of a fit
per optimizer step (set-up included), and whether both variants reached the same weights (within
1e-5). ``--json`` prints the same as one JSON line (for the test). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.handlers import GradientUpdateHandler, LambdaHandler

ACCUMULATE = 4
VARIANTS = {"sync each batch": True, "group's last batch": False}  # name -> sync_each_batch


def make_data(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(samples, 32, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def fit(data: TensorDataset, batch: int, width: int, sync_each_batch: bool) -> dict:
    """One fit of a fresh net (and DDP wrapper): its all-reduces, optimizer steps, time and weights."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.01)
    )
    allreduces: list[int] = []

    def counting(state, bucket):  # named arguments: DDP checks the hook's signature
        allreduces.append(1)
        return allreduce_hook(state, bucket)

    estimator.train_net.register_comm_hook(None, counting)
    steps: list[int] = []
    handlers = [
        GradientUpdateHandler(accumulate=ACCUMULATE, sync_each_batch=sync_each_batch),
        LambdaHandler(train_end=lambda state: steps.append(state.optimizer_steps)),
    ]
    dist.barrier()
    started = time.perf_counter()
    estimator.fit(DataLoader(data, batch_size=batch), epochs=1, event_handlers=handlers)
    seconds = time.perf_counter() - started
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {"allreduces": len(allreduces), "steps": steps[0], "seconds": seconds, "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a tiny MLP and a few batches, for a smoke test")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("fitforge").setLevel(logging.WARNING)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    samples, batch, width, repeats = (256, 8, 16, 1) if args.tiny else (8192, 32, 1024, args.repeats)
    data = make_data(samples)
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for repeat in range(repeats):
        for name in VARIANTS if repeat % 2 == 0 else reversed(VARIANTS):
            runs[name].append(fit(data, batch, width, VARIANTS[name]))
    if rank == 0:
        report = {
            "world": world,
            "accumulate": ACCUMULATE,
            "batches_per_rank": -(-samples // world // batch),
            "steps": runs["sync each batch"][0]["steps"],
            "variants": {
                name: {
                    "allreduces_per_step": done[0]["allreduces"] / done[0]["steps"],
                    "seconds_per_step": statistics.median(run["seconds"] / run["steps"] for run in done),
                }
                for name, done in runs.items()
            },
            "same_weights": bool(
                torch.allclose(
                    runs["sync each batch"][0]["weights"], runs["group's last batch"][0]["weights"], atol=1e-5
                )
            ),
        }
        if args.json:
            print(json.dumps(report))
        else:
            print(
                f"{world} ranks, accumulate={ACCUMULATE}, {report['batches_per_rank']} batches per rank, "
                f"{report['steps']} optimizer steps per fit, {repeats} repeats"
            )
            for name, row in report["variants"].items():
                print(
                    f"{name:20s} {row['allreduces_per_step']:.2f} all-reduces per step, "
                    f"{row['seconds_per_step'] * 1e3:.2f} ms per step (median)"
                )
            print(f"same weights: {report['same_weights']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

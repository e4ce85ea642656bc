"""Overhead of data-parallel ``Estimator.fit`` over a hand-written DDP loop, under torchrun.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/distributed.py [--repeats 7] [--tiny]

Workload: MLP 32->64->10 on 16,384 synthetic samples (8,192 per rank of 2), per-rank batch 64,
2 epochs, SGD lr 0.01, cross-entropy, accuracy; CPU and gloo (on GPUs, NCCL for the gradients).
Variants, timed interleaved in the same processes (every rank runs every variant together):
  hand        ``DistributedDataParallel`` + ``DistributedSampler`` + the usual loop, with on-device
              loss and accuracy sums all-reduced and read at epoch end
  fit         ``Estimator(strategy="auto")`` fit with StoppingHandler, GradientUpdateHandler and
              MetricHandler; under torchrun the ranks agree on stops every few batches (the
              interval holds about 0.25 s of batches, see fitforge.distributed.stop_agreement)
  fit every   the same, agreeing after every batch (``StopAgreement.max_interval = 1``)
  fit no-sync the same without any batch agreement: the agreement's cost (one all-reduce of 4 ints)
Rank 0 prints the median wall time per variant, and the median over repeats of each fit variant's
time divided by the hand loop's from the same repeat. The parity line checks that every variant
reached the same final loss. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fitforge import Estimator
from fitforge.distributed.stop_agreement import StopAgreement
from fitforge.handlers import MetricHandler


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def make_data(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(samples, 32, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def hand(data: TensorDataset, batch: int, epochs: int) -> float:
    net = DistributedDataParallel(make_net())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    criterion = nn.CrossEntropyLoss()
    sampler = DistributedSampler(data, shuffle=False)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    loss_value = 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        loss_sum, correct, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64), 0
        for x, y in loader:
            out = net(x)
            loss = criterion(out, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_sum.add_(loss.detach(), alpha=len(y))
            correct.add_((out.detach().argmax(1) == y).sum())
            count += len(y)
        sums = torch.stack([loss_sum, correct.double(), torch.tensor(float(count), dtype=torch.float64)])
        dist.all_reduce(sums)
        loss_value = float(sums[0] / sums[2])
    return loss_value


def fit(data: TensorDataset, batch: int, epochs: int, agreement: str = "adaptive") -> float:
    net = make_net()
    estimator = Estimator(
        net,
        nn.CrossEntropyLoss(),
        train_metrics="accuracy",
        device="cpu",
        optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
    )
    loader = DataLoader(data, batch_size=batch)
    handlers = [MetricHandler()]
    if agreement == "adaptive":
        history = estimator.fit(loader, epochs=epochs, default_handlers=False, event_handlers=handlers)
    elif agreement == "every":
        with mock.patch.object(StopAgreement, "max_interval", 1):
            history = estimator.fit(loader, epochs=epochs, default_handlers=False, event_handlers=handlers)
    else:
        never = mock.patch.object(
            StopAgreement, "after_batch", lambda self, state, cancel=None: state.run.stop_requested
        )
        with never:
            history = estimator.fit(loader, epochs=epochs, default_handlers=False, event_handlers=handlers)
    return history["train_loss"][-1]


VARIANTS = {
    "hand": hand,
    "fit": fit,
    "fit every": lambda d, b, e: fit(d, b, e, agreement="every"),
    "fit no-sync": lambda d, b, e: fit(d, b, e, agreement="never"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tiny", action="store_true", help="a few batches, for a smoke test")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("fitforge").setLevel(logging.WARNING)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    samples, batch, epochs = (256, 16, 1) if args.tiny else (16384, 64, 2)
    data = make_data(samples)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses: dict[str, float] = {}
    for repeat in range(args.repeats):
        order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            dist.barrier()
            started = time.perf_counter()
            losses[name] = VARIANTS[name](data, batch, epochs)
            times[name].append(time.perf_counter() - started)
    if rank == 0:
        steps = epochs * len(range(0, samples // world, batch))
        print(f"{world} ranks, {samples // world} samples and {steps} steps per rank, {args.repeats} repeats")
        for name, values in times.items():
            median = statistics.median(values)
            line = f"{name:12s} median {median:.3f} s ({median / steps * 1e6:.0f} us/step)"
            if name != "hand":
                ratios = [t / h for t, h in zip(values, times["hand"])]
                line += f"   paired ratio vs hand {statistics.median(ratios):.3f}"
            print(line)
        same = len({round(value, 5) for value in losses.values()}) == 1
        print(f"parity: final train loss {losses} -> {'same' if same else 'DIFFERENT'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

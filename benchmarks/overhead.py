"""Overhead of ``Estimator.fit`` over a hand-written PyTorch loop doing the same work (CPU, 1 thread;
or ``--device cuda``).

Workloads (synthetic, seeded data; TensorDataset + DataLoader, shuffle=False; SGD lr 0.01;
cross-entropy; accuracy):
  A  MLP 32->64->10, 32,768 train / 4,096 val samples, batch 64, 2 epochs (tiny steps: worst case)
  B  small CNN on 1x28x28, 4,096 train / 1,024 val samples, batch 128, 1 epoch
  Z  the MLP of A on 1 train + 1 val batch of 64, 1 epoch: the fixed cost of a fit (set-up, checks,
     the first-batch sanity checks, handler start and end), at least 101 paired repeats

Each workload is timed four ways in one process, interleaved: every repeat runs the two pairs
(fit default, hand + val) and (fit lean, hand) back to back, alternating which pair goes first and
which member of a pair goes first, so paired runs see the same machine conditions:
  fit default   ``fit(train, val_data=val, epochs=E)`` with the default handlers (stopping, gradient
                update, metrics, validation, logging; logging silenced; no progress bar)
  hand + val    a hand-written loop with the same training, on-device loss/accuracy sums read at
                epoch end, and validation (loss + accuracy) after every epoch
  fit lean      ``fit`` running only StoppingHandler, GradientUpdateHandler and MetricHandler
  hand          the hand-written loop without validation
Every run gets a fresh net and optimizer built from the same seed, outside the timed region, so all
variants do identical arithmetic (the printed parity line checks the final training loss). Both
loops call the same ``nn.CrossEntropyLoss`` module (a module call costs ~20k instructions more than
``F.cross_entropy``, the same in both). Only the
``fit(...)`` call / the loop itself is timed: wall time (``time.perf_counter``, the headline) and
process CPU time (``time.process_time``; less sensitive to other processes on a shared machine).

Reading the output: ``median s`` is the median wall time per variant (``us/step``: the same divided
by the training steps, validation included); ``paired ratio`` is the median over repeats of fit/hand
from the same repeat (robust to slow phases of the machine); ``overhead`` is (min fit - min hand) /
training steps in microseconds, from the fastest runs; ``fixed cost`` is the median over repeats
of fit - hand in microseconds per fit (the headline of workload Z with ``--sample-reads``; printed as
``fit - hand`` without it, as it then includes fit's faster reads). The CPU-time line repeats both in CPU time.
``peak memory`` runs each variant once more and compares how far the memory in use peaked above
its level at the start (see ``measure_peak``). The dispatch line is ``benchmarks/dispatch.py``'s cost per
no-op handler call with 0, 10 and 50 handlers. For counts that do not depend on the machine's
noise, ``benchmarks/instructions.py`` counts executed instructions of the same variants.
fit reads the batches of these loaders by indexing the TensorDataset's tensors once per batch, where
the hand loop's DataLoader reads them sample by sample (see ``fitforge.inputs.indexed``): on these small
nets that is most of the difference. ``--sample-reads`` gives the loaders a TensorDataset subclass,
which fit reads sample by sample as the hand loop does (fit without the DataLoader's iterator): the
ratios then measure the loop's own overhead, reads excluded.
With ``--device cuda`` both loops train on the GPU: the loaders pin their batches and both loops
copy them without blocking (fit does so itself on CUDA); each timed run starts after a
``torch.cuda.synchronize()`` and ends with the loops' own epoch-end reads (a sync).

Nothing is asserted: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import logging
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitforge.estimator
import fitforge.handlers.defaults
from fitforge import Estimator
from fitforge.core.dispatch import Dispatcher
from fitforge.handlers import MetricHandler, ProgressBarHandler
from fitforge.testing import HostReadCounter

SEED = 0
VARIANTS = ("fit default", "hand + val", "fit lean", "hand")
PAIRS = (("fit default", "hand + val"), ("fit lean", "hand"))


class Workload(NamedTuple):
    title: str
    make_net: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    train_samples: int
    val_samples: int
    batch_size: int
    epochs: int


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 10),
    )


WORKLOADS = {
    "A": Workload("MLP 32->64->10", mlp, (32,), 32_768, 4_096, 64, 2),
    "B": Workload("small CNN 1x28x28", cnn, (1, 28, 28), 4_096, 1_024, 128, 1),
    "Z": Workload("MLP 32->64->10, 1 train + 1 val batch (fixed cost of a fit)", mlp, (32,), 64, 64, 64, 1),
}
MIN_REPEATS = {"Z": 101}  # a fit of two batches takes about a millisecond: many pairs for a stable median


class SampleRows(TensorDataset):
    """A TensorDataset that fit reads sample by sample, as a DataLoader does (``--sample-reads``)."""


def make_loaders(
    w: Workload, fraction: float, device: str = "cpu", sample_reads: bool = False
) -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(SEED)
    pin = torch.device(device).type == "cuda"  # page-locked batches: copied to the GPU without blocking
    dataset = SampleRows if sample_reads else TensorDataset

    def loader(samples: int) -> DataLoader:
        n = max(w.batch_size, int(samples * fraction))
        x = torch.randn(n, *w.input_shape, generator=generator)
        y = torch.randint(0, 10, (n,), generator=generator)
        return DataLoader(dataset(x, y), batch_size=w.batch_size, shuffle=False, pin_memory=pin)

    return loader(w.train_samples), loader(w.val_samples)


def fresh_model(w: Workload, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    torch.manual_seed(SEED)
    net = w.make_net().to(device)
    return net, torch.optim.SGD(net.parameters(), lr=0.01), nn.CrossEntropyLoss()


def lean_handlers() -> list:
    """With ``default_handlers=False`` fit adds only Stopping and GradientUpdate; metrics are asked for."""
    return [MetricHandler()]


def hand_loop(
    net: nn.Module,
    opt: torch.optim.Optimizer,
    criterion: nn.Module,
    train: DataLoader,
    val: DataLoader | None,
    epochs: int,
    device: str = "cpu",
) -> float:
    """Plain PyTorch: sums stay on the device; the host reads them once per epoch."""
    blocking = torch.device(device).type != "cuda"
    for _ in range(epochs):
        net.train()
        loss_sum, correct, seen = torch.zeros((), device=device), torch.zeros((), dtype=torch.long, device=device), 0
        for x, y in train:
            x, y = x.to(device, non_blocking=not blocking), y.to(device, non_blocking=not blocking)
            out = net(x)
            loss = criterion(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach() * x.shape[0]
            correct += (out.argmax(1) == y).sum()
            seen += x.shape[0]
        train_loss, _train_acc = loss_sum.item() / seen, correct.item() / seen
        if val is not None:
            net.eval()
            val_sum, val_correct = torch.zeros((), device=device), torch.zeros((), dtype=torch.long, device=device)
            val_seen = 0
            with torch.no_grad():
                for x, y in val:
                    x, y = x.to(device, non_blocking=not blocking), y.to(device, non_blocking=not blocking)
                    out = net(x)
                    val_sum += criterion(out, y) * x.shape[0]
                    val_correct += (out.argmax(1) == y).sum()
                    val_seen += x.shape[0]
            _val_loss, _val_acc = val_sum.item() / val_seen, val_correct.item() / val_seen
    return train_loss


def prepare(variant: str, w: Workload, train: DataLoader, val: DataLoader, device: str = "cpu") -> Callable[[], float]:
    """A fresh run of ``variant`` (same seed every time: identical initial weights for every variant),
    as a call returning the final training loss; building it is not part of what is measured."""
    net, opt, criterion = fresh_model(w, device)
    if variant.startswith("hand"):
        held_out = val if variant == "hand + val" else None
        return lambda: hand_loop(net, opt, criterion, train, held_out, w.epochs, device)
    est = Estimator(net, criterion, train_metrics="accuracy", optimizer=opt, device=device)
    if variant == "fit default":
        return lambda: est.fit(train, val_data=val, epochs=w.epochs)["train_loss"][-1]
    handlers = lean_handlers()
    return lambda: est.fit(train, epochs=w.epochs, event_handlers=handlers, default_handlers=False)["train_loss"][-1]


def run_variant(
    variant: str, w: Workload, train: DataLoader, val: DataLoader, device: str = "cpu"
) -> tuple[float, float, float]:
    """(wall s, process CPU s, final train loss) of one run; only the loop / the fit call is timed."""
    run = prepare(variant, w, train, val, device)
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()  # the run starts with the GPU idle (it ends with the loops' own reads)
    wall, cpu = time.perf_counter(), time.process_time()
    loss = run()
    return time.perf_counter() - wall, time.process_time() - cpu, loss


def host_reads(w: Workload, train: DataLoader, val: DataLoader, device: str = "cpu") -> dict[str, int]:
    """Reads of device values to the host (``aten._local_scalar_dense``) in one run of each variant,
    counted by a dispatch mode in a separate, untimed run (a sync each on a GPU)."""
    counts = {}
    for variant in VARIANTS:
        with HostReadCounter() as reads:
            run_variant(variant, w, train, val, device)
        counts[variant] = reads.count
    return counts


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_in_use() -> Callable[[], int] | None:
    """Bytes the C allocator has handed out and not taken back (glibc ``mallinfo2``), or None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd  # small blocks in use + large (mmapped) blocks

    return in_use


def measure_peak(variant: str, w: Workload, train: DataLoader, val: DataLoader, device: str = "cpu") -> int | None:
    """Bytes by which the memory in use peaked above its level at the start of one run of ``variant``:
    on CUDA ``torch.cuda.max_memory_allocated``; on CPU the C allocator's bytes in use (glibc
    ``mallinfo2``), sampled every 0.2 ms by a thread that runs while torch's kernels release the GIL.
    Bytes in use, unlike the resident set, do not depend on what the allocator caches. None where
    neither is available."""
    run = prepare(variant, w, train, val, device)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        return torch.cuda.max_memory_allocated() - before
    in_use = _malloc_in_use()
    if in_use is None:
        return None
    before = in_use()
    peak, running = [before], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], in_use())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the sampler gets its turns in a run shorter than the default 5 ms slice
    sampler.start()
    try:
        run()
    finally:
        running[0] = False
        sampler.join()
        sys.setswitchinterval(switch)
    return max(peak[0], in_use()) - before


def dispatch_cost() -> dict:
    """``benchmarks/dispatch.py``'s measurement: 0, 10 and 50 no-op handlers on one event."""
    spec = importlib.util.spec_from_file_location("dispatch_benchmark", Path(__file__).with_name("dispatch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure([0, 10, 50], batches=20000, repeats=7)


def handler_chains(val: DataLoader) -> dict[str, str]:
    """The batch_end chain of each fit variant; exits if a progress bar slipped into the defaults."""

    def chain(handlers: list) -> str:
        line = next(text for text in Dispatcher(handlers).describe().splitlines() if text.startswith("batch_end"))
        return line.split(None, 1)[1]

    default = fitforge.handlers.defaults.fit_handlers(None, val)  # what fit(val_data=val) runs
    if any(isinstance(h, ProgressBarHandler) for h in default):
        sys.exit("a ProgressBarHandler is among the default handlers; the benchmark would time a bar")
    lean = fitforge.handlers.defaults.fit_handlers(lean_handlers(), None, default_handlers=False)
    return {"fit default": chain(default), "fit lean": chain(lean)}


def bench(key: str, repeats: int, fraction: float, device: str = "cpu", sample_reads: bool = False) -> dict:
    w = WORKLOADS[key]
    repeats = max(repeats, MIN_REPEATS.get(key, 1))
    train, val = make_loaders(w, fraction, device, sample_reads)
    wall, cpu = {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}  # seconds per repeat
    losses = {v: run_variant(v, w, train, val, device)[2] for v in VARIANTS}  # warm-up, also a parity check
    for r in range(repeats):
        # Paired runs stay adjacent; which pair goes first, and fit/hand order in a pair, alternate.
        pairs = [PAIRS[0], PAIRS[1]] if r % 2 == 0 else [PAIRS[1], PAIRS[0]]
        for fit, hand in pairs:
            for variant in (fit, hand) if (r // 2) % 2 == 0 else (hand, fit):
                seconds, cpu_seconds, _ = run_variant(variant, w, train, val, device)
                wall[variant].append(seconds)
                cpu[variant].append(cpu_seconds)
    steps = w.epochs * len(train)

    def compare(fit: str, hand: str) -> dict:
        ratios = [f / h for f, h in zip(wall[fit], wall[hand])]
        return {
            "paired_ratio_median": statistics.median(ratios),
            "paired_ratio_min": min(ratios),
            "paired_ratio_max": max(ratios),
            "cpu_paired_ratio_median": statistics.median(f / h for f, h in zip(cpu[fit], cpu[hand])),
            "overhead_us_per_step": (min(wall[fit]) - min(wall[hand])) / steps * 1e6,
            "fixed_cost_us_per_fit": statistics.median(f - h for f, h in zip(wall[fit], wall[hand])) * 1e6,
            "cpu_overhead_us_per_step": (min(cpu[fit]) - min(cpu[hand])) / steps * 1e6,
        }

    return {
        "workload": key,
        "device": device,
        "title": w.title,
        "steps": steps,
        "epochs": w.epochs,
        "train_batches_per_epoch": len(train),
        "val_batches_per_epoch": len(val),
        "batch_size": w.batch_size,
        "repeats": repeats,
        "sample_reads": sample_reads,
        "handlers": handler_chains(val),
        "median_s": {v: statistics.median(t) for v, t in wall.items()},
        "min_s": {v: min(t) for v, t in wall.items()},
        "median_cpu_s": {v: statistics.median(t) for v, t in cpu.items()},
        "final_train_loss": losses,
        "wall_s": wall,
        "cpu_s": cpu,
        "host_reads": host_reads(w, train, val, device),
        "peak_memory_bytes": {v: measure_peak(v, w, train, val, device) for v in VARIANTS},
        "default": compare("fit default", "hand + val"),
        "lean": compare("fit lean", "hand"),
    }


def print_report(res: dict) -> None:
    print(
        f"\nWorkload {res['workload']}: {res['title']} - {res['steps']} training steps "
        f"({res['epochs']} epoch(s) x {res['train_batches_per_epoch']} batches of {res['batch_size']}), "
        f"{res['val_batches_per_epoch']} val batches/epoch, {res['repeats']} paired repeats"
    )
    for name, line in res["handlers"].items():
        print(f"  {name:<12} batch_end: {line}")
    print(f"  {'variant':<12} {'median s':>9} {'min s':>9} {'us/step':>8} {'median cpu s':>13}")
    for v in VARIANTS:
        med = res["median_s"][v]
        print(
            f"  {v:<12} {med:9.4f} {res['min_s'][v]:9.4f} {med / res['steps'] * 1e6:8.1f} "
            f"{res['median_cpu_s'][v]:13.4f}"
        )
    for label, key in (("default vs hand + val", "default"), ("lean vs hand", "lean")):
        c = res[key]
        print(
            f"  {label:<22} paired ratio median {c['paired_ratio_median']:.3f}x "
            f"(range {c['paired_ratio_min']:.3f}-{c['paired_ratio_max']:.3f}), "
            f"overhead {c['overhead_us_per_step']:+.1f} us/step (fastest runs), "
            f"{'fixed cost' if res['sample_reads'] else 'fit - hand'} {c['fixed_cost_us_per_fit']:+.0f} us/fit "
            "(median of pairs)"
        )
        print(
            f"  {'':<22} CPU time: paired ratio median {c['cpu_paired_ratio_median']:.3f}x, "
            f"overhead {c['cpu_overhead_us_per_step']:+.1f} us/step"
        )
    losses = res["final_train_loss"]
    same = all(abs(v - losses["hand"]) <= 1e-4 * abs(losses["hand"]) for v in losses.values())
    reads = res["host_reads"]
    print(
        f"  host reads in one run of {res['epochs']} epoch(s), {res['steps']} steps: "
        + ", ".join(f"{v} {n}" for v, n in reads.items())
        + " (none per batch: tests/handlers/test_host_reads.py)"
    )
    peaks = res["peak_memory_bytes"]
    if all(peaks.values()):
        print(
            "  peak memory in use above the start of the run: "
            + ", ".join(f"{v} {n / 2**10:,.0f} KiB" for v, n in peaks.items())
            + f"; fit default / hand + val {peaks['fit default'] / peaks['hand + val']:.3f}x, "
            f"fit lean / hand {peaks['fit lean'] / peaks['hand']:.3f}x"
        )
    else:
        print(f"  peak memory: not measurable here ({peaks})")
    print(
        f"  parity: final train loss {losses['hand']:.6f} by hand, "
        f"{'identical (rel 1e-4) in all variants' if same else 'DIFFERS: ' + str(losses)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--workload", choices=["A", "B", "Z", "both", "all"], default="both", help="both: A and B; all: A, B and Z"
    )
    parser.add_argument("--repeats", type=int, default=11, help="paired repeats after a warm-up (default 11)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 repeats, 1/8 of the data")
    parser.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    parser.add_argument("--device", default="cpu", help="where both loops train: cpu (default) or cuda")
    parser.add_argument(
        "--sample-reads", action="store_true", help="fit reads the batches sample by sample, as the hand loop"
    )
    args = parser.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    repeats, fraction = (3, 1 / 8) if args.quick else (args.repeats, 1.0)

    torch.set_num_threads(1)
    # Silence fit's per-epoch INFO lines; the LoggingHandler itself stays in the default handler set.
    logging.getLogger("fitforge").setLevel(logging.WARNING)
    keys = {"both": ["A", "B"], "all": ["A", "B", "Z"]}.get(args.workload, [args.workload])
    # The progress bar is a default only on a terminal/notebook (handlers.defaults.interactive());
    # force it off so a run from a TTY times the same handlers as one under CI or a pipe.
    with mock.patch.object(fitforge.handlers.defaults, "interactive", lambda: False):
        results = [bench(k, repeats, fraction, args.device, args.sample_reads) for k in keys]
    dispatch = dispatch_cost()
    if args.json:
        print(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "device": args.device,
                    "gpu": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else None,
                    "quick": args.quick,
                    "sample_reads": args.sample_reads,
                    "results": results,
                    "dispatch": dispatch,
                },
                indent=2,
            )
        )
        return
    print(
        f"fitforge fit() overhead, torch {torch.__version__}, {torch.get_num_threads()} thread, "
        + (torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "CPU")
        + (" [QUICK: 1/8 data]" if args.quick else "")
        + (" [fit reads batches sample by sample]" if args.sample_reads else "")
    )
    for res in results:
        print_report(res)
    per_call = ", ".join(f"{n} handlers {ns:.0f} ns" for n, ns in dispatch["ns_per_handler_call"].items())
    print(
        f"\nDispatch (benchmarks/dispatch.py): loop {dispatch['ns_per_batch_without_handlers']:.0f} ns per batch "
        f"without handlers; per no-op handler call: {per_call}"
    )


if __name__ == "__main__":
    main()

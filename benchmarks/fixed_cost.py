"""Where the fixed cost of a fit goes: workload Z of ``overhead.py`` (one train and one val batch of
64, read sample by sample) timed with parts of fit switched off, against the hand loop + validation.

Each row switches off one part of what fit does besides the hand loop's work, by replacing the
function that does it (in the module that calls it) with one that does nothing, and times fit and
the hand loop in interleaved pairs as ``overhead.py`` does (a ``gc.collect()`` before every run,
so every run starts with cold caches, as a script's single ``fit`` does). ``base`` is fit as it is,
measured first and last (its two rows show the machine's drift). ``warm`` repeats ``base``
without the collection: the same code with warm caches.

    OMP_NUM_THREADS=1 python benchmarks/fixed_cost.py                # every row, 151 pairs each
    OMP_NUM_THREADS=1 python benchmarks/fixed_cost.py val_check all_checks --pairs 301

The rows are a measurement, not a mode of fit: a fit with a check switched off is one the
standards do not allow (see docs/performance.md, "The fixed cost of a fit").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _no_context(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


# row -> [(module, name, replacement)]: what the row switches off, where fit looks it up
PARTS: dict[str, list[tuple[str, str, Callable]]] = {
    "val_check": [("fitforge.plans.fit", "check_first_val_batch", lambda *args: False)],
    "model_checks": [
        ("fitforge.plans.fit", "check_placement", _nothing),
        ("fitforge.plans.fit", "check_trainable", _nothing),
    ],
    "first_batch_check": [("fitforge.plans.fit", "first_batch_check", lambda step, *args: step)],
    "handler_checks": [
        ("fitforge.checks.first_batch", "check_handlers", _nothing),
        ("fitforge.checks.validation", "check_handlers", _nothing),
    ],
    "finite_checks": [
        ("fitforge.checks.first_batch", "check_finite", _nothing),
        ("fitforge.checks.validation", "check_finite", _nothing),
    ],
    "monitor_checks": [("fitforge.plans.fit", "check_monitors", lambda *args: [])],
    "rng_kept": [("fitforge.checks.validation", "torch_rng_kept", _no_context)],
    "preemption": [("fitforge.estimator", "preemptible", _no_context)],
}
PARTS["all_checks"] = [
    part
    for row in ("val_check", "model_checks", "first_batch_check", "handler_checks", "finite_checks", "monitor_checks")
    for part in PARTS[row]
]


@contextlib.contextmanager
def switched_off(row: str):
    """``row``'s parts replaced by nothing for the duration (restored after)."""
    saved = []
    try:
        for module_name, name, replacement in PARTS[row]:
            module = importlib.import_module(module_name)
            saved.append((module, name, getattr(module, name)))  # an AttributeError: the part moved
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def pairs(count: int, collect: bool = True) -> dict[str, float]:
    """Median paired ratio fit default / hand + val on workload Z, and the medians in microseconds."""
    workload = overhead.WORKLOADS["Z"]
    train, val = overhead.make_loaders(workload, 1.0, sample_reads=True)
    fit_s, hand_s = [], []
    for i in range(count):
        times = {}
        for variant in ("fit default", "hand + val") if i % 2 else ("hand + val", "fit default"):
            run = overhead.prepare(variant, workload, train, val)
            if collect:
                gc.collect()
            start = time.perf_counter()
            run()
            times[variant] = time.perf_counter() - start
        fit_s.append(times["fit default"])
        hand_s.append(times["hand + val"])
    return {
        "ratio": statistics.median(f / h for f, h in zip(fit_s, hand_s)),
        "fit_us": statistics.median(fit_s) * 1e6,
        "hand_us": statistics.median(hand_s) * 1e6,
        "fixed_us": statistics.median(f - h for f, h in zip(fit_s, hand_s)) * 1e6,
    }


def measure(rows: list[str], count: int) -> Iterator[tuple[str, dict[str, float]]]:
    """``base``, each row, ``base`` again: each as it is measured."""
    yield "base", pairs(count)
    for row in rows:
        if row == "warm":
            yield row, pairs(count, collect=False)
            continue
        with switched_off(row):
            yield row, pairs(count)
    yield "base", pairs(count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", help=f"rows to measure, of warm, {', '.join(PARTS)} (default: all)")
    parser.add_argument("--pairs", type=int, default=151, help="interleaved pairs per row (default 151)")
    args = parser.parse_args()
    unknown = [row for row in args.rows if row != "warm" and row not in PARTS]
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from warm, {', '.join(PARTS)}")
    torch.set_num_threads(1)
    logging.getLogger("fitforge").setLevel(logging.WARNING)
    rows = args.rows or ["warm", *PARTS]
    print(f"Workload Z read sample by sample, {args.pairs} pairs per row, torch {torch.__version__}, 1 thread")
    print(f"  {'switched off':<18} {'fit/hand':>8} {'fit us':>8} {'hand us':>8} {'fixed us':>9}")
    for row, result in measure(rows, args.pairs):
        print(
            f"  {row:<18} {result['ratio']:>7.3f}x {result['fit_us']:>8.0f} {result['hand_us']:>8.0f} "
            f"{result['fixed_us']:>+9.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

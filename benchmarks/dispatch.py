"""Dispatch cost per handler: the loop's own epoch with 0, 10 and 50 no-op ``batch_end`` handlers.

The step does no tensor work, so what is timed is fitforge's loop and event dispatch alone; the
cost per handler call is the slope ``(t(n) - t(0)) / (n * batches)``. It should be flat: a handler
costs one Python call per event it implements, whatever the number of handlers.

    python benchmarks/dispatch.py                 # 0, 10 and 50 handlers, 20000 batches, 7 repeats
    python benchmarks/dispatch.py --json
"""

from __future__ import annotations

import argparse
import json
import time

from torch import nn

from fitforge import BatchOutput, Estimator, TrainState
from fitforge.core.dispatch import Dispatcher
from fitforge.core.loop import run_pass
from fitforge.core.run import RunContext
from fitforge.events import BatchEnd
from fitforge.inputs.order import OnePass


class NoOp(BatchEnd):
    def batch_end(self, state: TrainState) -> None:
        pass


def epoch_seconds(handlers: int, batches: int, repeats: int) -> float:
    """The fastest of ``repeats`` epochs of ``batches`` empty steps with ``handlers`` no-op handlers."""
    estimator = Estimator(nn.Linear(1, 1), nn.MSELoss(), optimizer="sgd", device="cpu")
    dispatcher = Dispatcher([NoOp() for _ in range(handlers)])
    output = BatchOutput((), None, None, None, (), 1)
    data = [None] * batches
    best = float("inf")
    for _ in range(repeats):
        state = TrainState(estimator, "validate")  # a pass with no history or optimizer bookkeeping
        started = time.perf_counter()
        step = lambda state, batch: output  # noqa: E731  # the same step, checked or not
        run_pass(state, RunContext(dispatcher, step, OnePass(data), "data", step))
        best = min(best, time.perf_counter() - started)
    return best


def measure(counts: list[int], batches: int, repeats: int) -> dict:
    seconds = {n: epoch_seconds(n, batches, repeats) for n in counts}
    base = seconds[counts[0]]
    per_call = {n: (seconds[n] - base) / (n * batches) * 1e9 for n in counts if n}
    return {
        "batches": batches,
        "repeats": repeats,
        "epoch_seconds": seconds,
        "ns_per_handler_call": per_call,
        "ns_per_batch_without_handlers": base / batches * 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handlers", type=int, nargs="+", default=[0, 10, 50])
    parser.add_argument("--batches", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(sorted(set([0, *args.handlers])), args.batches, args.repeats)
    if args.json:
        print(json.dumps(result))
        return
    print(f"loop without handlers: {result['ns_per_batch_without_handlers']:.0f} ns per batch")
    for n, cost in result["ns_per_handler_call"].items():
        print(f"{n:3d} no-op batch_end handlers: {cost:.0f} ns per handler call")


if __name__ == "__main__":
    main()

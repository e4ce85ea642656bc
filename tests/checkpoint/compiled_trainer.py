"""A compiled fit in its own process, for tests/checkpoint/test_compile_cache.py:

    python compiled_trainer.py FOLDER OUT [KILL_AT]

Trains a small MLP with Estimator(compile=True) for 2 epochs of 4 batches, saving every 2 batches and resuming
from FOLDER's newest checkpoint; SIGKILLs itself at the end of global step KILL_AT. Writes to OUT the seconds
from the fit's call to its first batch's end, Inductor's FX graph cache hits and misses, and the weights."""

import os
import signal
import sys
import time

import torch
from torch import nn

from fitforge import Estimator
from fitforge.handlers import CheckpointHandler, LambdaHandler


def main(folder, out, kill_at=None):
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer="sgd", compile=True, device="cpu")
    first = []

    def batch_end(state):
        if not first:
            first.append(time.perf_counter() - started)
        if state.global_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    handlers = [CheckpointHandler(folder, batch_period=2, resume_from_checkpoint=True),
                LambdaHandler(batch_end=batch_end, priority=5000)]  # fmt: skip
    started = time.perf_counter()
    estimator.fit([(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)], epochs=2, event_handlers=handlers)
    counters = torch._dynamo.utils.counters["inductor"]
    torch.save({"first_step_s": first[0], "hits": counters["fxgraph_cache_hit"],
                "misses": counters["fxgraph_cache_miss"], "weights": net.state_dict()}, out)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)

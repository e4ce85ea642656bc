"""Shared helpers for the tests (importable as ``helpers``)."""

import importlib.util
import math
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

from fitforge import Estimator
from fitforge.events import BatchEnd

TIME_KEYS = ("time_step_s", "time_data_s", "time_handlers_s")  # the seconds by cause every History row holds


def regression_batches(n_batches=3, batch_size=4, seed=0):
    """A list of (x, y) batches for y = 2x + 3."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        x = torch.rand(batch_size, 1, generator=g)
        batches.append((x, 2 * x + 3))
    return batches


def checkpoint_files(folder):
    """The names of the files in ``folder``, sorted, the run's ``manifest.json`` (written beside them) aside."""
    return sorted(path.name for path in Path(folder).iterdir() if path.name != "manifest.json")


def make_estimator(**kwargs):
    net = kwargs.pop("net", None) or nn.Linear(1, 1)
    kwargs.setdefault("optimizer", torch.optim.SGD(net.parameters(), lr=0.1))
    kwargs.setdefault("device", "cpu")
    return Estimator(net, kwargs.pop("loss", nn.MSELoss()), **kwargs)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    """Import ``examples/<name>.py`` as a module (the examples folder goes on sys.path, as when the
    script runs, so it can import its neighbours ``data`` and ``common``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` as a module, to call its measuring functions on tiny inputs."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Losses(BatchEnd):
    """Every batch's loss, by global step (a host read per batch: fine in a test)."""

    def __init__(self):
        self.seen = {}

    def batch_end(self, state):
        self.seen[state.global_step] = state.output.loss.item()


class KillAt(BatchEnd):
    """SIGKILL this process at the end of global step ``step`` (after that batch's checkpoint, if any)."""

    priority = 5000  # after the CheckpointHandler's batch_end

    def __init__(self, step):
        self.step = step

    def batch_end(self, state):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class Crash(BatchEnd):
    """Fail right after the checkpoint of batch number ``at`` (1-based) was written."""

    priority = 950  # after CheckpointHandler (900)

    def __init__(self, at):
        self.at = at

    def batch_end(self, state):
        if state.global_step + 1 == self.at:
            raise RuntimeError("crash")


class NanGradient(torch.autograd.Function):
    """The identity forward; a nan gradient backward: the loss stays finite, the gradients do not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.nan


# Token tagging with padding, for accumulation weighted by items (tests/handlers, tests/distributed).
PAD, VOCAB, CLASSES = -100, 11, 5  # the ignored label, the tokens, the tags
LENGTHS = [(3, 1), (9, 4), (5, 5), (7, 2)]  # per batch of 2 sequences: padded length, last real tokens of the 2nd


class Tagger(nn.Module):
    """One class per token, each from its own token alone: padding changes no other position."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(VOCAB, 8), nn.Linear(8, CLASSES)

    def forward(self, tokens):
        return self.out(self.embed(tokens)).permute(0, 2, 1)  # (N, C, L), as CrossEntropyLoss takes it


def tagged_batches():
    generator = torch.Generator().manual_seed(1)
    batches = []
    for length, real in LENGTHS:
        tokens = torch.randint(0, VOCAB, (2, length), generator=generator)
        tags = torch.randint(0, CLASSES, (2, length), generator=generator)
        tags[1, real:] = PAD  # the second sequence is shorter
        batches.append((tokens, tags))
    return batches


def padded_together(batches, pad_input=0):
    width = max(tokens.shape[1] for tokens, _ in batches)
    tokens = torch.cat([nn.functional.pad(t, (0, width - t.shape[1]), value=pad_input) for t, _ in batches])
    tags = torch.cat([nn.functional.pad(y, (0, width - y.shape[1]), value=PAD) for _, y in batches])
    return tokens, tags

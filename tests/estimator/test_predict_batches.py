"""Streaming predictions (``predict_batches``) and predict's memory: the outputs of predict, batch by
batch and in order, none kept; predict's own outputs written once into tensors of the whole size."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.events import BatchBegin, BatchEnd, EpochBegin, EpochEnd
from fitforge.exceptions import CancelBatch

torch.manual_seed(0)
X = torch.randn(50, 4)


class Outputs(nn.Module):
    """Returns its scores as a tensor, a (scores, embedding) tuple or a dict of them."""

    def __init__(self, kind="tensor"):
        super().__init__()
        self.linear, self.kind = nn.Linear(4, 3), kind

    def forward(self, x):
        scores = self.linear(x)
        if self.kind == "tuple":
            return scores, x.sum(1, keepdim=True)
        if self.kind == "dict":
            return {"scores": scores, "ids": x.argmax(1)}
        return scores


def estimator(kind="tensor"):
    return Estimator(Outputs(kind), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")


def same(a, b):
    if isinstance(a, tuple):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


def joined(parts):
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column) for column in zip(*parts))
    if isinstance(parts[0], dict):
        return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    return torch.cat(parts)


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict"])
@pytest.mark.parametrize(
    "data, options, batches",
    [
        (lambda: DataLoader(TensorDataset(X), batch_size=16), {}, 4),
        (lambda: DataLoader(TensorDataset(X, torch.zeros(50)), batch_size=16, drop_last=True), {}, 3),
        (lambda: [X[:20], X[20:]], {}, 2),
        (lambda: X, {"batch_size": 16}, 4),
    ],
    ids=["loader", "drop_last", "list", "array"],
)
def test_predict_batches_gives_predicts_outputs_batch_by_batch(kind, data, options, batches):
    est = estimator(kind)
    parts = list(est.predict_batches(data(), **options))
    assert len(parts) == batches
    assert same(joined(parts), est.predict(data(), **options))


def test_it_computes_a_batch_only_when_asked_and_leaves_the_modes_alone_in_between():
    read = []

    class Recorded:
        def __iter__(self):
            for i in range(3):
                read.append(i)
                yield X[i * 10 : (i + 1) * 10]

        def __len__(self):
            return 3

    est = estimator()
    est.net.train()
    stream = est.predict_batches(Recorded())
    assert read == []  # a generator: nothing runs before the first output is asked for
    first = next(stream)
    assert read == [0] and first.shape == (10, 3) and not first.requires_grad
    assert est.net.training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert [part.shape[0] for part in stream] == [10, 10] and read == [0, 1, 2]


def test_handlers_see_the_pass_and_a_loop_left_early_ends_it_there():
    events = []

    class Seen(EpochBegin, BatchEnd, EpochEnd):
        def epoch_begin(self, state):
            events.append("begin")

        def batch_end(self, state):
            events.append(state.batch_idx)

        def epoch_end(self, state):
            events.append("end")

    est = estimator()
    list(est.predict_batches(DataLoader(TensorDataset(X), batch_size=16), event_handlers=[Seen()]))
    assert events == ["begin", 0, 1, 2, 3, "end"]
    events.clear()
    for _ in est.predict_batches(DataLoader(TensorDataset(X), batch_size=16), event_handlers=[Seen()]):
        break
    assert events == ["begin", 0]  # left after the first batch: no epoch_end
    assert est.net.training  # and the modes are back


def test_predict_with_a_cancelled_batch_and_fewer_rows_than_the_loader_holds():
    class CancelFirst(BatchBegin):
        def batch_begin(self, state):
            if state.batch_idx == 0:
                raise CancelBatch

    est = estimator()
    loader = DataLoader(TensorDataset(X), batch_size=16)
    whole = est.predict(loader)
    assert whole.shape == (50, 3) and torch.allclose(whole, est.net(X).detach(), rtol=0, atol=1e-6)  # in batches
    fewer = est.predict(loader, event_handlers=[CancelFirst()])
    assert torch.equal(fewer, whole[16:])  # 34 of the 50 rows the outputs were sized for


def test_outputs_that_change_shape_or_dtype_between_batches_are_still_joined():
    class Changing(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            out = self.linear(x)
            return out.double() if x.shape[0] == 2 else out  # the last batch (50 = 3 x 16 + 2)

    est = Estimator(Changing(), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    result = est.predict(DataLoader(TensorDataset(X), batch_size=16))
    assert result.shape == (50, 3) and result.dtype == torch.float64  # torch.cat's promotion, as before


MEASURE = """
import resource, sys, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from fitforge import Estimator
torch.manual_seed(0)
rows, width, batch = 500_000, 64, 4096
x = torch.randn(rows, 8)
est = Estimator(nn.Linear(8, width), nn.MSELoss(), optimizer="sgd", device="cpu")
loader = DataLoader(TensorDataset(x), batch_size=batch)
est.predict(DataLoader(TensorDataset(x[: 4 * batch]), batch_size=batch))  # warm: allocator, code
for _ in est.predict_batches(DataLoader(TensorDataset(x[: 4 * batch]), batch_size=batch)):
    pass
start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[1] == "stream":
    total = 0
    for out in est.predict_batches(loader):
        total += out.shape[0]
    assert total == rows
else:
    out = est.predict(loader)
    assert out.shape == (rows, width)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) * 1024)
"""


@pytest.mark.integration  # a fresh process, for its own peak memory
@pytest.mark.parametrize("mode", ["stream", "predict"])
def test_peak_memory_of_500k_rows_measured_in_a_subprocess(mode):
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEASURE), mode], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    growth = int(result.stdout.split()[-1])
    output, batch_output, mib = 500_000 * 64 * 4, 4096 * 64 * 4, 2**20
    if mode == "stream":
        assert growth < 2 * batch_output + 64 * mib, growth / mib
    else:
        assert growth < 1.5 * output + 64 * mib, growth / mib


@pytest.mark.parametrize("data", [lambda: X, lambda: [X[:20], X[20:]]], ids=["into the whole size", "joined"])
def test_outputs_are_ordinary_tensors_autograd_and_in_place_edits_take(data):
    est = estimator()
    for outputs in [
        est.predict(data(), batch_size=16) if isinstance(data(), torch.Tensor) else est.predict(data())
    ] + list(
        est.predict_batches(data(), batch_size=16) if isinstance(data(), torch.Tensor) else est.predict_batches(data())
    ):
        assert not outputs.is_inference()
        outputs.add_(1)  # in place: refused on an inference tensor
        nn.functional.mse_loss(nn.Linear(4, 3)(X[: len(outputs)]), outputs).backward()  # saved for backward


def test_named_outputs_whose_order_changes_are_joined_by_name():
    class Alternating(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):
            ones, twos = torch.ones(len(x), 1) * self.scale, torch.full((len(x), 1), 2.0) * self.scale
            return {"a": ones, "b": twos} if int(x[0, 0]) % 2 == 0 else {"b": twos, "a": ones}

    data = torch.arange(8.0).repeat_interleave(2).view(-1, 1).repeat(1, 4)  # batches of 2 alternate the order
    est = Estimator(Alternating(), nn.MSELoss(), optimizer="sgd", device="cpu")
    out = est.predict(data, batch_size=2)
    assert torch.equal(out["a"], torch.ones(16, 1)) and torch.equal(out["b"], torch.full((16, 1), 2.0))


def test_fewer_rows_than_expected_keep_no_unused_storage():
    class Summary(nn.Module):  # one row per batch, not one per sample
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 256)

        def forward(self, x):
            return self.linear(x).mean(0, keepdim=True)

    est = Estimator(Summary(), nn.MSELoss(), optimizer="sgd", device="cpu")
    out = est.predict(DataLoader(TensorDataset(X), batch_size=10))
    assert out.shape == (5, 256) and out.untyped_storage().nbytes() == 5 * 256 * 4


def test_predict_batches_checks_its_data_at_the_first_next_as_a_generator_does():
    from fitforge.exceptions import FitforgeTypeError

    outputs = Estimator(nn.Linear(2, 1), nn.MSELoss(), device="cpu").predict_batches(5)  # nothing checked yet
    with pytest.raises(FitforgeTypeError):
        next(outputs)

"""Batches of a DataLoader over a TensorDataset read by indexing: the loader's own batches, in its
order, with every generator left where the loader leaves it; any other data iterated as it is."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, SubsetRandomSampler, TensorDataset, WeightedRandomSampler

from fitforge import Estimator
from fitforge.core.indexed import indexed_batches, readable


def tensors(n=37):
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randn(n, 3, 4, generator=generator),
        torch.randint(0, 5, (n,), generator=generator),
        torch.rand(n, 2, generator=generator).to(torch.float16),
        torch.rand(n, generator=generator) > 0.5,
    )


def same_batches(first, second):
    assert type(first) is type(second) is list
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)


def compare(make_loader, passes=2):
    """Passes over one loader as torch reads it, then over a twin read by indexing, from the same
    global RNG state: the same batches, and the same generators' states after each pass."""
    results = []
    for read in (lambda loader: loader, indexed_batches):
        torch.manual_seed(1)
        loader = make_loader()
        seen = []
        for _ in range(passes):
            seen.append(list(read(loader)))
            seen.append(("rng", torch.get_rng_state(), loader.generator and loader.generator.get_state()))
        results.append(seen)
    torch_passes, indexed_passes = results
    assert len(torch_passes) == len(indexed_passes)
    for mine, theirs in zip(indexed_passes, torch_passes):
        if isinstance(theirs, tuple):
            assert torch.equal(mine[1], theirs[1])
            assert (mine[2] is None) == (theirs[2] is None) and (mine[2] is None or torch.equal(mine[2], theirs[2]))
            continue
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            same_batches(a, b)


@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 8},
        {"batch_size": 8, "shuffle": True},
        {"batch_size": 8, "shuffle": True, "generator": "own"},
        {"batch_size": 5, "drop_last": True, "shuffle": True},
        {"batch_size": 64},
    ],
    ids=["in order", "shuffled", "own generator", "drop_last", "one batch"],
)
def test_batches_and_generators_are_the_loaders(options):
    def make():
        kwargs = dict(options)
        if kwargs.get("generator") == "own":
            kwargs["generator"] = torch.Generator().manual_seed(3)
        return DataLoader(TensorDataset(*tensors()), **kwargs)

    assert readable(make())
    compare(make)


def test_other_samplers_and_batch_samplers_are_followed():
    data = tensors()
    weights = torch.rand(37, generator=torch.Generator().manual_seed(2))
    compare(lambda: DataLoader(TensorDataset(*data), batch_size=6, sampler=WeightedRandomSampler(weights, 20)))
    compare(lambda: DataLoader(TensorDataset(*data), batch_size=4, sampler=SubsetRandomSampler(range(3, 30))))
    # a batch sampler of the user's: negative indices, numpy integers, 0-d tensors, a tuple
    batches = [[0, -1, 5], [np.int64(2), np.int64(7)], [torch.tensor(4), torch.tensor(1)], (3, 6)]
    compare(lambda: DataLoader(TensorDataset(*data), batch_sampler=batches))


def test_a_batch_that_is_not_integer_indices_fails_as_the_loader_fails():
    data = TensorDataset(*tensors())
    for batches in ([[1.0, 2.0]], [[]], [[True, False]]):
        loader = DataLoader(data, batch_sampler=batches)
        with pytest.raises(Exception) as theirs:
            list(loader)
        with pytest.raises(type(theirs.value)):
            list(indexed_batches(loader))
    loader = DataLoader(data, batch_sampler=[[0, 99]])
    with pytest.raises(IndexError, match="out of bounds"):
        list(indexed_batches(loader))


class Rows(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(2), torch.tensor(i)


class OwnLoader(DataLoader):
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda data: OwnLoader(data, batch_size=2),
        lambda data: DataLoader(data, batch_size=2, num_workers=1),
        lambda data: DataLoader(data, batch_size=2, pin_memory=True),
        lambda data: DataLoader(data, batch_size=2, collate_fn=lambda rows: rows),
        lambda data: DataLoader(data, batch_size=None),
        lambda data: DataLoader(data, batch_size=2, timeout=1),
        lambda data: DataLoader(Rows(), batch_size=2),
        lambda data: DataLoader(TensorDataset(torch.randn(3, 4).t()), batch_size=2),  # not contiguous
        lambda data: DataLoader(TensorDataset(torch.randn(4, 2).to_sparse()), batch_size=2),
        lambda data: [(torch.zeros(2), torch.zeros(2))],
    ],
    ids=["subclass", "workers", "pinned", "collate", "no batching", "timeout", "dataset", "strided", "sparse", "list"],
)
def test_other_data_is_iterated_as_it_is(make):
    data = make(TensorDataset(torch.randn(4, 2), torch.arange(4)))
    assert not readable(data)
    assert indexed_batches(data) is data


def test_the_profiler_shows_the_reads():
    loader = DataLoader(TensorDataset(*tensors()), batch_size=8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        batches = list(indexed_batches(loader))
    reads = [event for event in profile.events() if event.name == "enumerate(DataLoader)#fitforge.indexed_batches"]
    assert len(reads) == len(batches) == 5


def fit_history(loader):
    """A shuffled fit with validation on loaders of class ``loader``."""
    torch.manual_seed(0)
    x, y = torch.randn(96, 6), torch.randint(0, 3, (96,))
    train = loader(TensorDataset(x[:64], y[:64]), batch_size=16, shuffle=True)
    val = loader(TensorDataset(x[64:], y[64:]), batch_size=16)
    net = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3))  # dropout draws from the global RNG
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    history = est.fit(train, val_data=val, epochs=3)
    return history, net.state_dict(), est.predict(val)


def test_a_fit_read_by_indexing_trains_exactly_as_one_read_by_the_loader():
    indexed, read = fit_history(DataLoader), fit_history(OwnLoader)  # a subclass is read sample by sample
    assert indexed[0]["train_loss"] == read[0]["train_loss"] and indexed[0]["val_loss"] == read[0]["val_loss"]
    for key, value in indexed[1].items():
        assert torch.equal(value, read[1][key])
    assert torch.equal(indexed[2], read[2])

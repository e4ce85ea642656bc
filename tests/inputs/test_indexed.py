"""Batches of a DataLoader over a TensorDataset read by indexing: the loader's own batches, in its
order, with every generator left where the loader leaves it; any other data iterated as it is."""

import copy
import itertools
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from fitforge import Estimator
from fitforge.inputs.indexed import _batch, direct, indexed_batches, readable


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


def generators(loader):
    """Every random state a pass may move: torch's, python's, numpy's, the loader's and its sampler's."""
    sampler = getattr(loader.batch_sampler, "sampler", None)
    own = [g.get_state() for g in (loader.generator, getattr(sampler, "generator", None)) if g is not None]
    return [torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), *own]


def same_generators(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert (
            torch.equal(a, b)
            if isinstance(a, torch.Tensor)
            else np.array_equal(a, b)
            if isinstance(a, np.ndarray)
            else a == b
        )


def compare(make_loader, passes=2, first_batches=None):
    """Passes over one loader as torch reads it, then over a twin read by indexing, from the same
    random states: the same batches, and the same random states after each pass (a whole pass, or
    its ``first_batches`` only)."""
    results = []
    for read in (lambda loader: loader, indexed_batches):
        torch.manual_seed(1)
        random.seed(1)
        np.random.seed(1)
        loader = make_loader()
        seen = []
        for _ in range(passes):
            seen.append(list(itertools.islice(read(loader), first_batches)))
            seen.append(generators(loader))
        results.append(seen)
    torch_passes, indexed_passes = results
    assert len(torch_passes) == len(indexed_passes)
    for i, (mine, theirs) in enumerate(zip(indexed_passes, torch_passes)):
        if i % 2:
            same_generators(mine, theirs)
            continue
        assert len(mine) == len(theirs) > 0
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
    compare(make, first_batches=2)  # a pass cut short: a stop, a resume's skipped batches


def test_other_samplers_and_batch_samplers_are_followed():
    data = tensors()
    weights = torch.rand(37, generator=torch.Generator().manual_seed(2))
    compare(lambda: DataLoader(TensorDataset(*data), batch_size=6, sampler=WeightedRandomSampler(weights, 20)))
    compare(lambda: DataLoader(TensorDataset(*data), batch_size=4, sampler=SubsetRandomSampler(range(3, 30))))
    own = RandomSampler(range(37), generator=torch.Generator().manual_seed(5))
    compare(lambda: DataLoader(TensorDataset(*data), batch_size=4, sampler=copy.deepcopy(own)))
    # a batch sampler of the user's: negative indices, numpy integers, 0-d tensors, a tuple
    batches = [[0, -1, 5], [np.int64(2), np.int64(7)], [torch.tensor(4), torch.tensor(1)], (3, 6)]
    compare(lambda: DataLoader(TensorDataset(*data), batch_sampler=batches))


class Index:
    def __init__(self, i):
        self.i = i

    def __index__(self):
        return self.i


@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence")  # the loader's own, for ["a"]
@pytest.mark.parametrize(
    "batch",
    [[1.0, 2.0], [], [True, False], [True, 1], [torch.tensor([4]), 1], [Index(1), Index(2)], [None], ["a"], [2**70]],
    ids=["floats", "empty", "bools", "bool and int", "1-d tensor", "__index__", "None", "str", "beyond int64"],
)
def test_indices_other_than_plain_ints_are_read_as_the_loader_reads_them(batch):
    data = TensorDataset(*tensors())
    loader = DataLoader(data, batch_sampler=[batch])
    try:
        expected = list(loader)
    except Exception as error:  # the loader's own error, message and all
        with pytest.raises(type(error)) as raised:
            list(indexed_batches(loader))
        assert str(raised.value) == str(error)
    else:
        for a, b in zip(list(indexed_batches(loader)), expected):
            same_batches(a, b)


def test_an_index_out_of_range_fails_as_the_loader_fails():
    loader = DataLoader(TensorDataset(*tensors()), batch_sampler=[[0, 99]])
    for read in (list, lambda loader: list(indexed_batches(loader))):
        with pytest.raises(IndexError, match="index 99 is out of bounds for dimension 0 with size 37"):
            read(loader)


def test_tensors_replaced_during_a_pass_are_read_from_the_next_batch_on():
    data = TensorDataset(torch.zeros(4, 1))
    batches = []
    for batch in indexed_batches(DataLoader(data, batch_size=1)):
        batches.append(batch[0].item())
        data.tensors = (torch.ones(4, 1).t().contiguous().t(),)  # as a handler might; the loader reads it too
    assert batches == [0.0, 1.0, 1.0, 1.0]


def test_the_index_stays_on_the_cpu_whatever_the_default_device():
    data = TensorDataset(torch.arange(8.0))
    with torch.device("meta"):
        batch = _batch(data, data.tensors, [3, 1], indexable=True)
    assert torch.equal(batch[0], torch.tensor([3.0, 1.0]))


class Rows(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(2), torch.tensor(i)


class OwnLoader(DataLoader):
    pass


class Traced(torch.Tensor):
    """A tensor subclass: its __torch_function__ would see indexing where the loader stacks."""


@pytest.mark.parametrize(
    "make",
    [
        lambda data: OwnLoader(data, batch_size=2),
        lambda data: DataLoader(data, batch_size=2, num_workers=1),
        lambda data: DataLoader(data, batch_size=2, pin_memory=True),
        lambda data: DataLoader(data, batch_size=None),
        lambda data: DataLoader(data, batch_size=2, timeout=1),
        lambda data: [(torch.zeros(2), torch.zeros(2))],
    ],
    ids=["subclass", "workers", "pinned", "no batching", "timeout", "list"],
)
def test_other_data_is_iterated_as_it_is(make):
    data = make(TensorDataset(torch.randn(4, 2), torch.arange(4)))
    assert not readable(data)
    assert indexed_batches(data) is data


class ManyRows(Rows):
    """Rows fetched a batch at a time, as a loader's fetcher asks a dataset with ``__getitems__``."""

    def __getitems__(self, indices):
        return [(torch.full((2,), float(i)), torch.tensor(i)) for i in indices]


def same_values(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            same_values(x, y)
    else:
        assert a == b


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(TensorDataset(torch.randn(5, 2), torch.arange(5)), batch_size=2, collate_fn=lambda r: r),
        lambda: DataLoader(Rows(), batch_size=3, shuffle=True),
        lambda: DataLoader(ManyRows(), batch_size=3, shuffle=True),
        lambda: DataLoader(TensorDataset(torch.randn(3, 4).t()), batch_size=2),  # not contiguous
        lambda: DataLoader(TensorDataset(torch.randn(4, 2).to_sparse()), batch_size=2),
        lambda: DataLoader(TensorDataset(torch.randn(4, 2, requires_grad=True)), batch_size=2),
        lambda: DataLoader(TensorDataset(torch.randn(4, 2).as_subclass(Traced)), batch_size=2),
        lambda: DataLoader(TensorDataset(torch.randn(4, 5, 1).transpose(1, 2)), batch_size=2),
    ],
    ids=[
        "collate",
        "dataset",
        "getitems",
        "strided",
        "sparse",
        "requires grad",
        "tensor subclass",
        "strides of a size-1 dim",
    ],
)
def test_other_map_style_loaders_are_read_item_by_item_as_their_iterators_read_them(make):
    torch.manual_seed(3)
    loader = make()
    assert direct(loader) and not readable(loader)
    results = []
    for read in (lambda loader: loader, indexed_batches):
        torch.manual_seed(1)
        try:
            passes = [list(read(loader)) for _ in range(2)]
        except RuntimeError as error:  # sparse rows: default_collate's own error, either way
            passes = [type(error), str(error)]
        results.append((passes, torch.get_rng_state()))
    (theirs, their_rng), (mine, my_rng) = results
    same_values(mine, theirs)
    assert torch.equal(my_rng, their_rng)


def test_the_profiler_shows_the_reads_as_it_shows_the_loaders():
    loader = DataLoader(TensorDataset(*tensors()), batch_size=8)
    spans = {}
    for name, read in (("fitforge.indexed_batches", indexed_batches), ("_SingleProcessDataLoaderIter.__next__", list)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            list(read(loader))
        spans[name] = sum(event.name == f"enumerate(DataLoader)#{name}" for event in profile.events())
    assert (
        spans["fitforge.indexed_batches"] == spans["_SingleProcessDataLoaderIter.__next__"] == 6
    )  # 5 batches, the end


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

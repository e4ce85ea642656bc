"""Per-sample seeds: a sample's random transform depends on (seed, epoch, index) only."""

import random

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler, TensorDataset

from fitforge import Estimator
from fitforge.events import BatchBegin
from fitforge.exceptions import FitforgeTypeError
from fitforge.handlers import CheckpointHandler
from fitforge.inputs.order import DataOrder
from fitforge.inputs.seeds import EpochKeys, SeededSamples, sample_seed


class Augmented(Dataset):
    """A sample is its index plus a random shift drawn from torch and from Python's random."""

    def __len__(self):
        return 12

    def __getitem__(self, index):
        return torch.tensor([float(index), torch.rand(()).item(), random.random()])


def read(seed=7, epoch=0, sampler=None, batch_size=4, num_workers=0):
    """Every sample as it was read, by index."""
    dataset = Augmented()
    batches = BatchSampler(sampler or SequentialSampler(dataset), batch_size, drop_last=False)
    keys = EpochKeys(batches, batched=True, epoch=epoch)
    # A generator of its own: the loader's draw of its workers' base seed leaves the global one alone.
    loader = DataLoader(
        SeededSamples(dataset, seed), batch_sampler=keys, num_workers=num_workers, generator=torch.Generator()
    )
    return {int(row[0]): row[1:].tolist() for batch in loader for row in batch}


def test_a_sample_reads_alike_in_any_order_and_batch_size():
    shuffled = RandomSampler(range(12), generator=torch.Generator().manual_seed(3))
    assert read() == read(sampler=shuffled, batch_size=5)


def test_the_epoch_and_the_seed_change_every_sample():
    first, again = read(epoch=0), read(epoch=1)
    other_seed = read(seed=8)
    assert all(first[i] != again[i] and first[i] != other_seed[i] for i in range(12))
    assert len({tuple(values) for values in first.values()}) == 12  # neighbours unrelated


def test_the_main_process_generators_are_put_back_after_each_sample():
    torch.manual_seed(0)
    random.seed(0)
    before_torch, before_python = torch.get_rng_state(), random.getstate()
    read()
    assert torch.equal(torch.get_rng_state(), before_torch) and random.getstate() == before_python


def test_the_generators_are_put_back_when_a_sample_fails():
    class Fails(Dataset):
        def __getitem__(self, index):
            torch.rand(3)
            raise KeyError(index)

    before = torch.get_rng_state()
    with pytest.raises(KeyError):
        SeededSamples(Fails(), 1)[(0, 5)]
    assert torch.equal(torch.get_rng_state(), before)


def test_numpy_can_be_seeded_from_torch_initial_seed():
    class FromSeed(Dataset):
        def __getitem__(self, index):
            return torch.initial_seed()

    assert SeededSamples(FromSeed(), 9)[(2, 4)] == sample_seed(9, 2, 4)


def test_epoch_keys_carry_the_epoch_set_before_the_pass():
    keys = EpochKeys(range(3), batched=False)
    keys.epoch = 4
    assert list(keys) == [(4, 0), (4, 1), (4, 2)] and len(keys) == 3
    batches = EpochKeys([[0, 1], [2]], batched=True, epoch=1)
    assert list(batches) == [[(1, 0), (1, 1)], [(1, 2)]] and len(batches) == 2


@pytest.mark.integration
def test_workers_read_every_sample_as_the_main_process_does():
    assert read(num_workers=3, batch_size=2) == read(num_workers=0)


class Tagged(Dataset):
    """Sample ``index``: its index and a random shift as features, a class label."""

    def __len__(self):
        return 24

    def __getitem__(self, index):
        return torch.tensor([float(index), torch.rand(()).item() + random.random()]), index % 2


class Seen(BatchBegin):
    def __init__(self):
        self.shifts = {}

    def batch_begin(self, state):
        for row in state.batch[0]:
            self.shifts[(state.epoch, int(row[0]))] = float(row[1])


def shifts(batch_size, sample_seeds=None, handlers=()):
    """Each (epoch, sample)'s shift as two epochs of a fit read it."""
    torch.manual_seed(0)
    net = nn.Linear(2, 2)
    seen = Seen()
    loader = DataLoader(Tagged(), batch_size=batch_size, shuffle=True)
    Estimator(net, nn.CrossEntropyLoss(), optimizer="sgd").fit(
        loader, epochs=2, event_handlers=[seen, *handlers], default_handlers=False, sample_seeds=sample_seeds
    )
    return seen.shifts


def test_fit_reads_a_sample_alike_whatever_the_batch_size_with_sample_seeds():
    assert shifts(4, sample_seeds=True) == shifts(6, sample_seeds=True)
    assert shifts(4, sample_seeds=False) != shifts(6, sample_seeds=False)


def test_sample_seeds_are_on_by_default_where_a_handler_saves_checkpoints(tmp_path):
    saving = [CheckpointHandler(tmp_path / "a", epoch_period=1)], [CheckpointHandler(tmp_path / "b", epoch_period=1)]
    assert shifts(4, handlers=saving[0]) == shifts(6, handlers=saving[1])
    assert shifts(4) != shifts(6)  # no checkpoint, no resume: the loader's own draws


def test_a_tensor_dataset_is_read_as_it_is():
    order = DataOrder(DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2), sample_seeds=True)
    assert order.samples is None


def test_sample_seeds_must_be_a_flag():
    with pytest.raises(FitforgeTypeError, match="fit: sample_seeds must be True or False, got str 'yes'"):
        Estimator(nn.Linear(2, 2), nn.CrossEntropyLoss()).fit(
            DataLoader(Tagged(), batch_size=4), epochs=1, sample_seeds="yes"
        )


def test_an_iterable_dataset_has_no_index_to_seed():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    assert DataOrder(DataLoader(Stream(), batch_size=2), sample_seeds=True).samples is None

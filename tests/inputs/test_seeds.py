"""Per-sample seeds: a sample's random transform depends on (seed, epoch, index) only."""

import random

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

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

"""One order of an epoch for every number of ranks: the samplers' own orders, and the rest of an
epoch split anew after any sample."""

import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from fitforge.inputs.placement import epoch_permutation, rank_remainder


def distributed(size, world, rank, seed, epoch, shuffle=True):
    sampler = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("size", [12, 13, 2])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_from_the_start_it_is_the_distributed_samplers_split(size, world):
    order = epoch_permutation(size, True, 1234, 3)
    for rank in range(world):
        assert rank_remainder(order, 0, world, rank) == distributed(size, world, rank, 1234, 3)
    unshuffled = epoch_permutation(size, False, 1234, 3)
    assert rank_remainder(unshuffled, 0, world, 0) == distributed(size, world, 0, 1234, 3, shuffle=False)


def test_in_one_process_it_is_what_a_random_sampler_draws_from_the_epochs_generator():
    generator = torch.Generator()
    generator.manual_seed(1234 + 3)
    assert list(RandomSampler(range(20), generator=generator)) == epoch_permutation(20, True, 1234, 3)


def test_after_whole_steps_it_is_where_the_distributed_sampler_is():
    world, batch, steps = 2, 3, 2
    order = epoch_permutation(13, True, 7, 0)
    for rank in range(world):
        assert rank_remainder(order, world * batch * steps, world, rank) == distributed(13, world, rank, 7, 0)[6:]


def test_the_rest_of_an_epoch_is_every_sample_not_yet_read_once_split_across_the_ranks():
    order = epoch_permutation(24, True, 5, 1)
    rest = [rank_remainder(order, 10, 2, rank) for rank in range(2)]
    assert sorted(rest[0] + rest[1]) == sorted(order[10:])
    assert rest[0] == order[10::2] and rest[1] == order[11::2]


def test_a_rest_that_does_not_divide_is_padded_with_the_epochs_first_samples():
    order = epoch_permutation(10, False, 0, 0)
    assert [rank_remainder(order, 5, 3, rank) for rank in range(3)] == [[5, 8], [6, 9], [7, 0]]
    assert [rank_remainder([0, 1], 0, 5, rank) for rank in range(5)] == [[0], [1], [0], [1], [0]]


def test_a_rest_past_the_data_is_empty():
    assert rank_remainder(list(range(6)), 6, 2, 1) == []


def test_a_placed_resume_counts_from_its_sample_before_its_epoch_starts():
    from torch.utils.data import DataLoader, TensorDataset

    from fitforge.inputs.order import DataOrder

    order = DataOrder(DataLoader(TensorDataset(torch.arange(24.0)), batch_size=4, shuffle=True))
    order.resume_at(3, 6, sample=10)  # a save now (a signal while restoring) must hold the sample, not 3 batches of 4
    assert order.state_dict()["offset"] == [10, 3]
    order.close()


def test_an_epochs_order_digest_is_of_the_order_the_loader_draws():
    import hashlib

    from torch.utils.data import DataLoader, Sampler, TensorDataset

    from fitforge.inputs.order import DataOrder

    def order(**loader):
        return DataOrder(DataLoader(TensorDataset(torch.arange(24.0)), batch_size=4, **loader))

    shuffled = order(shuffle=True)
    shuffled.batches_of(3)  # the epoch's generators, seeded
    drawn = torch.tensor(list(shuffled.data.sampler)).numpy().tobytes()
    assert shuffled.epoch_digest(3) == hashlib.blake2b(b"3" + drawn, digest_size=8).hexdigest()
    assert shuffled.epoch_digest(3) != shuffled.epoch_digest(4)
    other = order(shuffle=True)
    other.seed = shuffled.seed
    assert other.epoch_digest(3) == shuffled.epoch_digest(3)
    assert order().epoch_digest(0) == order().epoch_digest(0) != order().epoch_digest(1)  # in sequence
    assert DataOrder([1, 2]).epoch_digest(0) is not None

    def own(seed):  # the user's generator: its state at the epoch's start
        mine = order(shuffle=True, generator=torch.Generator().manual_seed(seed))
        mine.batches_of(0)
        return mine.epoch_digest(0)

    assert own(1) == own(1) != own(2)

    class Mine(Sampler):
        def __iter__(self):
            return iter(range(24))

        def __len__(self):
            return 24

    assert order(sampler=Mine()).epoch_digest(0) is None  # fitforge knows nothing of its order

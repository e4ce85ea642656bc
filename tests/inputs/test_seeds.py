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
    """A sample is its index plus random shifts drawn from torch, and from Python's random seeded from it."""

    def __len__(self):
        return 12

    def __getitem__(self, index):
        return torch.tensor([float(index), torch.rand(()).item(), random.Random(torch.initial_seed()).random()])


def read(seed=7, epoch=0, sampler=None, batch_size=4, num_workers=0):
    """Every sample as it was read, by index."""
    dataset = Augmented()
    batches = BatchSampler(sampler or SequentialSampler(dataset), batch_size, drop_last=False)
    keys = EpochKeys(batches, batched=True, repeats=False)
    keys.epoch = epoch
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


def test_the_main_process_generator_is_put_back_after_each_batch():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    read()
    assert torch.equal(torch.get_rng_state(), before)


def test_the_generators_are_put_back_when_a_sample_fails():
    class Fails(Dataset):
        def __getitem__(self, index):
            torch.rand(3)
            raise KeyError(index)

    before = torch.get_rng_state()
    with pytest.raises(KeyError):
        SeededSamples(Fails(), 1)[(0, 5, 0)]
    assert torch.equal(torch.get_rng_state(), before)


def test_numpy_and_random_can_be_seeded_from_torch_initial_seed():
    class FromSeed(Dataset):
        def __getitem__(self, index):
            return torch.initial_seed()

    assert SeededSamples(FromSeed(), 9)[(2, 4, 0)] == sample_seed(9, 2, 4)
    assert sample_seed(9, 2, 4, 1) != sample_seed(9, 2, 4)  # a repeat of the sample in its epoch


def test_epoch_keys_carry_the_epoch_set_before_the_pass():
    keys = EpochKeys(range(3), batched=False, repeats=False)
    keys.epoch = 4
    assert list(keys) == [(4, 0, 0), (4, 1, 0), (4, 2, 0)] and len(keys) == 3
    batches = EpochKeys([[0, 1], [2]], batched=True, repeats=False)
    batches.epoch = 1
    assert list(batches) == [[(1, 0, 0), (1, 1, 0)], [(1, 2, 0)]] and len(batches) == 2


def test_a_sample_drawn_again_in_its_epoch_is_keyed_by_its_repeat_counted_from_the_resumed_position():
    keys = EpochKeys([[0, 1], [0, 0]], batched=True, repeats=True, drawn=[[0, 2]])
    assert list(keys) == [[(0, 0, 1), (0, 1, 0)], [(0, 0, 2), (0, 0, 3)]]
    assert list(EpochKeys([3, 3], batched=False, repeats=True)) == [(0, 3, 0), (0, 3, 1)]


def test_the_dataset_s_attributes_are_seen_through_the_wrapper_and_it_pickles():
    import pickle

    dataset = Augmented()
    dataset.path = "data.h5"  # what a worker_init_fn opens through get_worker_info().dataset
    samples = pickle.loads(pickle.dumps(SeededSamples(dataset, 3)))
    assert samples.path == "data.h5" and len(samples) == 12
    with pytest.raises(AttributeError):
        samples.missing  # noqa: B018


def stateful_batches():
    sampler = pytest.importorskip("torchdata.stateful_dataloader.sampler", reason="torchdata's samplers")
    return sampler.BatchSampler(sampler.RandomSampler(range(12), generator=torch.Generator().manual_seed(1)), 4, False)


@pytest.mark.parametrize(
    "make_sampler, batched, own_state",
    [
        (stateful_batches, True, True),  # torchdata's: its generator's state at the pass's start, and its count
        (lambda: BatchSampler(SequentialSampler(range(12)), 4, False), True, False),  # torch's: read past again
        (lambda: SequentialSampler(range(12)), False, False),
    ],
    ids=["torchdata's batch sampler", "torch's batch sampler", "single indices"],
)
def test_a_pass_of_epoch_keys_loads_its_position_as_a_stateful_dataloader_saves_it(make_sampler, batched, own_state):
    keys = EpochKeys(make_sampler(), batched=batched, repeats=False)
    keys.epoch = 2
    passing = iter(keys)
    read = [next(passing), next(passing)]
    state = passing.state_dict()
    rest = list(passing)
    assert ("indices" in state) is own_state and state["given"] == 2 and len(read + rest) == len(keys)
    resumed = iter(keys)  # a new pass: a shuffled sampler draws another order, which the state puts back
    resumed.load_state_dict(state)
    assert list(resumed) == rest
    keyed = [key for batch in read + rest for key in (batch if batched else [batch])]
    assert sorted(index for epoch, index, _ in keyed if epoch == 2) == list(range(12))


@pytest.mark.integration
def test_workers_read_every_sample_as_the_main_process_does():
    assert read(num_workers=3, batch_size=2) == read(num_workers=0)


class Tagged(Dataset):
    """Sample ``index``: its index and a random shift as features, a class label."""

    def __len__(self):
        return 24

    def __getitem__(self, index):
        return torch.tensor([float(index), torch.rand(()).item()]), index % 2


class Seen(BatchBegin):
    def __init__(self):
        self.shifts, self.draws = {}, []

    def batch_begin(self, state):
        for row in state.batch[0]:
            self.shifts[(state.epoch, int(row[0]))] = float(row[1])
            self.draws.append(float(row[1]))


def shifts(batch_size, sample_seeds=None, handlers=()):
    """Each (epoch, sample)'s shift as two epochs of a fit read it, in an order of the batch size's."""
    torch.manual_seed(0)  # the fit's seed
    net = nn.Linear(2, 2)
    seen = Seen()
    order = torch.utils.data.SubsetRandomSampler(range(24), generator=torch.Generator().manual_seed(batch_size))
    loader = DataLoader(Tagged(), batch_size=batch_size, sampler=order)
    Estimator(net, nn.CrossEntropyLoss(), optimizer="sgd").fit(
        loader, epochs=2, event_handlers=[seen, *handlers], default_handlers=False, sample_seeds=sample_seeds
    )
    return seen.shifts


def test_fit_reads_a_sample_alike_whatever_the_order_and_batch_size_with_sample_seeds():
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
    with pytest.raises(FitforgeTypeError, match=r"fit: sample_seeds must be True, False or None \(the default: on wh"):
        Estimator(nn.Linear(2, 2), nn.CrossEntropyLoss()).fit(
            DataLoader(Tagged(), batch_size=4), epochs=1, sample_seeds="yes"
        )


def test_an_iterable_dataset_has_no_index_to_seed():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    assert DataOrder(DataLoader(Stream(), batch_size=2), sample_seeds=True).samples is None


def test_oversampled_samples_are_augmented_anew_at_each_draw():
    sampler = torch.utils.data.WeightedRandomSampler([1.0] + [0.0] * 23, 16, generator=torch.Generator())
    seen = Seen()
    loader = DataLoader(Tagged(), batch_size=4, sampler=sampler)
    Estimator(nn.Linear(2, 2), nn.CrossEntropyLoss(), optimizer="sgd").fit(
        loader, epochs=1, event_handlers=[seen], default_handlers=False, sample_seeds=True
    )
    assert len(set(seen.draws)) == 16  # sample 0, drawn 16 times, shifted 16 ways


def test_a_dataset_fetching_whole_batches_is_read_as_it_is():
    class Batched(Tagged):
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    assert DataOrder(DataLoader(Batched(), batch_size=2), sample_seeds=True).samples is None


def test_sample_seeds_asked_for_data_they_cannot_apply_to_says_why(caplog):
    with caplog.at_level("WARNING", logger="fitforge"):
        order = DataOrder(DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=2), sample_seeds=True)
    assert order.samples is None
    assert "fit(sample_seeds=True): train_data's samples are read as they are: its TensorDataset has no" in caplog.text


def test_the_keyed_loader_keeps_persistent_workers():
    loader = DataLoader(Tagged(), batch_size=4, num_workers=1, persistent_workers=True)
    order = DataOrder(loader, sample_seeds=True)  # no worker starts here
    assert order.samples is not None and order._keyed[0].persistent_workers
    order.close()

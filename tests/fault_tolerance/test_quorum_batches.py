"""QuorumBatches: each committed step's global batch split over the groups of its quorum, whatever their
number, so that the groups that commit a step read each of its samples once."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from fitforge.exceptions import FitforgeValueError
from fitforge.fault_tolerance.batches import QuorumBatches, why_not_split
from fitforge.inputs.placement import epoch_permutation


class Quorum:
    """The engine's side, scripted: the groups of each quorum, and commits done by the test."""

    def __init__(self, groups: int, rank: int, seed: int = 3) -> None:
        self.groups, self.rank, self.seed, self.step, self.asked = groups, rank, seed, 0, 0

    def committed_steps(self) -> int:
        return self.step

    def next_quorum(self) -> tuple[int, int]:
        self.asked += 1
        return self.groups, self.rank


def loader(size: int = 10, batch_size: int = 4, **options) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(size)), batch_size=batch_size, **options)


def test_the_groups_of_a_step_read_its_global_batch_once_for_any_number_of_groups():
    for groups in (1, 2, 3, 5):
        shares = [
            QuorumBatches(loader(10, 4, shuffle=True), Quorum(groups, rank)).split(1, groups, rank)
            for rank in range(groups)
        ]
        read = sorted(i for share in shares for i in share.indices if share.weight)
        assert read == sorted(epoch_permutation(10, True, 3, 0)[4:8])
        assert sum(share.weight for share in shares) == pytest.approx(1.0)


def test_a_batch_smaller_than_the_quorum_gives_a_group_one_sample_weighing_nothing():
    batches = QuorumBatches(loader(10, 4), Quorum(3, 2))
    share = batches.split(2, 3, 0)  # the epoch's last batch: samples 8 and 9, over three groups
    assert share.indices == [8] and share.weight == 0.0
    assert [batches.split(2, 3, r).indices for r in (1, 2)] == [[8], [9]]


def test_an_epoch_is_read_at_the_committed_steps_and_a_failed_step_again():
    quorum = Quorum(2, 1)
    batches = QuorumBatches(loader(10, 4), quorum)
    batches.set_epoch(0)
    assert len(batches) == 3
    read = []
    for batch in batches:
        read.append(batch[0].tolist())
        if len(read) != 2:  # the second read fails its commit: the same step is read again
            quorum.step += 1
    assert read == [[2, 3], [6, 7], [6, 7], [9]]
    assert quorum.asked == 4  # one quorum for each read, none at the epoch's end


def test_the_next_epoch_starts_at_the_committed_step_and_a_resume_where_it_was():
    quorum = Quorum(1, 0)
    batches = QuorumBatches(loader(10, 5, drop_last=True), quorum)
    quorum.step = 7
    batches.set_epoch(3)
    assert (batches.start, len(batches)) == (7, 2)
    saved = batches.state_dict()
    again = QuorumBatches(loader(10, 5, drop_last=True), Quorum(1, 0))
    again.load_state_dict(saved)
    again.set_epoch(3)
    assert again.start == 7
    again.set_epoch(4)  # a later epoch begins at the committed step
    assert again.start == 0


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ([(torch.zeros(1), torch.zeros(1))], "not a torch DataLoader"),
        (DataLoader(TensorDataset(torch.arange(4)), batch_size=None), "no batch size"),
        (
            DataLoader(TensorDataset(torch.arange(4)), batch_size=2, sampler=WeightedRandomSampler([1.0] * 4, 4)),
            "sampler",
        ),
        (
            DataLoader(
                TensorDataset(torch.arange(4)),
                batch_size=2,
                sampler=torch.utils.data.RandomSampler(range(4), replacement=True),
            ),
            "replacement",
        ),
    ],
)
def test_data_that_cannot_be_split_by_index_is_refused_naming_why(data, problem):
    assert problem in why_not_split(data)
    with pytest.raises(FitforgeValueError, match="split each step's batch|splits each step's batch") as error:
        QuorumBatches(data, Quorum(2, 0))
    assert problem in str(error.value) and "DataLoader over a map-style dataset" in str(error.value)


def test_an_iterable_dataset_is_refused():
    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(1)

    assert "IterableDataset" in why_not_split(DataLoader(Stream(), batch_size=2))

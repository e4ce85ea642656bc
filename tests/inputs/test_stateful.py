"""Data that keeps its own position (fitforge.inputs.stateful): its state rides in every checkpoint, and a
resume loads it instead of reading and discarding the batches before the checkpoint. Each run here crashes
after a batch past its newest checkpoint and resumes in new objects, as a re-run of the script would; the
kill -9 runs with worker processes are in test_stateful_kill9.py."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from fitforge import Estimator
from fitforge.checkpoint.files import load_checkpoint
from fitforge.events import BatchBegin
from fitforge.handlers import CheckpointHandler
from fitforge.inputs.order import DataOrder
from fitforge.inputs.seeds import SeededSamples
from fitforge.inputs.stateful import epoch_setter, position_holder
from helpers import Crash, Losses

torchdata = pytest.importorskip("torchdata", reason="StatefulDataLoader needs torchdata (pip install 'fitforge[data]')")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)  # 6 batches of 8


class Transformed(Dataset):
    """The 48 samples, each through a random transform drawn from a generator seeded by its index; counts reads."""

    def __init__(self) -> None:
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, index: int):
        self.reads.append(index)
        noise = torch.randn(6, generator=torch.Generator().manual_seed(index))
        return X[index] + 0.1 * noise, Y[index]


class Noisy(Transformed):
    """The 48 samples through a random transform drawn from torch's generator and Python's ``random`` (seeded
    from torch's, as docs/data-at-scale.md shows), the sample's index its first feature; counts reads."""

    def __getitem__(self, index: int):
        self.reads.append(index)
        shift = 0.1 * torch.randn(5) + random.Random(torch.initial_seed()).uniform(-0.1, 0.1)  # seeded from torch
        return torch.cat([torch.tensor([float(index)]), X[index, 1:] + shift]), Y[index]


class Stream(IterableDataset):
    """A stream of one's own that follows the Stateful protocol: its order is drawn from the epoch, its state
    says how many samples it yielded in which epoch. Counts the samples it reads."""

    def __init__(self) -> None:
        self.epoch, self.yielded, self.reads = 0, 0, 0
        self._resume: dict | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self._resume = state

    def __iter__(self):
        order = torch.randperm(len(X), generator=torch.Generator().manual_seed(self.epoch)).tolist()
        resume, self._resume = self._resume, None
        self.yielded = resume["yielded"] if resume is not None and resume["epoch"] == self.epoch else 0
        for index in order[self.yielded :]:
            self.reads += 1
            self.yielded += 1
            yield X[index], Y[index]


def train(folder, make_data, crash=None, resume=False, epochs=3, async_save=False):
    """(weights, losses by step, the data) of a run from scratch or resumed, crashing after ``crash`` batches."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01))
    losses, data = Losses(), make_data()
    saver = CheckpointHandler(
        folder, batch_period=4, max_checkpoints=2, resume_from_checkpoint=resume, async_save=async_save
    )
    handlers = [losses, saver] + ([Crash(crash)] if crash else [])
    try:
        estimator.fit(data, epochs=epochs, event_handlers=handlers)
    except RuntimeError as error:
        assert str(error) == "crash"
    return {k: v.clone() for k, v in net.state_dict().items()}, losses.seen, data


def assert_resumes_exactly(tmp_path, make_data, crash, async_save=False):
    whole, whole_losses, _ = train(tmp_path / "whole", make_data)
    _, _, crashed = train(tmp_path / "run", make_data, crash=crash, async_save=async_save)
    weights, losses, resumed = train(tmp_path / "run", make_data, resume=True, async_save=async_save)
    assert all(torch.equal(weights[k], whole[k]) for k in whole), "the resumed run ends elsewhere"
    assert losses == {step: whole_losses[step] for step in losses} and max(losses) == max(whole_losses)
    return crashed, resumed


def stateful_loader():
    return StatefulDataLoader(Transformed(), batch_size=8, shuffle=True)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async saves"])
def test_a_stateful_dataloader_resumes_mid_epoch_exactly_without_reading_the_samples_before_again(tmp_path, async_save):
    crashed, resumed = assert_resumes_exactly(tmp_path, stateful_loader, crash=10, async_save=async_save)  # saved: 8
    assert len(crashed.dataset.reads) == 10 * 8
    assert len(resumed.dataset.reads) == 3 * 48 - 8 * 8  # from the checkpoint's sample on, none read twice


def test_a_stateful_dataloader_drawing_a_random_transform_resumes_mid_epoch_exactly(tmp_path):
    def noisy_loader():
        return StatefulDataLoader(Noisy(), batch_size=8, shuffle=True)

    _, resumed = assert_resumes_exactly(tmp_path, noisy_loader, crash=10)  # saved: 8
    assert len(resumed.dataset.reads) == 3 * 48 - 8 * 8  # from the checkpoint's sample on, none read twice


class Seen(BatchBegin):
    """Every sample as the fit read it, by (epoch, index)."""

    def __init__(self):
        self.samples = {}

    def batch_begin(self, state):
        for row in state.batch[0]:
            self.samples[(state.epoch, int(row[0]))] = row.tolist()


def read(batch_size, num_workers=0, sample_seeds=True):
    """Every sample as 2 epochs read it, in an order of the batch size's own (the fit's seed the same)."""
    torch.manual_seed(0)
    net, seen = nn.Linear(6, 3), Seen()
    order = torch.utils.data.SubsetRandomSampler(range(48), generator=torch.Generator().manual_seed(batch_size))
    loader = StatefulDataLoader(Noisy(), batch_size=batch_size, sampler=order, num_workers=num_workers)
    Estimator(net, nn.CrossEntropyLoss(), optimizer="sgd").fit(
        loader, epochs=2, event_handlers=[seen], default_handlers=False, sample_seeds=sample_seeds
    )
    return seen.samples


def test_sample_seeds_read_a_stateful_dataloaders_samples_alike_whatever_the_order_and_batch_size():
    assert read(4) == read(6) and len(read(4)) == 2 * 48
    assert read(4, sample_seeds=False) != read(6, sample_seeds=False)


@pytest.mark.integration
def test_sample_seeds_read_a_stateful_dataloaders_samples_alike_in_2_workers_and_in_this_process():
    assert read(8, num_workers=2) == read(8)


def test_a_stateful_dataloaders_position_is_its_keyed_samples_loader():
    loader = StatefulDataLoader(Noisy(), batch_size=8, shuffle=True, num_workers=2, persistent_workers=True)
    order = DataOrder(loader, sample_seeds=True)  # no worker starts here
    keyed = order.holder
    assert type(keyed) is StatefulDataLoader and keyed is not loader and isinstance(keyed.dataset, SeededSamples)
    assert keyed.dataset.dataset is loader.dataset and keyed.persistent_workers and keyed.num_workers == 2
    assert keyed.batch_sampler.sampler is loader.batch_sampler  # the loader's own order, read as keys
    assert DataOrder(loader).holder is loader  # sample_seeds=False: the loader as it is


class StatefulMap(Noisy):
    def state_dict(self) -> dict:
        return {"reads": len(self.reads)}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_stateful_dataloader_over_a_tensor_dataset_or_a_dataset_with_a_state_is_read_as_it_is():
    for dataset in (TensorDataset(X, Y), StatefulMap()):  # no transform; a state the loader saves in its workers
        loader = StatefulDataLoader(dataset, batch_size=8, shuffle=True)
        order = DataOrder(loader, sample_seeds=True)
        assert order.samples is None and order.holder is loader


def test_the_checkpoint_holds_the_loaders_state_at_its_batch(tmp_path):
    train(tmp_path, stateful_loader, crash=10)
    checkpoint = load_checkpoint(tmp_path / "model-epoch1batch8.pt")  # 8 batches, 2 into epoch 2
    state = checkpoint["data_order"]["data_state"]
    assert state["_num_yielded"] == 2 and state["_sampler_iter_yielded"] == 2


def test_a_resume_at_an_epoch_boundary_continues_the_loaders_own_order(tmp_path):
    assert_resumes_exactly(tmp_path, stateful_loader, crash=13)  # saved after 12: epoch 3's first batch next


def test_a_stateful_dataset_of_ones_own_in_a_plain_dataloader_resumes_from_its_state(tmp_path):
    crashed, resumed = assert_resumes_exactly(tmp_path, lambda: DataLoader(Stream(), batch_size=8), crash=11)
    assert crashed.dataset.reads == 11 * 8
    assert resumed.dataset.reads == 3 * 48 - 8 * 8  # 8 batches saved (epoch 2, 2 in): the rest, read once


def test_a_resume_from_a_checkpoint_without_the_data_state_reads_and_discards(tmp_path, caplog):
    train(tmp_path, lambda: DataLoader(Stream(), batch_size=8), crash=10)
    path = tmp_path / "model-epoch1batch8.pt"
    checkpoint = load_checkpoint(path)
    del checkpoint["data_order"]["data_state"]  # as an older fitforge wrote it
    from fitforge.checkpoint.format import checkpoint_bytes

    path.write_bytes(checkpoint_bytes(checkpoint))
    whole, _, _ = train(tmp_path / "whole", lambda: DataLoader(Stream(), batch_size=8))
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        weights, _, resumed = train(tmp_path, lambda: DataLoader(Stream(), batch_size=8), resume=True)
    assert "holds no state of its Stream, so the batches before its position are read and discarded" in caplog.text
    assert all(torch.equal(weights[k], whole[k]) for k in whole)  # the stream repeats each epoch: still exact
    assert resumed.dataset.reads == 3 * 48 - 8 * 8 + 2 * 8  # the two batches before the position, read again


def test_the_position_holder_is_the_data_or_the_dataset_a_plain_loader_reads_in_this_process():
    stateful, stream = stateful_loader(), Stream()
    assert position_holder(stateful) == (stateful, None)
    assert position_holder(stream) == (stream, None)
    assert position_holder(DataLoader(stream, batch_size=8)) == (stream, None)
    assert position_holder(DataLoader(TensorDataset(X, Y), batch_size=8)) == (None, None)  # today's path
    assert position_holder([(X, Y)]) == (None, None)
    holder, why = position_holder(DataLoader(stream, batch_size=8, num_workers=2))  # no worker starts here
    assert holder is None and "reads it in 2 worker process(es)" in why and "StatefulDataLoader" in why
    assert epoch_setter(stream) is stream and epoch_setter(DataLoader(stream, batch_size=8)) is stream
    assert epoch_setter(DataLoader(TensorDataset(X, Y))) is None


def test_a_plain_loader_reading_a_stateful_dataset_in_workers_says_to_use_a_stateful_dataloader():
    order = DataOrder(DataLoader(Stream(), batch_size=8, num_workers=2))
    assert order.holder is None and "pass torchdata's StatefulDataLoader" in order.problem
    order.close()


def test_plain_loaders_keep_their_order_and_save_no_data_state(tmp_path):
    order = DataOrder(DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True))
    assert order.holder is None and order.problem is None and "data_state" not in order.state_dict()
    order.close()


def test_a_stateful_loaders_checkpoint_continues_only_on_as_many_ranks():
    from fitforge.checkpoint.resume import continuation
    from fitforge.exceptions import FitforgeValueError

    order = DataOrder(stateful_loader())
    saved = order.state_dict()
    assert continuation(order, saved, 2, 1) is None  # the same world: the loader's state is the position
    with pytest.raises(FitforgeValueError, match="by 2 rank.*its position is the state of its StatefulDataLoader"):
        continuation(order, {**saved, "world": 2}, 2, 1)
    order.close()


def test_the_warning_of_data_without_positions_names_the_stateful_loaders(tmp_path, caplog):
    from fitforge.checkpoint.resume import warn_if_inexact
    from fitforge.core.run import RunContext
    from fitforge.core.state import TrainState

    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    run = RunContext(None, None, DataOrder(DataLoader(Stream(), batch_size=8, num_workers=2)), "train_data", None)
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        warn_if_inexact(TrainState(estimator, _loop=run), saves_mid_epoch=True, resumes=False)
    assert "reads it in 2 worker process(es)" in caplog.text and "a torchdata StatefulDataLoader" in caplog.text


def test_a_stateful_loader_adds_no_host_read_per_training_batch():
    from fitforge.testing import HostReadCounter, linear_data, linear_problem

    def reads_in_one_epoch(batches):
        estimator, _, val = linear_problem()
        loader = StatefulDataLoader(linear_data(n=4 * batches, batch_size=4).dataset, batch_size=4, shuffle=True)
        with HostReadCounter() as reads:
            estimator.fit(loader, val_data=val, epochs=1)
        return reads.count

    few, many = reads_in_one_epoch(8), reads_in_one_epoch(64)
    assert few == many > 0  # > 0: the counter sees the epoch-end reads, so it would see per-batch ones


def test_a_save_before_any_batch_after_a_resume_keeps_the_loaded_state():
    from fitforge.core.state import TrainState

    stream = Stream()  # as a datasets.IterableDataset: its state is stale until it is read from
    order = DataOrder(DataLoader(stream, batch_size=8))
    order.load_state_dict({"data_state": {"epoch": 1, "yielded": 16}}, mid_epoch=True)
    order.resume_at(2, epoch_start_step=6)
    assert order.state_dict()["data_state"] == {"epoch": 1, "yielded": 16}  # a signal while restoring
    net = nn.Linear(6, 3)
    state = TrainState(Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1)))
    state.epoch = 1
    batches, first = order.epoch(state)
    assert first == 2 and order.state_dict(batch_idx=1)["data_state"]["yielded"] == 16  # none read yet
    next(iter(batches))
    assert order.state_dict(batch_idx=2)["data_state"] == {"epoch": 1, "yielded": 24}  # one read: its own

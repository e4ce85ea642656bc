"""Exact resume from anywhere: a run that crashes right after any batch's checkpoint and resumes
ends with the uninterrupted run's weights, per-batch losses and history (shuffled data, dropout,
Adam, gradient accumulation, worker processes, metric sums)."""

import contextlib
import logging

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    TensorDataset,
)

import fitforge.inputs.indexed
from fitforge import Estimator
from fitforge.checkpoint.resume import warn_if_inexact
from fitforge.events import BatchEnd
from fitforge.exceptions import CancelBatch, CancelEpoch, FitforgeValueError
from fitforge.handlers import CheckpointHandler, GradientUpdateHandler
from fitforge.inputs.order import DataOrder
from helpers import Crash, Losses, checkpoint_files

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)  # 6 batches of 8


class Batches:
    """A re-iterable without positions (not a list, not a DataLoader)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class Augmented(torch.utils.data.Dataset):
    """X and Y with a random shift drawn in ``__getitem__``."""

    def __len__(self):
        return len(X)

    def __getitem__(self, index):
        return X[index] + 0.1 * torch.randn(6), Y[index]


def loader(kind="shuffled", workers=0):
    dataset = Augmented() if kind == "augmented" else TensorDataset(X, Y)
    if kind == "own generator":
        return DataLoader(dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))
    batches = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 48, 8)]
    if kind == "list":
        return batches
    if kind == "iterable":
        return Batches(batches)
    if kind == "batch sampler":  # the sampler in use is the batch sampler's, not loader.sampler
        return DataLoader(dataset, batch_sampler=BatchSampler(RandomSampler(dataset), 8, drop_last=False))
    if kind == "distributed sampler":  # rank 0 of 2, no process group needed: fit calls set_epoch
        return DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, num_replicas=2, rank=0))
    if kind == "batches by index":  # a dataset of whole batches, shuffled without automatic batching
        return DataLoader(batches, batch_size=None, shuffle=True)
    return DataLoader(dataset, batch_size=8, shuffle=True, num_workers=workers)


def train(
    folder, seed=0, resume=False, crash=None, kind="shuffled", workers=0, accumulate=1, epochs=3, device="cpu", extra=()
):
    """Returns (weights, losses by step, history); history is None when the run crashed."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    metrics = {"accuracy": "accuracy", "tm_accuracy": torchmetrics.Accuracy("multiclass", num_classes=3)}
    estimator = Estimator(
        net,
        nn.CrossEntropyLoss(),
        train_metrics=metrics,
        optimizer=torch.optim.Adam(net.parameters(), lr=0.01),
        device=device,
    )
    losses = Losses()
    handlers = [
        losses,
        GradientUpdateHandler(accumulate=accumulate),
        CheckpointHandler(folder, epoch_period=None, batch_period=1, max_checkpoints=2, resume_from_checkpoint=resume),
    ]
    try:
        history = estimator.fit(
            loader(kind, workers), epochs=epochs, event_handlers=[*handlers, *extra] + ([Crash(crash)] if crash else [])
        )
    except RuntimeError as error:
        assert str(error) == "crash"
        history = None
    return {k: v.cpu() for k, v in net.state_dict().items()}, losses.seen, history


_uninterrupted = {}


def uninterrupted(tmp_path_factory, **kwargs):
    key = repr(sorted(kwargs.items()))
    if key not in _uninterrupted:
        _uninterrupted[key] = train(tmp_path_factory.mktemp("whole"), **kwargs)
    return _uninterrupted[key]


def assert_continues_exactly(folder, whole, crash, **kwargs):
    _, before, _ = train(folder, crash=crash, **kwargs)
    weights, after, history = train(folder, seed=123, resume=True, **kwargs)  # another init: all of it restored
    assert min(after) == crash  # no batch redone: the checkpoint of batch `crash` was written
    assert {**before, **after} == whole[1]  # every batch's loss, those redone included
    assert all(torch.equal(weights[k], whole[0][k]) for k in whole[0])
    for key in ("train_loss", "train_accuracy", "train_tm_accuracy"):  # the sums of the resumed epoch
        assert history[key] == whole[2][key], key


# batch 1: the first of the run; 6: the last of epoch 1 (saved before its epoch end); 7: the first
# of epoch 2; 9: the middle of an epoch and, with accumulate=4, of an accumulation group.
@pytest.mark.parametrize("crash", [1, 6, 7, 9])
@pytest.mark.parametrize("accumulate", [1, 4])
def test_a_crash_after_any_batch_resumes_exactly(tmp_path, tmp_path_factory, crash, accumulate):
    whole = uninterrupted(tmp_path_factory, accumulate=accumulate)
    assert_continues_exactly(tmp_path, whole, crash, accumulate=accumulate)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_resume_on_cuda_is_exact_with_deterministic_algorithms(tmp_path, tmp_path_factory):
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # see docs/checkpoints.md (CUBLAS_WORKSPACE_CONFIG)
    try:
        whole = uninterrupted(tmp_path_factory, device="cuda", accumulate=4)
        assert_continues_exactly(tmp_path, whole, 9, device="cuda", accumulate=4)
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.integration  # DataLoader worker processes
def test_worker_processes_resume_exactly(tmp_path, tmp_path_factory):
    whole = uninterrupted(tmp_path_factory, workers=2)
    assert whole[1] == uninterrupted(tmp_path_factory)[1]  # workers change nothing in the order
    assert_continues_exactly(tmp_path, whole, 9, workers=2)


def test_a_random_transform_in_getitem_resumes_exactly(tmp_path, tmp_path_factory):
    whole = uninterrupted(tmp_path_factory, kind="augmented")  # a checkpointing fit: per-sample seeds on
    assert_continues_exactly(tmp_path, whole, 9, kind="augmented")


@pytest.mark.parametrize("kind", ["own generator", "list", "batches by index", "batch sampler", "distributed sampler"])
def test_a_user_generator_a_list_or_a_loader_of_whole_batches_resumes_exactly(tmp_path, tmp_path_factory, kind):
    whole = uninterrupted(tmp_path_factory, kind=kind)
    assert_continues_exactly(tmp_path, whole, 9, kind=kind)


@pytest.mark.parametrize("kind", ["shuffled", "own generator", "batch sampler", "distributed sampler"])
def test_a_resume_read_by_indexing_continues_a_fit_read_by_the_loader_exactly(tmp_path, kind, monkeypatch):
    """fit reads these loaders by indexing their TensorDataset (fitforge.inputs.indexed): the same fit
    read by the loader itself, sample by sample, is continued exactly by a resume read by indexing."""
    with monkeypatch.context() as patch:
        patch.setattr(fitforge.inputs.indexed, "readable", lambda data: False)
        whole = train(tmp_path / "whole", kind=kind)
    assert_continues_exactly(tmp_path / "resumed", whole, 9, kind=kind)


def test_data_without_positions_warns_and_is_read_up_to_the_checkpoint(tmp_path, tmp_path_factory, caplog):
    whole = uninterrupted(tmp_path_factory, kind="iterable")
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        assert_continues_exactly(tmp_path, whole, 9, kind="iterable")
    assert (
        "a resume in the middle of an epoch cannot restore the position in train_data by index: it is a Batches, "
        "not a list or a DataLoader, so it has no batch positions. It reads and discards"
    ) in caplog.text


def test_the_order_is_a_function_of_the_seed_and_the_epoch_and_the_loader_is_given_back():
    data = loader()
    order = DataOrder(data)
    assert data.generator is not None and data.sampler.generator is not None and order.problem is None

    def indices(epoch):
        return torch.cat([x[:, 0] for x, _ in order.batches_of(epoch)])

    third = indices(2)
    indices(0)
    assert torch.equal(indices(2), third) and not torch.equal(indices(1), third)
    order.close()
    assert data.generator is None and data.sampler.generator is None


def test_what_cannot_be_restored_by_index_is_named():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter([])

    assert "IterableDataset" in DataOrder(DataLoader(Stream(), batch_size=2)).problem
    sampler = torch.utils.data.Sampler()
    assert (
        "its sampler Sampler draws its order from a source"
        in DataOrder(DataLoader(TensorDataset(X, Y), sampler=sampler)).problem
    )

    class MySampler(RandomSampler):  # may shuffle any way it likes, though it has a generator attribute
        pass

    assert "its sampler MySampler draws" in DataOrder(DataLoader(TensorDataset(X, Y), sampler=MySampler(X))).problem
    own = DataLoader(
        TensorDataset(X, Y), shuffle=True, num_workers=1, persistent_workers=True, generator=torch.Generator()
    )
    assert "persistent workers" in DataOrder(own).problem


def test_a_metric_without_a_saveable_state_restarts_its_sums_with_a_warning(tmp_path, caplog):
    class Plain:
        """A metric object fitforge cannot read the running state of."""

        def update(self, pred, label):
            self.n = getattr(self, "n", 0) + 1

        def compute(self):
            return float(getattr(self, "n", 0))

        def reset(self):
            self.n = 0

        def to(self, device):
            return self

    def fit(resume, crash=None):
        net = nn.Linear(6, 3)
        estimator = Estimator(
            net, nn.CrossEntropyLoss(), train_metrics={"batches": Plain()}, optimizer="sgd", device="cpu"
        )
        saver = CheckpointHandler(tmp_path, epoch_period=None, batch_period=1, resume_from_checkpoint=resume)
        try:
            return estimator.fit(loader("list"), epochs=1, event_handlers=[saver] + ([Crash(crash)] if crash else []))
        except RuntimeError:
            return None

    fit(False, crash=2)
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        history = fit(True)
    assert "metric 'batches' (Plain) has no state fitforge can save" in caplog.text
    assert history["train_batches"] == [4.0]  # the 4 batches after the resume, not all 6


def test_resuming_on_cuda_without_deterministic_algorithms_warns(tmp_path, caplog):
    from types import SimpleNamespace

    saver = CheckpointHandler(tmp_path, resume_from_checkpoint=True)
    state = SimpleNamespace(_loop=None, estimator=SimpleNamespace(device=torch.device("cuda")))
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="fitforge"):
                warn_if_inexact(state, saver.batch_period is not None, saver.resume_from_checkpoint)
            assert ("resuming on CUDA without torch.use_deterministic_algorithms(True)" in caplog.text) != deterministic
    finally:
        torch.use_deterministic_algorithms(was)


class CancelAt(BatchEnd):
    """Raise ``cancel`` once, at batch_end of step ``at``, with ``priority`` (950: after the step's
    checkpoint). A cancelled batch does not count, so the next batch has the same step."""

    def __init__(self, cancel, at, priority):
        self.cancel, self.at, self.priority, self.fired = cancel, at, priority, False

    def batch_end(self, state):
        if state.global_step == self.at and not self.fired:
            self.fired = True
            raise self.cancel


@pytest.mark.parametrize("cancel", [CancelEpoch, CancelBatch])
def test_a_cancelled_batch_or_epoch_resumes_exactly(tmp_path, tmp_path_factory, cancel):
    # CancelEpoch: the run goes on with the next epoch, so its checkpoint counts the epoch as done;
    # CancelBatch after the batch's checkpoint: the next batch's checkpoint, same counters, replaces it.
    whole = train(tmp_path_factory.mktemp("whole"), extra=(CancelAt(cancel, 8, 950),), accumulate=2)
    _, before, _ = train(tmp_path, crash=10, extra=(CancelAt(cancel, 8, 950),), accumulate=2)
    weights, after, _ = train(tmp_path, seed=123, resume=True, extra=(CancelAt(cancel, 8, 950),), accumulate=2)
    assert {**before, **after} == whole[1]
    assert all(torch.equal(weights[k], whole[0][k]) for k in whole[0])


def test_the_checkpoint_of_a_cancelled_epoch_counts_it_as_done(tmp_path):
    estimator = Estimator(nn.Linear(6, 3), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    estimator.fit(loader("list"), epochs=1, event_handlers=[CheckpointHandler(tmp_path), CancelAt(CancelEpoch, 2, 950)])
    saved = torch.load(tmp_path / "model-epoch1batch2.pt", weights_only=True)  # the run goes on with epoch 2
    assert (saved["epochs_completed"], saved["position"]) == (1, 0)


def test_fit_sets_a_distributed_samplers_epoch():
    data = loader("distributed sampler")
    order = DataOrder(data)
    assert order.problem is None

    def first_indices(epoch):
        return torch.cat([x[:, 0] for x, _ in order.batches_of(epoch)])

    assert not torch.equal(first_indices(0), first_indices(1)) and torch.equal(first_indices(1), first_indices(1))
    assert data.sampler.epoch == 1


def test_a_stop_before_the_first_batch_of_a_resumed_epoch_writes_nothing(tmp_path):
    # Issue 14, point 1 (from review): a stop requested in epoch_begin of an epoch resumed at its
    # batch 5 marked the half epoch complete, so its epoch end saved "epoch 1 done" and rotated the
    # checkpoint away; the next resume skipped the other half of the epoch.
    from fitforge.events import EpochBegin
    from fitforge.handlers import CheckpointHandler
    from fitforge.testing import linear_problem

    class StopAtEpochBegin(EpochBegin):
        def epoch_begin(self, state):
            state.run.stop("stopped before the first batch")

    estimator, train, _ = linear_problem()
    estimator.fit(train, batches=5, event_handlers=[CheckpointHandler(tmp_path, batch_period=5, max_checkpoints=1)])
    before = {name: (tmp_path / name).read_bytes() for name in checkpoint_files(tmp_path)}
    assert list(before) == ["model-epoch0batch5.pt"]
    estimator, train, _ = linear_problem()
    resumer = CheckpointHandler(tmp_path, batch_period=5, max_checkpoints=1, resume_from_checkpoint=True)
    history = estimator.fit(train, epochs=2, event_handlers=[resumer, StopAtEpochBegin()])
    assert history.stop_reason == "stopped before the first batch"
    assert {name: (tmp_path / name).read_bytes() for name in checkpoint_files(tmp_path)} == before


def test_a_resume_at_the_end_of_an_epoch_of_unknown_length_trains_on(tmp_path):
    # batches=4 stops at the last batch of an epoch whose length the data cannot tell: the checkpoint
    # holds position 4, so the resumed epoch has no batch left, which is no stalled epoch.
    data = Batches([(X[i : i + 8], Y[i : i + 8]) for i in range(0, 32, 8)])

    def fit(batches, resume):
        net = nn.Linear(6, 3)
        estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        trained = Losses()
        saver = CheckpointHandler(tmp_path, batch_period=1, resume_from_checkpoint=resume)
        history = estimator.fit(data, batches=batches, event_handlers=[saver, trained], default_handlers=False)
        return history, trained

    fit(4, resume=False)
    history, trained = fit(10, resume=True)
    assert sorted(trained.seen) == list(range(4, 10)) and history.stop_reason == "reached batches=10"


def test_the_first_batch_checks_run_for_a_fit_from_scratch_and_for_a_resumed_one(tmp_path):
    class CountChecks(BatchEnd):
        def __init__(self):
            self.checks = 0

        def offer(self, services):
            services.first_batch_checks.append(self.check_first_batch)

        def check_first_batch(self, state):
            self.checks += 1

        def batch_end(self, state):
            pass

    counts = []
    for resume in (False, True):
        counter = CountChecks()
        train(tmp_path, resume=resume, epochs=2 if not resume else 3, extra=(counter,))
        counts.append(counter.checks)
    assert counts == [1, 1]  # a resumed fit may bring other metrics or handlers


class Samples(BatchEnd):
    """The rows of X each batch trained on, by epoch."""

    def __init__(self):
        self.seen = {}

    def batch_end(self, state):
        rows = [int(((X - x).abs().sum(1) == 0).nonzero()[0]) for x in state.batch[0]]
        self.seen.setdefault(state.epoch, []).extend(rows)


def fit_with_batch_size(folder, batch_size, resume, crash=None, generator=None):
    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    samples = Samples()
    handlers = [samples, CheckpointHandler(folder, batch_period=1, resume_from_checkpoint=resume)]
    data = DataLoader(TensorDataset(X, Y), batch_size=batch_size, shuffle=True, generator=generator)
    with contextlib.suppress(RuntimeError):  # the crash
        estimator.fit(data, epochs=2, event_handlers=handlers + ([crash] if crash else []), default_handlers=False)
    return samples.seen


@pytest.mark.parametrize("batch_size", [4, 5])
def test_a_resume_with_another_batch_size_continues_at_the_same_sample(tmp_path, caplog, batch_size):
    whole = fit_with_batch_size(tmp_path / "whole", 8, resume=False)
    crashed = fit_with_batch_size(tmp_path / "run", 8, resume=False, crash=Crash(at=8))  # 2 batches into epoch 2
    assert crashed[1] == whole[1][:16]
    with caplog.at_level(logging.INFO, logger="fitforge"):
        resumed = fit_with_batch_size(tmp_path / "run", batch_size, resume=True)
    assert resumed[1] == whole[1][16:]  # the rest of the same order in the new batches: none skipped or repeated
    assert (
        "the checkpoint was written 16 sample(s) into epoch 2 by 1 rank(s) in batches of 8; epoch 2 goes on from "
        f"that sample of its order on 1 rank(s) in batches of {batch_size}"
    ) in caplog.text


def test_an_own_generators_order_continues_with_a_batch_size_that_ends_at_the_same_sample(tmp_path):
    def generator():
        return torch.Generator().manual_seed(7)

    whole = fit_with_batch_size(tmp_path / "whole", 8, resume=False, generator=generator())
    fit_with_batch_size(tmp_path / "run", 8, resume=False, crash=Crash(at=8), generator=generator())
    resumed = fit_with_batch_size(tmp_path / "run", 4, resume=True, generator=generator())
    assert resumed[1] == whole[1][16:]


def test_a_checkpoint_from_before_one_order_for_every_world_size_resumes_in_its_own_order(tmp_path):
    from fitforge.checkpoint.files import load_checkpoint, save_checkpoint
    from fitforge.inputs.order import epoch_seed

    fit_with_batch_size(tmp_path, 8, resume=False, crash=Crash(at=8))
    path = tmp_path / "model-epoch1batch8.pt"
    checkpoint = load_checkpoint(path)
    for key in ("placeable", "offset", "legacy_seeding", "split"):  # keys an older fitforge did not write
        del checkpoint["data_order"][key]
    save_checkpoint(checkpoint, path)
    older = torch.Generator().manual_seed(epoch_seed(checkpoint["data_order"]["seed"], 1, "sampler"))
    order = torch.randperm(48, generator=older).tolist()  # the order it was trained in
    resumed = fit_with_batch_size(tmp_path, 8, resume=True, crash=Crash(at=10))
    assert resumed[1] == order[16:32]
    again = fit_with_batch_size(tmp_path, 8, resume=True)  # from a checkpoint the resumed run wrote
    assert again[1] == order[32:]


def test_a_resume_with_a_batch_size_that_cannot_end_at_the_checkpoint_is_refused_changing_nothing(tmp_path):
    fit_with_batch_size(tmp_path, 8, resume=False, crash=Crash(at=8), generator=torch.Generator().manual_seed(7))
    message = (
        r"the checkpoint stopped 16 sample\(s\) into epoch 2 \(in batches of 8\), but train_data now has batches of "
        r"5, which cannot continue at that sample \(train_data's order is not one for every number of ranks: its "
        r"RandomSampler draws from a generator of yours, which the ranks' split does not use\): resume with "
        r"batch_size=8"
    )
    torch.manual_seed(0)
    net = nn.Linear(6, 3)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    estimator.fit(DataLoader(TensorDataset(X, Y), batch_size=8), epochs=1, default_handlers=False)  # a notebook cell
    weights = net.weight.detach().clone()
    files = {name: (tmp_path / name).read_bytes() for name in checkpoint_files(tmp_path)}
    resumer = CheckpointHandler(tmp_path, batch_period=1, resume_from_checkpoint=True)
    own = DataLoader(TensorDataset(X, Y), batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(7))
    with pytest.raises(FitforgeValueError, match=message):
        estimator.fit(own, epochs=2, event_handlers=[resumer])
    assert net.weight.equal(weights) and estimator.history.epochs == 1  # nothing loaded, nothing lost
    assert {name: (tmp_path / name).read_bytes() for name in checkpoint_files(tmp_path)} == files


def test_a_resumed_fit_numbers_epochs_as_its_checkpoint_and_restarts_the_estimator_history(tmp_path):
    net = nn.Linear(6, 3)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    data = DataLoader(TensorDataset(X, Y), batch_size=8)
    estimator.fit(data, epochs=2, event_handlers=[CheckpointHandler(tmp_path)], default_handlers=False)
    seen = []

    class Epochs(BatchEnd):
        def batch_end(self, state):
            seen.append((state.run.epochs_before, state.epoch))

    resumer = CheckpointHandler(tmp_path, resume_from_checkpoint=True)
    estimator.fit(data, epochs=3, event_handlers=[resumer, Epochs()], default_handlers=False)
    assert set(seen) == {(0, 2)}  # epoch 3 of the checkpoint's run, not epoch 5 of the estimator's
    assert estimator.history.epochs == 3  # the resumed run's history, not 2 + 3 rows

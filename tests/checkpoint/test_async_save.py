"""CheckpointHandler(async_save=True): the same files as a synchronous save, written by a
background thread while training goes on; one write in flight at most; train_end waits for it; its
error is raised at the next save or at train_end. No timing is asserted: a writer held until the
training thread moves on proves the write runs beside training."""

import os
import signal
import threading
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fitforge.checkpoint.storage as storage
from fitforge import Estimator
from fitforge.checkpoint import checkpoint_bytes, checkpoint_from_bytes
from fitforge.checkpoint.async_writer import host_copy
from fitforge.checkpoint.files import CheckpointError, load_checkpoint
from fitforge.exceptions import FitforgeTypeError
from fitforge.handlers import CheckpointHandler, LambdaHandler
from helpers import checkpoint_files

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)


def run(folder, epochs, async_save, resume=False, handlers=()):
    """A net with dropout and Adam on shuffled data (every random draw matters); its final weights."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer, device="cpu")
    data = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)  # 6 batches an epoch
    saver = CheckpointHandler(
        folder, batch_period=4, max_checkpoints=20, resume_from_checkpoint=resume, async_save=async_save
    )
    estimator.fit(data, epochs=epochs, event_handlers=[*handlers, saver])
    return net.state_dict()


CLOCKS = {"epoch_time", "train_samples_per_s", "clock"}  # measured by the clock: the only values two runs do not share


def assert_equal(got, want, where="checkpoint"):
    """``got`` and ``want`` are equal: the same types, keys, tensors (dtype and bits), values."""
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            if key not in CLOCKS and not str(key).startswith("time_"):  # time_*_s: the clock's, by cause
                assert_equal(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want or (got != got and want != want), where  # nan equals nan here


def test_async_saves_write_the_same_checkpoints_and_resume_bitwise(tmp_path):
    uninterrupted = run(tmp_path / "sync", epochs=3, async_save=False)
    run(tmp_path / "async", epochs=3, async_save=True)
    names = checkpoint_files(tmp_path / "sync")
    assert names == checkpoint_files(tmp_path / "async")
    assert len(names) == 6  # 3 epoch ends, and every 4 batches (12 is an epoch's end)
    for name in names:
        assert_equal(load_checkpoint(tmp_path / "async" / name), load_checkpoint(tmp_path / "sync" / name), name)

    run(tmp_path / "resumed", epochs=2, async_save=True)
    weights = run(tmp_path / "resumed", epochs=3, async_save=True, resume=True)
    assert all(torch.equal(weights[key], uninterrupted[key]) for key in uninterrupted)


class HeldWriter:
    """Replaces the local file write: each write is held until the training thread begins the batch
    after the saved state (or train_end), recording when writes start and end."""

    def __init__(self, monkeypatch, fail_at: int | None = None, timeout: float = 30) -> None:
        self.events: list[tuple[str, int]] = []
        self.started = self.in_flight = self.most_in_flight = 0
        self.batches_begun, self.ended = 0, False
        self.moved_on: list[bool] = []  # per write: training began the next batch while it was held
        self.condition = threading.Condition()
        self.fail_at, self.timeout = fail_at, timeout
        self.real = storage.save_checkpoint
        monkeypatch.setattr(storage, "save_checkpoint", self.save)

    def save(self, checkpoint, path):
        with self.condition:
            self.started += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.events.append(("start", checkpoint["global_step"]))
            held = self.condition.wait_for(
                lambda: self.batches_begun > checkpoint["global_step"] or self.ended, timeout=self.timeout
            )
            self.moved_on.append(held)
        try:
            if self.started == self.fail_at:
                raise CheckpointError(f"cannot write {path}: No space left on device (the test's full disk)")
            return self.real(checkpoint, path)
        finally:
            with self.condition:
                self.in_flight -= 1
                self.events.append(("end", checkpoint["global_step"]))

    def handler(self) -> LambdaHandler:
        """Counts the batches begun; runs before the CheckpointHandler's train_end, which waits."""

        def begun(state) -> None:
            with self.condition:
                self.batches_begun += 1
                self.condition.notify_all()

        def ended(state) -> None:
            with self.condition:
                self.ended = True
                self.condition.notify_all()

        return LambdaHandler(batch_begin=begun, train_end=ended, priority=-100)


def test_one_write_in_flight_the_next_save_waits_and_train_end_waits(tmp_path, monkeypatch):
    writer = HeldWriter(monkeypatch)
    run(tmp_path, epochs=2, async_save=True, handlers=[writer.handler()])
    saved = [4, 6, 8, 12]  # batch_period=4, and each epoch's end (6 batches)
    # Each write starts only once the previous one ended, and the last one ended before fit returned.
    assert writer.events == [(kind, step) for step in saved for kind in ("start", "end")]
    assert writer.most_in_flight == 1
    assert writer.moved_on == [True] * 4  # training went on while each write was held (not a synchronous save)
    assert checkpoint_files(tmp_path) == [
        "model-epoch0batch4.pt",
        "model-epoch1batch6.pt",
        "model-epoch1batch8.pt",
        "model-epoch2batch12.pt",
    ]


@pytest.mark.parametrize("fail_at, raised_after", [(1, 6), (4, 12)])
def test_a_failed_background_write_is_raised_at_the_next_save_or_train_end(
    tmp_path, monkeypatch, caplog, fail_at, raised_after
):
    writer = HeldWriter(monkeypatch, fail_at=fail_at)
    batches = []
    counter = LambdaHandler(batch_end=lambda state: batches.append(state.global_step))
    with pytest.raises(CheckpointError, match="cannot write .*No space left on device"):
        run(tmp_path, epochs=2, async_save=True, handlers=[writer.handler(), counter])
    # Raised by the next save (after the 6th batch, at the epoch's end) or by train_end (the last save).
    assert len(batches) == raised_after
    failed = ["model-epoch0batch4.pt", "model-epoch1batch6.pt", "model-epoch1batch8.pt", "model-epoch2batch12.pt"]
    assert f"the background save of {failed[fail_at - 1]} failed: cannot write" in caplog.text
    kept = [name for name in failed[: len(writer.moved_on)] if name != failed[fail_at - 1]]
    assert checkpoint_files(tmp_path) == kept  # no temporary file, the others intact


def test_a_preemption_save_waits_for_the_write_in_flight_and_is_written_before_fit_stops(tmp_path, monkeypatch):
    writer = HeldWriter(monkeypatch, timeout=0.5)  # a write held in the training thread gives up after 0.5 s
    signal_at_batch_5 = LambdaHandler(
        batch_end=lambda state: os.kill(os.getpid(), signal.SIGTERM) if state.global_step == 4 else None
    )
    with pytest.raises(SystemExit) as stopped:
        run(tmp_path, epochs=2, async_save=True, handlers=[writer.handler(), signal_at_batch_5])
    assert stopped.value.code == 143
    # The save after 4 batches ended before the preemption save began, which training did not outrun.
    assert writer.events == [("start", 4), ("end", 4), ("start", 5), ("end", 5)] and writer.moved_on[-1] is False
    assert checkpoint_files(tmp_path) == ["model-epoch0batch4.pt", "model-epoch0batch5.pt"]


def test_a_full_disk_under_async_save_leaves_no_temporary_and_older_files_intact(tmp_path, monkeypatch):
    import fitforge.checkpoint.files as checkpoint_io

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full (a device that is always full) on this system")
    run(tmp_path, epochs=1, async_save=True)  # model-epoch0batch4.pt, model-epoch1batch6.pt
    real_fdopen = os.fdopen

    def full_disk(fd, mode="r", *args, **kwargs):
        os.close(fd)
        return real_fdopen(os.open("/dev/full", os.O_WRONLY), mode, *args, **kwargs)

    monkeypatch.setattr(checkpoint_io.os, "fdopen", full_disk)
    with pytest.raises(CheckpointError, match=r"cannot write .*model-epoch1batch8.pt: No space left on device"):
        run(tmp_path, epochs=2, async_save=True, resume=True)
    monkeypatch.undo()
    assert checkpoint_files(tmp_path) == ["model-epoch0batch4.pt", "model-epoch1batch6.pt"]
    load_checkpoint(tmp_path / "model-epoch1batch6.pt")


def test_the_host_copy_is_independent_of_training_and_keeps_ties_and_types():
    weight = torch.ones(3)
    state = {"model": OrderedDict(a=weight, b=weight), "history": [1.0, 2.0], "step": (torch.tensor(1), "x")}
    copied = host_copy(state)
    weight.add_(1)  # an optimizer step, in place
    state["history"].append(3.0)
    assert torch.equal(copied["model"]["a"], torch.ones(3)) and copied["history"] == [1.0, 2.0]
    assert type(copied["model"]) is OrderedDict and copied["model"]["a"] is copied["model"]["b"]
    assert isinstance(copied["step"], tuple) and copied["step"][1] == "x"


def test_async_save_must_be_a_bool(tmp_path):
    with pytest.raises(FitforgeTypeError, match="async_save must be True or False, got int 1"):
        CheckpointHandler(tmp_path, async_save=1)


def test_a_later_host_copy_reuses_the_earlier_copys_memory():
    weights = OrderedDict(a=torch.ones(3), b=torch.ones(2, 2))
    buffers: dict = {}
    first = host_copy({"model": weights}, buffers)
    weights["a"].add_(1)
    weights["b"] = torch.zeros(4)  # another shape: new memory
    second = host_copy({"model": weights}, buffers)
    assert second["model"]["a"] is first["model"]["a"] and torch.equal(second["model"]["a"], torch.full((3,), 2.0))
    assert second["model"]["b"] is not first["model"]["b"] and torch.equal(second["model"]["b"], torch.zeros(4))


class DictIO:
    """A store of one's own, bytes in a dict; writing ``fail`` raises, as a full disk would."""

    def __repr__(self):
        return "DictIO()"

    def __init__(self, fail=None):
        self.stored, self.fail, self.thread_names = {}, fail, []
        self.go = threading.Event()  # the failing write waits for it
        self.go.set()

    def write(self, name, checkpoint):
        self.thread_names.append(threading.current_thread().name)
        if name == self.fail:
            assert self.go.wait(30)
            raise OSError(f"no space left for {name}")
        self.stored[name] = checkpoint_bytes(checkpoint)

    def read(self, name):
        return checkpoint_from_bytes(self.stored[name], name)

    def names(self):
        return list(self.stored)

    def delete(self, name):
        self.stored.pop(name, None)


def test_async_checkpoint_io_wraps_any_store_in_order_and_a_failed_write_drops_what_follows(caplog):
    from fitforge.checkpoint import AsyncCheckpointIO

    store = DictIO(fail="new.pt")
    io = AsyncCheckpointIO(store)
    weights = torch.ones(3)
    io.write("old.pt", {"format_version": 1, "w": weights})
    weights.add_(1)  # training goes on: the write holds the host copy made when it was asked
    io.delete("older.pt")
    assert io.names() == ["old.pt"] and torch.equal(io.read("old.pt")["w"], torch.ones(3))
    assert store.thread_names == ["fitforge-save-old.pt"]  # written in the background
    store.go.clear()
    io.write("new.pt", {"format_version": 1, "w": weights})
    io.delete("old.pt")  # the rotation after it: queued behind the write that fails, dropped with it
    store.go.set()
    while io.busy:
        threading.Event().wait(0.01)
    assert "the background save of new.pt failed" in caplog.text  # logged when it failed
    with pytest.raises(CheckpointError, match=r"cannot write new.pt to DictIO\(\): OSError: no space left for new.pt"):
        io.write("newer.pt", {"format_version": 1, "w": weights})  # the next call raises it first
    assert store.names() == ["old.pt"]  # the older checkpoint was not rotated away, nothing written after
    io.wait()  # the error is raised once
    assert not hasattr(io, "folder_path") and not hasattr(io, "location")  # only what the store has


def test_a_store_given_wrapped_saves_in_the_background_as_async_save_does(tmp_path):
    from fitforge.checkpoint import AsyncCheckpointIO

    store = DictIO()
    saver = CheckpointHandler(io=AsyncCheckpointIO(store), batch_period=4)
    assert saver.async_save and saver.io is store
    net = nn.Linear(6, 3)
    run_with = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    run_with.fit(DataLoader(TensorDataset(X, Y), batch_size=8), epochs=1, event_handlers=[saver])
    assert sorted(store.stored) == ["model-epoch0batch4.pt", "model-epoch1batch6.pt"]  # written when fit returned
    assert set(store.thread_names) != {"MainThread"}


def test_async_save_through_a_store_of_ones_own_writes_what_a_synchronous_save_writes(tmp_path):
    stores = {mode: DictIO() for mode in ("sync", "async")}
    for mode, store in stores.items():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters()), device="cpu")
        saver = CheckpointHandler(io=store, batch_period=4, max_checkpoints=2, async_save=mode == "async")
        estimator.fit(DataLoader(TensorDataset(X, Y), batch_size=8), epochs=2, event_handlers=[saver])
    rotated = ["model-epoch1batch8.pt", "model-epoch2batch12.pt"]
    assert sorted(stores["sync"].stored) == sorted(stores["async"].stored) == rotated
    for name in stores["sync"].stored:
        assert_equal(stores["async"].read(name), stores["sync"].read(name), name)
    assert set(stores["async"].thread_names) != {"MainThread"}


def test_a_failed_background_save_is_not_counted_as_saved_nor_rotates_the_last_one():
    store = DictIO(fail="model-epoch0batch2.pt")
    net = nn.Linear(6, 3)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    saver = CheckpointHandler(io=store, batch_period=1, max_checkpoints=1, async_save=True)
    with pytest.raises(CheckpointError, match="cannot write model-epoch0batch2.pt"):
        estimator.fit(DataLoader(TensorDataset(X, Y), batch_size=8), epochs=1, event_handlers=[saver])
    assert sorted(store.stored) == ["model-epoch0batch1.pt"]
    assert [location.name for location in saver.saved] == ["model-epoch0batch1.pt"]

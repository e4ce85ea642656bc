"""A Hugging Face ``datasets.IterableDataset`` streamed from json files and shuffled through a buffer resumes
exactly: the buffer (fitforge.inputs.shuffle_buffer) gives datasets' own order, and its state holds what
it holds, so a resume reads no example of the source twice; through fit, alone with ``batch_size=`` or in a
plain single-process DataLoader. The kill -9 run is in test_stateful_kill9.py."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from fitforge import Estimator
from fitforge.handlers import CheckpointHandler
from fitforge.inputs.shuffle_buffer import ResumableShuffleBuffer, make_buffers_resumable
from helpers import Crash, Losses

datasets = pytest.importorskip("datasets", reason="Hugging Face streams need datasets (pip install 'fitforge[data]')")

FILES, ROWS = 8, 12  # 96 samples: 12 batches of 8 an epoch


def write_shards(folder) -> list[str]:
    """8 json-lines files of 12 samples each: an id ``i``, two features, a label."""
    folder.mkdir(exist_ok=True)
    paths = []
    for shard in range(FILES):
        path = folder / f"shard{shard}.jsonl"
        rows = [{"i": shard * ROWS + k, "x": [shard / 8, k / 12], "label": (shard + k) % 3} for k in range(ROWS)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths.append(str(path))
    return paths


class Reads:
    """The ids a ``.map`` sees: before the shuffle, the examples read from the source; after it, those yielded."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, example: dict) -> dict:
        self.ids.append(example["i"])
        return example


def stream(paths, read=None, seen=None, torch_format=False):
    """The json shards shuffled through a buffer of 16, ``read`` mapped before the shuffle, ``seen`` after it."""
    ds = datasets.load_dataset("json", data_files=paths, streaming=True, split="train")
    if read is not None:
        ds = ds.map(read)
    ds = ds.shuffle(seed=7, buffer_size=16)
    if seen is not None:
        ds = ds.map(seen)
    return ds.with_format("torch") if torch_format else ds


def ids(dataset) -> list[int]:
    return [int(example["i"]) for example in dataset]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"))


@pytest.mark.parametrize("epoch", [0, 1])
def test_the_resumable_buffer_gives_the_order_of_datasets_own_shuffle(paths, epoch):
    theirs, ours = stream(paths), stream(paths)
    assert make_buffers_resumable(ours) is not None
    assert isinstance(ours._ex_iterable, ResumableShuffleBuffer)
    theirs.set_epoch(epoch)
    ours.set_epoch(epoch)
    assert ids(ours) == ids(theirs) and sorted(ids(ours)) == list(range(FILES * ROWS))


@pytest.mark.parametrize("cut", [1, 7, 8, 9, 31, 60, 95, 96])
def test_a_state_saved_at_any_example_continues_the_stream_reading_no_consumed_example_again(paths, cut):
    whole = stream(paths, Reads(), Reads())
    make_buffers_resumable(whole)
    expected = ids(whole)
    first_reads, later_reads, later_seen = Reads(), Reads(), Reads()
    first = stream(paths, first_reads, Reads())  # the same pipeline as the resumed one
    make_buffers_resumable(first)
    examples = iter(first)
    head = [int(next(examples)["i"]) for _ in range(cut)]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as a checkpoint: loaded with weights_only=True
    buffer.seek(0)
    later = stream(paths, later_reads, later_seen)
    make_buffers_resumable(later)
    later.load_state_dict(torch.load(buffer, weights_only=True))
    assert head + ids(later) == expected
    assert later_seen.ids == expected[cut:]  # a transform after the shuffle sees the rest, once
    # From the source, no example consumed before the state is read again; the buffered ones come from the
    # state (datasets itself may read the open chunk of a shard again, here 2 examples of each).
    assert not set(head) & set(later_reads.ids) and set(first_reads.ids) | set(later_reads.ids) == set(expected)


def test_a_dataset_without_a_shuffle_buffer_is_left_as_it_is(paths):
    plain = datasets.load_dataset("json", data_files=paths, streaming=True, split="train")
    assert make_buffers_resumable(plain) is None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x, i):  # the dict batch's inputs by name; the id is not a feature
        return self.layers(x)


def train(folder, paths, wrap, crash=None, resume=False):
    """(weights, losses by step, ids read from the source, the dataset) of a fit on the stream."""
    torch.manual_seed(0)
    net = Net()
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01))
    losses, read, seen = Losses(), Reads(), Reads()
    dataset = stream(paths, read, seen, torch_format=True)
    saver = CheckpointHandler(folder, batch_period=5, max_checkpoints=2, resume_from_checkpoint=resume)
    data, batch_size = wrap(dataset)
    try:
        estimator.fit(
            data, epochs=2, batch_size=batch_size, event_handlers=[losses, saver, *([Crash(crash)] * bool(crash))]
        )
    except RuntimeError as error:
        assert str(error) == "crash"
    return {k: v.clone() for k, v in net.state_dict().items()}, losses.seen, (read.ids, seen.ids), dataset


@pytest.mark.parametrize(
    "wrap",
    [lambda ds: (ds, 8), lambda ds: (DataLoader(ds, batch_size=8), None)],
    ids=["alone with batch_size", "in a plain DataLoader"],
)
def test_a_fit_on_a_shuffled_stream_resumes_mid_epoch_bitwise_reading_each_sample_once(tmp_path, paths, wrap):
    whole, whole_losses, (_, whole_seen), _ = train(tmp_path / "whole", paths, wrap)
    _, _, (_, before), _ = train(tmp_path / "run", paths, wrap, crash=18)  # saved after 15: 3 batches into epoch 2
    weights, losses, (read, seen), dataset = train(tmp_path / "run", paths, wrap, resume=True)
    assert all(torch.equal(weights[k], whole[k]) for k in whole), "the resumed run ends elsewhere"
    assert losses == {step: whole_losses[step] for step in range(15, 24)}
    epoch = FILES * ROWS
    consumed = before[epoch : epoch + 3 * 8]  # epoch 2's samples trained on before the checkpoint
    assert seen == whole_seen[epoch + 3 * 8 :]  # after the resume, the transform sees the rest of the epoch only
    assert not set(consumed) & set(read)  # none of them read from the source again
    assert not isinstance(dataset._ex_iterable, ResumableShuffleBuffer)  # the user's own, back after fit


def test_a_stateful_loader_with_workers_over_interleaved_shards_falls_back_to_reading_and_discarding(paths):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from fitforge.inputs.order import DataOrder

    interleaved = DataOrder(StatefulDataLoader(stream(paths), batch_size=8, num_workers=2))  # no worker starts here
    assert interleaved.holder is None and "shuffle with max_buffer_input_shards=1 (or num_workers=0)" in (
        interleaved.problem
    )
    one_at_a_time = datasets.load_dataset("json", data_files=paths, streaming=True, split="train")
    loader = StatefulDataLoader(one_at_a_time.shuffle(seed=7, max_buffer_input_shards=1), batch_size=8, num_workers=2)
    order = DataOrder(loader, resumable=True)
    assert order.holder is loader and order.problem is None
    assert isinstance(loader.dataset._ex_iterable, ResumableShuffleBuffer)
    order.close()
    assert not isinstance(loader.dataset._ex_iterable, ResumableShuffleBuffer)
    interleaved.close()


def test_a_datasets_without_the_buffer_classes_keeps_its_own_buffer_with_a_warning(paths, monkeypatch, caplog, request):
    import sys

    import fitforge.inputs
    from fitforge.inputs import stateful
    from fitforge.inputs.order import DataOrder

    monkeypatch.setitem(sys.modules, "fitforge.inputs.shuffle_buffer", None)  # its import fails, as on a moved class
    monkeypatch.delattr(fitforge.inputs, "shuffle_buffer", raising=False)
    stateful.datasets_internals.cache_clear()  # looked up once a process: again, without it
    request.addfinalizer(stateful.datasets_internals.cache_clear)  # and again after, with it
    dataset = stream(paths)
    own = dataset._ex_iterable
    with caplog.at_level("WARNING", logger="fitforge"):
        order = DataOrder(DataLoader(dataset, batch_size=8), resumable=True)
    assert order.holder is dataset and dataset._ex_iterable is own
    assert "a resumed stream loses the examples in its shuffle buffer" in caplog.text
    order.close()


def test_a_stream_resumed_from_an_epoch_ends_checkpoint_reads_the_next_epoch_whole(tmp_path, paths):
    def alone(ds):
        return ds, 8

    whole, whole_losses, _, _ = train(tmp_path / "whole", paths, alone)
    train(tmp_path / "run", paths, alone, crash=13)  # saved after 12 batches: epoch 1's end
    weights, losses, _, _ = train(tmp_path / "run", paths, alone, resume=True)
    assert losses == {step: whole_losses[step] for step in range(12, 24)}
    assert all(torch.equal(weights[k], whole[k]) for k in whole)


def test_a_stream_fit_without_checkpoints_keeps_its_own_buffer(paths):
    from fitforge.inputs.order import DataOrder

    dataset = stream(paths)
    own = dataset._ex_iterable
    DataOrder(DataLoader(dataset, batch_size=8))  # no handler saves checkpoints: nothing to resume
    assert dataset._ex_iterable is own


def test_the_users_stream_reads_whole_after_a_resumed_fit(tmp_path, paths):
    def alone(ds):
        return ds, 8

    train(tmp_path, paths, alone, crash=18)
    *_, dataset = train(tmp_path, paths, alone, resume=True)  # loaded the replacement buffer's state
    assert sorted(ids(dataset.with_format(None))) == list(range(FILES * ROWS))

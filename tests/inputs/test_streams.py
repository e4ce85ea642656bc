"""A Hugging Face stream read whole by every rank and worker (fitforge.inputs.streams): each rank's batches
are its slice of the same steps, every rank has as many, every example once in an epoch, and the state
after any step continues the epoch on another number of ranks, or in batches of another size, with the
rest of its examples. Ranks are simulated here by StreamShare(ranks=, rank=) in one process; torchrun's
ranks and workers are in tests/distributed/test_streams_ranks.py."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from test_shuffle_buffer import FILES, ROWS, stream, write_shards
from torch.utils.data import DataLoader, default_collate

from fitforge.exceptions import FitforgeValueError
from fitforge.inputs.order import DataOrder
from fitforge.inputs.shuffle_buffer import make_buffers_resumable
from fitforge.inputs.streams import LIVE, SharedStream, StreamShare, shared_stream

datasets = pytest.importorskip("datasets", reason="Hugging Face streams need datasets (pip install 'fitforge[data]')")

ALL = list(range(FILES * ROWS))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"))


def source(paths, state=None, epoch=0):
    ds = stream(paths, torch_format=True)
    make_buffers_resumable(ds)
    ds.set_epoch(epoch)
    if state is not None:
        ds.load_state_dict(state)
    return ds


def epoch_of(paths, ranks, batch_size, state=None, stop_after=None, drop_last=False):
    """Each rank's batches (lists of ids) of one pass, and the state after step ``stop_after`` (rank 0's)."""
    shares = [
        StreamShare(source(paths, state), batch_size, drop_last, default_collate, ranks, rank) for rank in range(ranks)
    ]
    batches, states = [], []
    for share in shares:
        mine = []
        for step, (batch, snapshot) in enumerate(share):
            mine.append(batch["i"].tolist())
            if step == stop_after:  # one rank reads no step ahead: its stream's state is the position
                states.append(share.source.state_dict() if snapshot.state is LIVE else snapshot.state)
        batches.append(mine)
    assert all(s == states[0] for s in states), "every rank's stream has the same state after the same step"
    return batches, (states[0] if states else None)


def through_a_checkpoint(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def flat(batches):
    return [i for rank in batches for batch in rank for i in batch]


@pytest.mark.parametrize(("ranks", "batch_size"), [(1, 8), (2, 8), (3, 8), (3, 5), (4, 7), (5, 19)])
def test_every_rank_has_as_many_batches_and_the_epoch_every_example_once(paths, ranks, batch_size):
    batches, _ = epoch_of(paths, ranks, batch_size)
    assert len({len(rank) for rank in batches}) == 1  # DDP's lockstep: no rank waits for another at the end
    assert all(batch for rank in batches for batch in rank)
    assert sorted(flat(batches)) == ALL
    steps = list(zip(*batches))  # a step's slices, rank by rank, are the stream's next examples
    assert [i for step in steps for batch in step for i in batch] == [int(e["i"]) for e in source(paths)]
    assert all(len(batch) == batch_size for step in steps[:-2] for batch in step)


def test_a_last_step_of_fewer_examples_than_ranks_joins_the_step_before(paths):
    batches, _ = epoch_of(paths, 5, 19)  # 96 = 19 * 5 + 1: the last example alone would leave 4 ranks without
    assert [len(batch) for rank in batches for batch in rank[-1:]] == [20, 19, 19, 19, 19]


def test_drop_last_drops_a_last_partial_step(paths):
    batches, _ = epoch_of(paths, 3, 10, drop_last=True)  # 96 = 30 * 3 + 6
    assert len(flat(batches)) == 90 and all(len(batch) == 10 for rank in batches for batch in rank)


@pytest.mark.parametrize(
    ("before", "after"),
    [((2, 8), (1, 8)), ((2, 8), (3, 8)), ((2, 8), (2, 8)), ((3, 5), (2, 7)), ((1, 8), (3, 4))],
)
def test_a_state_after_any_step_continues_the_epoch_on_other_ranks_with_its_other_examples(paths, before, after):
    (ranks, batch_size), (new_ranks, new_batch_size) = before, after
    first, state = epoch_of(paths, ranks, batch_size, stop_after=2)
    trained = [i for rank in first for batch in rank[:3] for i in batch]
    rest, _ = epoch_of(paths, new_ranks, new_batch_size, state=through_a_checkpoint(state))
    assert sorted(trained + flat(rest)) == ALL
    if before == after:  # the same world: the very batches of the uninterrupted epoch
        assert [rank[:3] + later for rank, later in zip(first, rest)] == first


def test_the_next_epoch_after_a_resumed_one_is_whole(paths):
    _, state = epoch_of(paths, 2, 8, stop_after=1)
    share = StreamShare(source(paths, through_a_checkpoint(state)), 8, False, default_collate, 3, 0)
    list(share)  # the resumed epoch
    share.source.set_epoch(1)
    whole = StreamShare(source(paths, epoch=1), 8, False, default_collate, 3, 0)
    assert [b["i"].tolist() for b, _ in share] == [b["i"].tolist() for b, _ in whole]


def test_fewer_examples_left_than_ranks_are_left_out_with_a_warning(paths, caplog):
    _, state = epoch_of(paths, 1, 94, stop_after=0)  # 2 examples left, for 3 ranks
    shares = [StreamShare(source(paths), 8, False, default_collate, 3, rank) for rank in range(3)]
    for share in shares:
        share.source.load_state_dict(through_a_checkpoint(state))
        share.resumed = state["epoch"]
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        assert [list(share) for share in shares] == [[], [], []]
    assert "ends with 2 example(s) for 3 ranks" in caplog.text


def test_an_epoch_of_fewer_examples_than_ranks_is_refused(paths):
    tiny = source(paths).take(2)
    with pytest.raises(FitforgeValueError, match="holds 2 example\\(s\\) in epoch 1, fewer than the 3 ranks"):
        list(StreamShare(tiny, 8, False, default_collate, 3, 0))


def test_one_rank_in_this_process_copies_no_state_per_batch(paths):
    snapshots = [snapshot.state for _, snapshot in StreamShare(source(paths), 8, False, default_collate, 1, 0)]
    assert snapshots and all(state is LIVE for state in snapshots)  # asked of the stream when a checkpoint saves
    several = [snapshot.state for _, snapshot in StreamShare(source(paths), 8, False, default_collate, 2, 0)]
    assert all(isinstance(state, dict) for state in several)  # read ahead: a copy at each step


def test_a_stream_in_a_plain_loader_is_shared_where_a_checkpoint_may_save_it(paths):
    ds = stream(paths, torch_format=True)
    loader = DataLoader(ds, batch_size=8, num_workers=0)
    assert shared_stream(loader, resumable=False) is None  # one rank, nothing saved: read as it is
    shared = shared_stream(loader, resumable=True)
    assert isinstance(shared, SharedStream) and shared.source is ds
    assert [batch["i"].tolist() for batch in shared] == [batch["i"].tolist() for batch in loader]
    assert shared.state_dict() is not None
    from datasets.distributed import split_dataset_by_node

    split = split_dataset_by_node(ds, rank=0, world_size=2)
    assert shared_stream(DataLoader(split, batch_size=8), resumable=True) is None  # split by the user: theirs


def test_data_order_reads_a_shared_stream_and_saves_its_state(paths):
    ds = stream(paths, torch_format=True)
    order = DataOrder(DataLoader(ds, batch_size=8, num_workers=0), resumable=True)
    assert order.holder is order.stream and order.problem is None
    assert order.stream is not None and order.stream.generator is not None  # its workers' seeds are the fit's
    state = order.state_dict()
    assert state["data_state"] is None  # nothing read yet
    order.close()


def test_two_builds_of_a_stream_are_the_same_only_when_seeded_and_whole(paths):
    from fitforge.inputs.shuffle_buffer import stream_identity

    def built(seed):
        return datasets.load_dataset("json", data_files=paths, streaming=True, split="train").shuffle(seed=seed)

    assert stream_identity(built(7)) == stream_identity(built(7)) != stream_identity(built(8))
    assert stream_identity(built(None)) != stream_identity(built(None))  # each draws its own
    assert stream_identity(built(7).shard(2, 0)) != stream_identity(built(7).shard(2, 1))  # a rank's own files


def test_a_stream_is_not_split_where_the_strategy_splits_no_data(paths):
    loader = DataLoader(stream(paths, torch_format=True), batch_size=8, in_order=False)
    shared = shared_stream(loader, resumable=True, split=False)
    assert shared is not None and shared.loader.dataset.ranks == 1
    assert shared.loader.in_order  # the steps in order: the last one's state is the position

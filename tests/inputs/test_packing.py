"""PackedDocuments: documents packed into rows with their positions, documents and labels; resumable
from its state_dict exactly; with accumulation, a packed step is the step on the documents unpacked."""

import io

import pytest
import torch
from packed_lm import TinyCausalLM, documents, tiny_llama
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fitforge import Estimator
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, GradientUpdateHandler
from fitforge.inputs.packing import IGNORE_INDEX, PackedDocuments
from helpers import Crash, Losses

X = IGNORE_INDEX


def rows_as_lists(rows):
    return [{key: value.tolist() for key, value in row.items()} for row in rows]


def test_documents_fill_rows_in_order_and_the_rest_is_padding():
    rows = rows_as_lists(PackedDocuments([[1, 2, 3], [4, 5], [], [6, 7, 8, 9], [10]], 5, pad_id=0))
    assert rows == [
        {
            "input_ids": [1, 2, 3, 4, 5],
            "position_ids": [0, 1, 2, 0, 1],
            "labels": [2, 3, X, 5, X],
            "document_ids": [0, 0, 0, 1, 1],
        },
        {
            "input_ids": [6, 7, 8, 9, 10],
            "position_ids": [0, 1, 2, 3, 0],
            "labels": [7, 8, 9, X, X],
            "document_ids": [3, 3, 3, 3, 4],
        },
    ]
    rows = rows_as_lists(PackedDocuments([[1, 2, 3], [4, 5, 6]], 5, pad_id=9))  # the second does not fit the first
    assert rows[0] == {
        "input_ids": [1, 2, 3, 9, 9],
        "position_ids": [0, 1, 2, 0, 1],  # padding is a document of its own (id -1), never attended by others
        "labels": [2, 3, X, X, X],
        "document_ids": [0, 0, 0, -1, -1],
    }
    assert rows[1]["input_ids"] == [4, 5, 6, 9, 9]


def test_labels_for_a_model_that_shifts_them():
    rows = rows_as_lists(PackedDocuments([[1, 2, 3], [4, 5]], 6, labels="tokens", document_ids=False))
    assert rows == [{"input_ids": [1, 2, 3, 4, 5, 0], "position_ids": [0, 1, 2, 0, 1, 0], "labels": [X, 2, 3, X, 5, X]}]


def test_split_fills_every_row_and_the_document_goes_on_in_the_next():
    rows = rows_as_lists(PackedDocuments([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11]], 5, split=True))
    assert [row["input_ids"] for row in rows] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 0, 0, 0, 0]]
    assert [row["position_ids"] for row in rows] == [[0, 1, 2, 0, 1], [2, 3, 4, 5, 6], [7, 0, 1, 2, 3]]
    assert [row["labels"] for row in rows] == [[2, 3, X, 5, 6], [7, 8, 9, 10, 11], [X, X, X, X, X]]
    assert [row["document_ids"] for row in rows] == [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [1, -1, -1, -1, -1]]


def test_documents_of_any_integer_form_and_mappings_of_token_ids():
    docs = [torch.tensor([1, 2], dtype=torch.int32), (3,), {"input_ids": [4, 5], "attention_mask": [1, 1]}]
    (row,) = PackedDocuments(docs, 6)
    assert row["input_ids"].tolist() == [1, 2, 3, 4, 5, 0] and row["input_ids"].dtype is torch.long
    (row,) = PackedDocuments([{"ids": [7, 8]}], 2, key="ids")
    assert row["input_ids"].tolist() == [7, 8]


def test_bad_arguments_and_documents_are_named():
    with pytest.raises(FitforgeTypeError, match="documents must be re-iterable .* pass a list, or a class whose"):
        PackedDocuments(iter([[1, 2]]), 4)
    with pytest.raises(FitforgeTypeError, match="PackedDocuments: documents must be re-iterable"):
        PackedDocuments("some text", 4)
    with pytest.raises(FitforgeValueError, match="PackedDocuments: length must be a positive int, got 0"):
        PackedDocuments([[1]], 0)
    with pytest.raises(FitforgeValueError, match=r"labels must be one of \('next', 'tokens'\), got 'shifted'"):
        PackedDocuments([[1]], 4, labels="shifted")
    with pytest.raises(FitforgeTypeError, match="PackedDocuments: pad_id must be an int"):
        PackedDocuments([[1]], 4, pad_id=None)
    with pytest.raises(FitforgeTypeError, match="PackedDocuments: split must be True or False, got int 1"):
        PackedDocuments([[1]], 4, split=1)
    too_long = [[1, 2], [1, 2, 3, 4, 5]]
    with pytest.raises(
        FitforgeValueError, match="document 1 has 5 tokens, more than a row's length=4: pass split=True"
    ):
        list(PackedDocuments(too_long, 4))
    with pytest.raises(
        FitforgeTypeError, match=r"document 1 must be a 1-D sequence of integer token ids, got a torch.float"
    ):
        list(PackedDocuments([[1], [0.5, 2.0]], 4))
    with pytest.raises(FitforgeTypeError, match=r"document 0 must be a 1-D sequence .* shape \(1, 2\)"):
        list(PackedDocuments([[[1, 2]]], 4))
    with pytest.raises(FitforgeTypeError, match="document 0 must be a sequence of token ids, got str"):
        list(PackedDocuments(["text"], 4))
    with pytest.raises(
        FitforgeValueError, match=r"document 0 is a mapping without key='input_ids' \(it has \['text'\]\)"
    ):
        list(PackedDocuments([{"text": "a"}], 4))
    with pytest.raises(FitforgeValueError, match="load_state_dict: state must be a PackedDocuments.state_dict()"):
        PackedDocuments([[1]], 4).load_state_dict({"read": 1})
    with pytest.raises(FitforgeValueError, match="the state holds its source's own state, but these documents"):
        PackedDocuments([[1]], 4).load_state_dict({"read": 1, "finished": False, "pending": None, "source": {"at": 1}})


class CountedDocuments(Dataset):
    """A map-style dataset of documents counting its reads: a resumed pass must not read the ones before."""

    def __init__(self, docs):
        self.docs, self.reads = docs, 0

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, index):
        self.reads += 1
        return self.docs[index]


class DocumentStream:
    """Documents as a stream of its own that resumes from its state (as a Hugging Face IterableDataset)."""

    def __init__(self, docs):
        self.docs, self.at, self.reads = docs, 0, 0

    def __iter__(self):
        while self.at < len(self.docs):
            self.at += 1
            self.reads += 1
            yield {"input_ids": self.docs[self.at - 1]}
        self.at = 0

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.at = state["at"]


class DocumentIterable:
    """Re-iterable documents with no positions and no state: a resume skips the documents read."""

    def __init__(self, docs):
        self.docs = docs

    def __iter__(self):
        return iter(list(self.docs))


SOURCES = {"list": list, "dataset": CountedDocuments, "stream": DocumentStream, "iterable": DocumentIterable}


def saved_and_loaded(state):
    """The state through torch.save and a weights-only load, as a checkpoint keeps it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("source", list(SOURCES))
def test_a_packer_loaded_with_a_mid_pass_state_yields_the_rows_an_uninterrupted_one_would(source, split):
    docs = documents(seed=3, count=14, longest=10)
    whole = rows_as_lists(PackedDocuments(SOURCES[source](docs), 10, split=split))
    for taken in range(len(whole) + 1):  # every row boundary, the end of the pass included
        packer = PackedDocuments(SOURCES[source](docs), 10, split=split)
        rows = iter(packer)
        first = [next(rows) for _ in range(taken)]
        state = saved_and_loaded(packer.state_dict())
        resumed_source = SOURCES[source](docs)
        resumed = PackedDocuments(resumed_source, 10, split=split)
        resumed.load_state_dict(state)
        rest = rows_as_lists(resumed)
        assert rows_as_lists(first) + rest == whole, taken
        assert rest == rows_as_lists(rows)  # what the uninterrupted packer yields next
        if source in ("dataset", "stream"):  # the documents before the state are not read again
            assert resumed_source.reads == len(docs) - state["read"]
        assert rows_as_lists(resumed) == whole  # the pass after the resumed one is a whole pass


def test_the_state_holds_the_document_waiting_for_the_next_row():
    packer = PackedDocuments([[1, 2, 3], [4, 5, 6], [7]], 4)
    rows = iter(packer)
    next(rows)
    state = packer.state_dict()
    assert state["read"] == 2 and state["source"] is None
    assert state["pending"]["document"] == 1 and state["pending"]["tokens"].tolist() == [4, 5, 6]
    list(rows)
    finished = packer.state_dict()
    assert finished == {"read": 3, "finished": True, "pending": None, "source": None}
    resumed = PackedDocuments([[1, 2, 3], [4, 5, 6], [7]], 4)
    resumed.load_state_dict(finished)
    assert list(resumed) == []  # nothing is left of that pass (a loader resumed after its last batch)
    assert len(list(resumed)) == 2  # the next pass is a whole one


def test_resuming_a_data_loader_over_the_packer_gives_the_next_batches():
    """With num_workers=0 a DataLoader reads the packer batch by batch: its state after k batches is theirs."""
    docs = documents(seed=4, count=30)
    whole = [rows_as_lists([b]) for b in DataLoader(PackedDocuments(docs, 16), batch_size=3)]
    packer = PackedDocuments(docs, 16)
    batches = iter(DataLoader(packer, batch_size=3))
    next(batches), next(batches)
    resumed = PackedDocuments(docs, 16)
    resumed.load_state_dict(saved_and_loaded(packer.state_dict()))
    assert [rows_as_lists([b]) for b in DataLoader(resumed, batch_size=3)] == whole[2:]


@pytest.mark.integration  # DataLoader workers are processes
def test_each_worker_packs_its_share_so_every_document_comes_once():
    docs = documents(seed=5, count=40)
    seen = []
    for batch in DataLoader(PackedDocuments(docs, 16), batch_size=2, num_workers=2):
        ids, tokens = batch["document_ids"], batch["input_ids"]
        for index in ids.unique().tolist():
            if index >= 0:
                seen.append(index)
                assert tokens[ids == index].tolist() == docs[index]
    assert sorted(seen) == list(range(40))


def test_a_hugging_face_iterable_dataset_resumes_from_its_own_state_without_reading_again():
    datasets = pytest.importorskip("datasets")
    docs = documents(seed=7, count=60)
    reads = []

    def stream():  # 4 shards streamed, each document read counted
        source = datasets.Dataset.from_list([{"input_ids": doc} for doc in docs]).to_iterable_dataset(num_shards=4)
        return source.map(lambda document: (reads.append(1), document)[1])

    whole = rows_as_lists(PackedDocuments(stream(), 16))
    for taken in (0, 3, 7, len(whole)):
        packer = PackedDocuments(stream(), 16)
        rows = iter(packer)
        first = [next(rows) for _ in range(taken)]
        state = saved_and_loaded(packer.state_dict())
        resumed = PackedDocuments(stream(), 16)
        resumed.load_state_dict(state)
        reads.clear()
        assert rows_as_lists(first) + rows_as_lists(resumed) == whole
        assert len(reads) == len(docs) - state["read"]  # the stream went on from its state


@pytest.mark.integration  # DataLoader workers are processes
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11's own call
def test_torchdatas_stateful_loader_resumes_the_packers_of_its_workers():
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

    def loader():
        return stateful_dataloader.StatefulDataLoader(PackedDocuments(docs, 16), batch_size=2, num_workers=2)

    docs = documents(seed=5, count=60)
    whole = rows_as_lists(loader())
    for taken in (1, 6, len(whole)):  # mid-pass, and after the last batch (its end not yet read)
        interrupted = loader()
        batches = iter(interrupted)
        first = [next(batches) for _ in range(taken)]
        resumed = loader()
        resumed.load_state_dict(interrupted.state_dict())
        assert rows_as_lists(first) + rows_as_lists(resumed) == whole, taken
    finished = loader()
    list(finished)
    resumed = loader()
    resumed.load_state_dict(finished.state_dict())
    assert rows_as_lists(resumed) == whole  # a state saved at an epoch's end: the next epoch is whole


def unpacked_batch(docs):
    """Every document in a row of its own, padded: the big batch packing stands for."""
    width = max(len(doc) for doc in docs)
    batch = {key: torch.full((len(docs), width), fill) for key, fill in [("input_ids", 0), ("labels", X)]}
    batch["position_ids"] = torch.arange(width).repeat(len(docs), 1)
    batch["document_ids"] = torch.full((len(docs), width), -1)
    for row, doc in enumerate(docs):
        batch["input_ids"][row, : len(doc)] = torch.tensor(doc)
        batch["labels"][row, : len(doc) - 1] = torch.tensor(doc[1:], dtype=torch.long)
        batch["document_ids"][row, : len(doc)] = row
    return batch


def weights_after(data, handler):
    net = TinyCausalLM()
    estimator = Estimator(net, nn.CrossEntropyLoss(), device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.5))
    estimator.fit(data, epochs=1, event_handlers=[handler], default_handlers=False)
    return {name: value.detach().clone() for name, value in net.state_dict().items()}


def test_with_accumulate_4_a_packed_step_is_the_step_on_the_unpacked_big_batch():
    docs = documents(seed=6, count=30)  # 12 rows of 16 tokens: 4 batches of 3
    loader = DataLoader(PackedDocuments(docs, 16), batch_size=3)
    batches = list(loader)
    assert len(batches) == 4
    assert len({int((b["labels"] != X).sum()) for b in batches}) > 1  # the batches predict different counts
    packed = weights_after(loader, GradientUpdateHandler(accumulate=4))
    big_batch = weights_after([unpacked_batch(docs)], GradientUpdateHandler())
    for name in big_batch:
        torch.testing.assert_close(packed[name], big_batch[name], rtol=1e-8, atol=1e-10)
    alike = weights_after(loader, GradientUpdateHandler(accumulate=4, items=None))  # the flaw counting mends
    assert any(not torch.allclose(alike[name], big_batch[name], rtol=1e-6) for name in big_batch)


def hugging_face_weights_after(data, handler):
    net = tiny_llama(layers=1, double=False)
    estimator = Estimator(net, None, device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.5))
    estimator.fit(data, epochs=1, event_handlers=[handler], default_handlers=False)
    return {name: value.detach().clone() for name, value in net.state_dict().items()}


def test_a_hugging_face_llamas_packed_accumulated_step_is_the_step_on_the_unpacked_big_batch():
    docs = documents(seed=6, count=30)
    loader = DataLoader(PackedDocuments(docs, 16, labels="tokens", document_ids=False), batch_size=3)
    assert len(list(loader)) == 4
    width = max(len(doc) for doc in docs)
    big_batch = {
        "input_ids": torch.tensor([doc + [0] * (width - len(doc)) for doc in docs]),
        "attention_mask": torch.tensor([[1] * len(doc) + [0] * (width - len(doc)) for doc in docs]),
        "labels": torch.tensor([doc + [X] * (width - len(doc)) for doc in docs]),
    }
    packed = hugging_face_weights_after(loader, GradientUpdateHandler(accumulate=4))
    unpacked = hugging_face_weights_after([big_batch], GradientUpdateHandler())
    for name in unpacked:  # the model's loss computes in float32
        torch.testing.assert_close(packed[name], unpacked[name], rtol=1e-5, atol=1e-6)
    alike = hugging_face_weights_after(loader, GradientUpdateHandler(accumulate=4, items=None))
    assert any(not torch.allclose(alike[name], unpacked[name], rtol=1e-4, atol=1e-5) for name in unpacked)


def packed_fit(folder, crash=None, resume=False, source=None):
    """(weights, losses by step) of 2 epochs on packed rows, checkpointed every 5 batches; a crash after
    batch ``crash`` (1-based) is the kill of a run, ``resume`` its re-run."""
    net = TinyCausalLM(seed=3)
    torch.manual_seed(0)
    estimator = Estimator(net, nn.CrossEntropyLoss(), device="cpu", optimizer=torch.optim.Adam(net.parameters(), 0.01))
    losses = Losses()
    saver = CheckpointHandler(folder, epoch_period=1, batch_period=5, max_checkpoints=2, resume_from_checkpoint=resume)
    docs = documents(count=40) if source is None else source()
    data = DataLoader(PackedDocuments(docs, length=12), batch_size=2)  # 11 batches an epoch
    try:
        estimator.fit(data, epochs=2, event_handlers=[losses, saver, *([Crash(crash)] if crash else [])])
    except RuntimeError as error:
        assert str(error) == "crash"
    return {name: value.clone() for name, value in net.state_dict().items()}, losses.seen


# Resumed from the saves after batch 5 (mid-epoch 1), 11 (epoch 1's end: its packer's pass finished) and 15.
@pytest.mark.parametrize("crash", [7, 13, 17])
def test_a_fit_on_packed_rows_killed_anywhere_resumes_bitwise(tmp_path, crash):
    whole, whole_losses = packed_fit(tmp_path / "whole")
    _, before = packed_fit(tmp_path / "run", crash=crash)
    weights, after = packed_fit(tmp_path / "run", resume=True)
    assert {**before, **after} == whole_losses and len(whole_losses) == 22  # the next epoch is complete too
    assert all(torch.equal(weights[name], whole[name]) for name in whole)


def test_a_fit_on_packed_rows_of_a_hugging_face_stream_resumes_bitwise_in_every_epoch(tmp_path):
    datasets = pytest.importorskip("datasets")
    files = []
    for shard in range(4):  # the 40 documents in 4 json-lines files
        path = tmp_path / f"docs{shard}.jsonl"
        path.write_text(
            "".join(f'{{"input_ids": {doc}}}\n' for doc in documents(count=40)[shard * 10 : shard * 10 + 10])
        )
        files.append(str(path))

    def stream():
        return datasets.load_dataset("json", data_files=files, streaming=True, split="train")

    whole, whole_losses = packed_fit(tmp_path / "whole", source=stream)
    _, before = packed_fit(tmp_path / "run", crash=7, source=stream)  # resumed from the save after 5
    weights, after = packed_fit(tmp_path / "run", resume=True, source=stream)  # epoch 2 from its start
    assert {**before, **after} == whole_losses and len(whole_losses) == 22
    assert all(torch.equal(weights[name], whole[name]) for name in whole)

"""Whole arrays as data: fit((X, y), batch_size=..., validation_split=...), evaluate and predict."""

import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler, TensorDataset

from fitforge import Estimator
from fitforge.events import BatchBegin
from fitforge.exceptions import BatchFormatError, FitforgeTypeError, FitforgeValueError, LossInputError
from fitforge.inputs.arrays import array_loader, fit_loaders, is_arrays, split_off


def blobs(n=100, seed=0):
    """Two well separated classes in 2-D, as NumPy arrays (float64 features, int labels)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.normal(size=(n, 2)) + 3 * y[:, None]
    return x, y


def classifier():
    torch.manual_seed(0)
    net = nn.Linear(2, 2)
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.1), device="cpu")


class Sizes(BatchBegin):
    def __init__(self):
        self.sizes = []

    def batch_begin(self, state):
        self.sizes.append(len(state.batch[0]))


def test_fit_takes_numpy_arrays_with_a_validation_split_and_learns():
    x, y = blobs()
    sizes = Sizes()
    history = classifier().fit((x, y), epochs=8, batch_size=16, validation_split=0.2, event_handlers=[sizes])
    assert sizes.sizes[:5] == [16, 16, 16, 16, 16] and sizes.sizes[4] == 16 and len(sizes.sizes) == 8 * 5
    assert history.last("val_accuracy") >= 0.9 and "val_loss" in history


def test_val_data_may_be_arrays_and_tensors_work_as_they_are():
    x, y = blobs()
    est = classifier()
    history = est.fit((torch.tensor(x, dtype=torch.float32), torch.tensor(y)), val_data=blobs(40, seed=1), epochs=8)
    assert len(history["val_loss"]) == 8
    assert est.evaluate(blobs(40, seed=1), batch_size=8)["val_accuracy"] == history.last("val_accuracy") >= 0.9


def test_the_training_loader_shuffles_and_validation_keeps_the_order():
    x, y = blobs()
    train, val = fit_loaders((x, y), None, 10, 0.3)
    assert isinstance(train.sampler, RandomSampler) and train.batch_size == 10
    assert isinstance(val.sampler, SequentialSampler) and len(val.dataset) == 30
    assert train.dataset.tensors[0].dtype == torch.float32 and train.dataset.tensors[1].dtype == torch.int64
    # The held-out part is the arrays' last 30%, before any shuffling, as in Keras.
    assert val.dataset.tensors[0].equal(torch.tensor(x[70:], dtype=torch.float32))


class Samples(IterableDataset):
    """A stream of (features, label) samples, as a Hugging Face IterableDataset is one of examples."""

    def __init__(self, x, y):
        self.x, self.y = torch.tensor(x, dtype=torch.float32), torch.tensor(y)

    def __iter__(self):
        return zip(self.x, self.y)


def test_a_stream_of_samples_given_with_a_batch_size_is_batched_in_this_process():
    x, y = blobs(70)
    train, _ = fit_loaders(Samples(x, y), None, 32, None)
    assert type(train) is DataLoader and train.num_workers == 0 and [len(b[0]) for b in train] == [32, 32, 6]
    history = classifier().fit(Samples(x, y), epochs=2, batch_size=32)
    assert len(history["train_loss"]) == 2
    assert fit_loaders(Samples(x, y), None, None, None)[0].__class__ is Samples  # without one: as it is


def test_the_default_batch_size_is_32_and_uint8_labels_become_int64():
    x = np.zeros((70, 3), dtype=np.float64)
    labels = np.arange(70, dtype=np.uint8) % 3
    loader = array_loader((x, labels), 32, shuffle=False, argument="train_data")
    assert [len(b[0]) for b in loader] == [32, 32, 6]
    train, _ = fit_loaders((x, labels), None, None, None)
    assert train.batch_size == 32 and train.dataset.tensors[1].dtype == torch.int64
    images = np.zeros((4, 2, 2), dtype=np.uint8)  # not one value per sample: left as it is
    assert array_loader((images, labels[:4]), 2, False, "x").dataset.tensors[0].dtype == torch.uint8


def test_predict_takes_a_bare_array_and_keeps_its_order():
    x, y = blobs()
    est = classifier()
    est.fit((x, y), epochs=3)
    pred = est.predict(x, batch_size=7)
    assert pred.shape == (100, 2)
    in_halves = est.predict(DataLoader(TensorDataset(torch.tensor(x, dtype=torch.float32)), batch_size=50))
    assert torch.allclose(pred, in_halves, rtol=0, atol=1e-6)  # other batch sizes: a CPU's kernels may round apart
    batches = [torch.zeros(3, 2), torch.ones(3, 2)]  # for predict, a list of tensors is a list of batches
    assert est.predict(batches).shape == (6, 2)


def test_lists_of_batches_are_not_arrays():
    x = torch.zeros(4, 2)
    assert is_arrays((x, torch.zeros(4))) and is_arrays([x, np.zeros(4)])
    assert not is_arrays((x, x, x))  # (X, y) only: several inputs go in batches, ((x1, x2), y)
    assert not is_arrays([(x, torch.zeros(4)), (x, torch.zeros(4))])  # two batches
    assert not is_arrays((x,)) and not is_arrays((torch.tensor(1.0), torch.tensor(2.0)))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda est, x, y: est.fit([(x, y)], epochs=1, batch_size=8),
            FitforgeValueError,
            "batch_size is for data given as arrays, fit((X, y), batch_size=32), or as an IterableDataset of "
            "samples, fit(dataset, batch_size=32); a DataLoader or a list of batches",
        ),
        (
            lambda est, x, y: est.fit([(x, y)], epochs=1, validation_split=0.2),
            FitforgeValueError,
            "validation_split splits arrays, fit((X, y), validation_split=0.2); for a DataLoader, pass",
        ),
        (
            lambda est, x, y: est.fit((x, y), val_data=(x, y), epochs=1, validation_split=0.2),
            FitforgeValueError,
            "give either val_data or validation_split, not both",
        ),
        (
            lambda est, x, y: est.fit((x, y), epochs=1, validation_split=1.5),
            FitforgeValueError,
            "validation_split must be a fraction between 0 and 1 (e.g. 0.2), got float 1.5",
        ),
        (
            lambda est, x, y: est.fit((x[:3], y[:3]), epochs=1, validation_split=0.2),
            FitforgeValueError,
            "validation_split=0.2 of 3 samples leaves no validation sample",
        ),
        (
            lambda est, x, y: est.fit((x, y[:5]), epochs=1),
            FitforgeValueError,
            "train_data: the arrays must have one row per sample each, but their lengths differ: shapes (100, 2), (5,)",
        ),
        (
            lambda est, x, y: est.fit((x, y), epochs=1, batch_size=0),
            FitforgeValueError,
            "batch_size must be a positive int, got 0",
        ),
        (
            lambda est, x, y: est.fit((x, y), epochs=1, batch_size=8.0),
            FitforgeTypeError,
            "batch_size must be a positive int, got float 8.0",
        ),
        (
            lambda est, x, y: est.fit(x, y, epochs=1),
            FitforgeTypeError,
            "fit got the inputs and the labels as two arguments, but its second one is val_data: pass them as one "
            "tuple, fit((X, y), batch_size=32, epochs=...)",
        ),
        (
            lambda est, x, y: est.fit(x, epochs=1),  # X alone is data without labels: this net's loss needs them
            FitforgeValueError,
            "the loss CrossEntropyLoss compares the net's output with a label, but the batches are data alone",
        ),
        (
            lambda est, x, y: est.predict([x], batch_size=4),
            FitforgeValueError,
            "batch_size is for data given as arrays; data already has batches",
        ),
    ],
)
def test_array_mistakes_are_named(call, error, message):
    x, y = blobs()
    with pytest.raises(error, match=re.escape(message)):
        call(classifier(), x, y)


TAKES = "which torch cannot take (it takes bool, integer, float16/32/64 and complex arrays); convert it first: "


@pytest.mark.parametrize(
    "arrays, message",
    [
        (lambda x, y: (x.astype(object), y), "train_data: X has dtype object, " + TAKES + "X.astype(numpy.float32)"),
        (
            lambda x, y: (np.where(x > 0, "hi", "lo"), y),
            "train_data: X has dtype <U2, " + TAKES + "encode the text as numbers first",
        ),
        (
            lambda x, y: (x, y.astype(object)),
            "train_data: y has dtype object, " + TAKES + "y.astype(numpy.int64) for class indices, "
            "y.astype(numpy.float32) for values",
        ),
        (
            lambda x, y: (x, np.where(y == 1, "cat", "dog")),
            "train_data: y has dtype <U3, " + TAKES + "number the class names: classes, codes = numpy.unique(y, "
            "return_inverse=True), and pass codes",
        ),
        (  # pandas' string columns: dtype object, holding str
            lambda x, y: (x, np.where(y == 1, "cat", "dog").astype(object)),
            "train_data: y has dtype object, " + TAKES + "number the class names",
        ),
        (
            lambda x, y: (x, (y, y.astype(object))),
            "train_data: y[1] has dtype object, " + TAKES + "y[1].astype(numpy.int64) for class indices",
        ),
        (
            lambda x, y: (x, {"cls": y, "name": np.where(y == 1, "cat", "dog")}),
            "train_data: y['name'] has dtype <U3, "
            + TAKES
            + "number the class names: classes, codes = numpy.unique(y['name'], ",
        ),
    ],
)
def test_arrays_torch_cannot_take_are_named_before_training(arrays, message):
    x, y = blobs()
    estimator = classifier()
    before = [p.clone() for p in estimator.net.parameters()]
    with pytest.raises(FitforgeTypeError, match=re.escape(message)):
        estimator.fit(arrays(x, y), epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(before, estimator.net.parameters()))


def test_predict_names_an_object_array():
    x, _ = blobs()
    with pytest.raises(FitforgeTypeError, match=re.escape("data: X has dtype object, which torch cannot take")):
        classifier().predict(x.astype(object))


def test_numpy_integers_are_batch_sizes():
    x, y = blobs()
    train, val = fit_loaders((x, y), (x, y), np.int64(25), None)
    assert train.batch_size == val.batch_size == 25 and type(train.batch_size) is int


def test_split_off_keeps_every_array_aligned():
    x, y, w = torch.arange(10.0), torch.arange(10), torch.arange(10.0) * 2
    train, val = split_off((x, y, w), 0.25)
    assert train[0].tolist() == list(range(8)) and val[1].tolist() == [8, 9] and val[2].tolist() == [16.0, 18.0]


@pytest.mark.parametrize(
    "call",
    [
        lambda est, x, y: est.fit((x, y.tolist()), epochs=1),  # y a list: the tuple is read as two batches
        lambda est, x, y: est.predict((x, y)),  # predict takes X alone
    ],
)
def test_a_numpy_array_read_as_a_batch_says_how_arrays_are_given(call):
    x, y = blobs()
    with pytest.raises(BatchFormatError, match=re.escape("the batch is a NumPy array, not a tensor: whole arrays go")):
        call(classifier(), x, y)


def test_a_bare_tensor_batch_is_not_called_a_numpy_array():
    with pytest.raises(LossInputError, match=re.escape("but the batches are data alone (a tensor,")) as info:
        classifier().fit([torch.zeros(4, 2)], epochs=1)
    assert "NumPy" not in str(info.value)


def test_a_stream_of_samples_is_batched_for_validation_evaluate_and_predict_too():
    from torch.utils.data import IterableDataset

    class Samples(IterableDataset):
        def __iter__(self):
            generator = torch.Generator().manual_seed(0)
            return iter([(torch.randn(2, generator=generator), i % 2) for i in range(12)])

    estimator = classifier()
    history = estimator.fit(Samples(), val_data=Samples(), batch_size=4, epochs=1)
    assert len(history["val_loss"]) == 1
    assert set(estimator.evaluate(Samples(), batch_size=4)) >= {"val_loss"}
    assert estimator.predict(Samples(), batch_size=5).shape == (12, 2)


def test_a_stream_of_samples_without_batch_size_is_told_to_pass_it():
    from torch.utils.data import IterableDataset

    class Samples(IterableDataset):
        def __iter__(self):
            return iter([(torch.randn(2), torch.tensor(1)) for _ in range(4)])

    with pytest.raises(FitforgeValueError, match="for a stream of samples .* pass batch_size= to fit, evaluate or"):
        classifier().fit(Samples(), epochs=1)

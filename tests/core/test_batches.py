"""Batch unpacking, device transfer, batch-size inference and the checks on data given to fit."""

import re

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fitforge.core.batches import batch_size_of, check_finite, label_key_of, to_device, unpack_batch, unpack_inputs
from fitforge.exceptions import BatchFormatError, FitforgeTypeError, FitforgeValueError, NonFiniteInputError
from fitforge.inputs.sources import check_data
from helpers import make_estimator, regression_batches

PAIR_HELP = "return (data, label) from your Dataset/collate_fn, or override BatchProcessor.unpack"
X = torch.randn(4, 3)
Y = torch.tensor([0, 1, 2, 1])


# -- unpack_batch -------------------------------------------------------------------------------------
class TestUnpackBatch:
    def test_tensor_pair(self):
        inputs, label = unpack_batch((X, Y))
        assert isinstance(inputs, tuple) and len(inputs) == 1
        assert inputs[0] is X and label is Y

    def test_list_pair(self):  # the default collate_fn gives lists
        inputs, label = unpack_batch([X, Y])
        assert inputs == (X,) and label is Y

    def test_tuple_data_and_labels(self):
        x2 = torch.randn(4, 2)
        y2 = torch.randn(4)
        inputs, label = unpack_batch(((X, x2), [Y, y2]))
        assert isinstance(inputs, tuple) and inputs[0] is X and inputs[1] is x2
        assert isinstance(label, tuple) and label[0] is Y and label[1] is y2

    def test_list_data(self):
        inputs, label = unpack_batch(([X], Y))
        assert inputs == (X,) and label is Y

    def test_a_dict_batch_without_a_label_key_is_data_alone(self):
        assert unpack_batch({"x": X, "y": Y}) == ({"x": X, "y": Y}, None)
        assert unpack_batch({"x": X, "target": Y}, ("target",)) == ({"x": X}, Y)  # BatchProcessor(label_key=...)

    @pytest.mark.parametrize("batch", [X, (X,), [X]], ids=["tensor", "1-tuple", "1-list"])
    def test_a_tensor_or_a_1_tuple_is_data_alone(self, batch):
        inputs, label = unpack_batch(batch)
        assert inputs == (X,) and inputs[0] is X and label is None

    def test_several_inputs_alone(self):
        x2 = torch.randn(4, 2)
        inputs, label = unpack_batch(((X, x2),))
        assert inputs == (X, x2) and label is None

    def test_the_label_key_is_looked_up_with_a_clear_error(self):
        msg = "got a dict batch with keys ['x', 'y'] and no label: put the label under 'labels' or 'label'"
        with pytest.raises(BatchFormatError, match=re.escape(msg) + ".*" + re.escape(PAIR_HELP)):
            label_key_of({"x": X, "y": Y})

    def test_dict_batch_gives_keyword_inputs_and_its_label(self):
        assert unpack_batch({"x": X, "labels": Y}) == ({"x": X}, Y)
        features, label = unpack_batch({"x": X, "label": Y, "mask": X})
        assert features == {"x": X, "mask": X} and label is Y

    def test_a_batch_format_error_is_a_value_error(self):
        with pytest.raises(ValueError, match="a batch must be"):
            unpack_batch(3)
        assert issubclass(BatchFormatError, FitforgeValueError)

    @pytest.mark.parametrize(
        "batch,shown",
        [
            (("a",), "tuple of 1 [str 'a']"),
            ((X, Y, Y), "tuple of 3 [tensor of shape (4, 3), tensor of shape (4,), tensor of shape (4,)]"),
            ([], "list of 0 []"),
            (3, "int 3"),
        ],
    )
    def test_wrong_length_or_type(self, batch, shown):
        several = isinstance(batch, tuple) and len(batch) > 2
        msg = f"a batch must be a (data, label) pair or data alone, got a {shown}: " + (
            "several labels go in one" if several else PAIR_HELP
        )
        with pytest.raises(BatchFormatError, match=re.escape(msg)):
            unpack_batch(batch)

    def test_a_long_list_is_shown_by_its_first_items(self):
        rows = [[0.0] * 64 for _ in range(1797)]  # an array given as Python lists, read as one batch
        with pytest.raises(BatchFormatError) as info:
            unpack_batch(rows)
        message = str(info.value)
        assert len(message) < 600, message
        shown = "list of 1797 [" + ", ".join(["list of 64 [float 0.0, float 0.0, float 0.0, ... 61 more]"] * 3)
        assert f"got a {shown}, ... 1794 more]: the batch holds Python lists, not tensors" in message
        assert "fit((numpy.asarray(X, dtype=numpy.float32), numpy.asarray(y)), batch_size=...)" in message

    @pytest.mark.parametrize("label", [3, Y])
    def test_python_numbers_as_data_are_told_to_be_arrays_or_tensors(self, label):
        with pytest.raises(BatchFormatError) as info:
            unpack_batch(([0.0, 1.0, 2.0], label))  # 3: a sample of fit(list(zip(X.tolist(), y.tolist())))
        assert "got data: list of 3 [float 0.0, float 1.0, float 2.0], label: " in str(info.value)
        assert ": the batch holds Python lists, not tensors: whole arrays go to fit as NumPy arrays" in str(info.value)

    def test_a_short_list_is_shown_whole(self):
        batch = (X, X, X, X, X, Y)
        with pytest.raises(BatchFormatError, match=re.escape("tuple of 6 [" + "tensor of shape (4, 3), " * 5)):
            unpack_batch(batch)

    def test_three_parts_show_the_forms_that_work(self):
        with pytest.raises(BatchFormatError) as info:
            unpack_batch((X, Y, Y))
        message = str(info.value)
        assert "(x, (y1, y2)), matched by position" in message
        assert "(x, {'cls': y1, 'reg': y2}), matched by name to a dict loss" in message
        assert "TensorDataset(x, y1, y2) gives (x, y1, y2)" in message

    def test_dict_label_is_kept(self):
        inputs, label = unpack_batch((X, {"cls": Y, "reg": X}))
        assert inputs[0] is X and label == {"cls": Y, "reg": X}

    @pytest.mark.parametrize("label", [{}, {"cls": Y, "reg": 3}])
    def test_dict_label_of_non_tensors(self, label):
        with pytest.raises(BatchFormatError, match=re.escape("the label may be a dict of tensors")):
            unpack_batch((X, label))

    @pytest.mark.parametrize(
        "batch,shown",
        [
            ((X, 3), "data: tensor of shape (4, 3), label: int 3"),
            (((), Y), "data: tuple of 0 [], label: tensor of shape (4,)"),
            (((X, "a"), Y), "data: tuple of 2 [tensor of shape (4, 3), str 'a'], label: tensor of shape (4,)"),
            ((X, None), "data: tensor of shape (4, 3), label: NoneType None"),
        ],
    )
    def test_non_tensor_entries(self, batch, shown):
        msg = (
            "a batch must be a (data, label) pair of tensors or tuples of tensors (the label may be a dict of "
            f"tensors), got {shown}: {PAIR_HELP}"
        )
        with pytest.raises(BatchFormatError, match=re.escape(msg)):
            unpack_batch(batch)


# -- unpack_inputs -----------------------------------------------------------------------------------
class TestUnpackInputs:
    def test_bare_tensor(self):
        assert unpack_inputs(X) == (X,)

    def test_one_element_tuple(self):
        inputs = unpack_inputs((X,))
        assert len(inputs) == 1 and inputs[0] is X
        assert unpack_inputs([X])[0] is X

    def test_one_element_tuple_of_several_inputs(self):
        x2 = torch.randn(4, 2)
        inputs = unpack_inputs(((X, x2),))
        assert len(inputs) == 2 and inputs[0] is X and inputs[1] is x2

    def test_pair_ignores_label(self):
        inputs = unpack_inputs((X, Y))
        assert len(inputs) == 1 and inputs[0] is X

    def test_pair_with_several_inputs(self):
        x2 = torch.randn(4, 2)
        inputs = unpack_inputs(((X, x2), Y))
        assert len(inputs) == 2 and inputs[0] is X and inputs[1] is x2

    def test_bad_batch(self):
        assert unpack_inputs({"x": X, "labels": Y}) == {"x": X}  # predict drops the label of a dict batch
        with pytest.raises(BatchFormatError, match=re.escape("a batch must be a (data, label) pair")):
            unpack_inputs((X, Y, Y))


# -- to_device / batch_size_of -------------------------------------------------------------------------
def test_to_device_tensor():
    moved = to_device(X, torch.device("cpu"))
    assert moved.device.type == "cpu" and torch.equal(moved, X)


def test_to_device_nested():
    a, b, c = torch.randn(2), torch.randn(3), torch.randn(1)
    out = to_device([a, (b, [c]), "meta-data", 3], torch.device("meta"))
    assert isinstance(out, tuple) and isinstance(out[1], tuple) and isinstance(out[1][1], tuple)
    assert out[0].device.type == "meta" and out[0].shape == (2,)
    assert out[1][0].device.type == "meta" and out[1][0].shape == (3,)
    assert out[1][1][0].device.type == "meta"
    assert out[2] == "meta-data" and out[3] == 3  # non-tensors pass through
    assert a.device.type == "cpu"  # the originals are untouched


def test_to_device_non_tensor():
    assert to_device(None, torch.device("cpu")) is None
    assert to_device({"a": 1}, torch.device("cpu")) == {"a": 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_cuda_non_blocking():  # pragma: no cover - depends on the machine
    out = to_device((X.pin_memory(), [Y]), torch.device("cuda"), non_blocking=True)
    assert out[0].is_cuda and out[1][0].is_cuda
    assert torch.equal(out[0].cpu(), X)


def test_batch_size_of():
    assert batch_size_of((X,)) == 4
    assert batch_size_of((torch.zeros(7, 2, 2), torch.zeros(3))) == 7  # the first input decides
    assert batch_size_of((torch.zeros(0, 3),)) == 0
    assert batch_size_of((torch.tensor(2.5),)) == 1  # 0-d counts as one sample
    assert isinstance(batch_size_of((X,)), int)


# -- check_data --------------------------------------------------------------------------------------
class NoLenIterable:
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class NeverIterate(DataLoader):
    """A DataLoader that fails if anything iterates it (check_data must not)."""

    def __iter__(self):
        raise AssertionError("check_data must not call iter() on a DataLoader")


class TestCheckData:
    @pytest.mark.parametrize(
        "data,shown",
        [
            (3, "int 3"),
            (None, "NoneType None"),
            (torch.zeros(2, 2), "Tensor tensor([[0., 0.],"),
            ("abc", "str 'abc'"),
            ({"x": X}, "dict {'x': tensor("),
        ],
    )
    def test_not_an_iterable_of_batches(self, data, shown):
        msg = f"train_data must be an iterable of (data, label) batches such as a DataLoader or a list, got {shown}"
        with pytest.raises(FitforgeTypeError, match=re.escape(msg)):
            check_data(data, "train_data", passes=None)

    def test_type_error_names_the_argument(self):
        with pytest.raises(TypeError, match=re.escape("val_data must be an iterable")):
            check_data(3.5, "val_data", passes=1)

    # passes=None: more than one pass, or as many as batches= takes (one pass may hold them)
    @pytest.mark.parametrize("passes,times", [(None, "may be read more than once"), (2, "would be read 2 times")])
    def test_one_shot_iterator_read_several_times(self, passes, times):
        gen = ((X, Y) for _ in range(3))
        msg = (
            f"train_data is a one-shot iterator (generator), which is exhausted after one pass, but it "
            f"{times}; pass a re-iterable such as a DataLoader or a list"
        )
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            check_data(gen, "train_data", passes=passes)
        assert next(gen)[0] is X  # the check did not consume it

    def test_list_iterator_is_one_shot_too(self):
        with pytest.raises(FitforgeValueError, match=re.escape("val_data is a one-shot iterator (list_iterator)")):
            check_data(iter([(X, Y)]), "val_data", passes=None)

    def test_one_shot_iterator_allowed_for_one_pass(self):
        gen = ((X, Y) for _ in range(3))
        assert check_data(gen, "train_data", passes=1) is None
        assert len(list(gen)) == 3  # not consumed by the check

    def test_empty_list(self):
        msg = "train_data is empty (len 0): it must yield at least one batch"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            check_data([], "train_data", passes=None)

    def test_empty_dataloader(self):
        loader = DataLoader(TensorDataset(torch.zeros(0, 3), torch.zeros(0)), batch_size=2)
        with pytest.raises(FitforgeValueError, match=re.escape("val_data is empty (len 0)")):
            check_data(loader, "val_data", passes=3)

    def test_dataloader_returns_its_length_or_none_without_one(self):
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                yield from [(X, Y)]

        assert check_data(DataLoader(TensorDataset(torch.zeros(5, 3), torch.zeros(5)), batch_size=2), "x", None) == 3
        assert check_data(DataLoader(Stream(), batch_size=None), "train_data", passes=None) is None

    def test_list_returns_len(self):
        assert check_data([(X, Y)] * 3, "train_data", passes=None) == 3
        assert check_data(((X, Y),), "train_data", passes=5) == 1

    def test_iterable_without_len(self):
        assert check_data(NoLenIterable([(X, Y)]), "train_data", passes=None) is None

    def test_dataloader_is_not_iterated(self):
        loader = NeverIterate(TensorDataset(torch.randn(10, 3), torch.zeros(10)), batch_size=4)
        assert check_data(loader, "train_data", passes=None) == 3
        with pytest.raises(AssertionError):
            iter(loader)  # the trap works


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda est: est.fit(regression_batches(), 5),
            "val_data must be an iterable .* got int 5; did you mean epochs=5?",
        ),
        (
            lambda est: est.fit(torch.utils.data.TensorDataset(torch.zeros(4, 1), torch.zeros(4, 1)), epochs=1),
            r"wrap the dataset: DataLoader\(dataset, batch_size=...\)",
        ),
    ],
)
def test_beginner_data_mistakes_get_a_hint(call, message):
    with pytest.raises(FitforgeTypeError, match=message):
        call(make_estimator())


@pytest.mark.parametrize("argument", ["train_data", "val_data"])
def test_a_pair_of_tensors_is_taken_for_what_it_is(argument):
    x, y = torch.rand(8, 1), torch.rand(8, 1)
    with pytest.raises(FitforgeTypeError, match=r"is a tuple of 2 tensor\(s\), not of \(data, label\) batches"):
        check_data((x, y), argument, None)
    assert check_data([x, y], "data", 1) == 2  # predict takes bare tensors as batches


def test_fit_takes_a_pair_of_tensors_given_as_validation_data_as_arrays():
    x, y = torch.rand(8, 1), torch.rand(8, 1)
    history = make_estimator().fit(regression_batches(2), val_data=(x, y), epochs=1)  # fitforge.inputs.arrays
    assert len(history["val_loss"]) == 1


def test_check_finite_takes_large_finite_values_whose_sum_overflows():
    big = torch.full((8, 4), 60000.0, dtype=torch.float16)  # each finite; their float16 sum is inf
    assert torch.isinf(big.sum())
    check_finite((big, torch.zeros(8, dtype=torch.long)), "train_data")  # no error
    big[3, 1] = float("nan")
    with pytest.raises(NonFiniteInputError, match=r"data: 1 nan and 0 inf of 32 values"):
        check_finite((big, torch.zeros(8, dtype=torch.long)), "train_data")

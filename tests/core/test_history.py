"""History: per-epoch rows aligned with nan, read-only mapping, last(), rows(), to_csv(), plot(), repr."""

import csv
import io
import math
import re
import sys
import types
from collections.abc import Mapping

import numpy as np
import pytest
import torch

from fitforge import History


def nan_equal(a, b):
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b))


def make_history():
    """Three epochs; validation only in epochs 2 and 3; lr first recorded in epoch 3."""
    h = History()
    h.new_epoch()
    h.record("train_loss", 1.0)
    h.record("train_accuracy", 0.5)
    h.new_epoch()
    h.record("train_loss", 0.6)
    h.record("train_accuracy", 0.7)
    h.record("val_loss", 0.8)
    h.new_epoch()
    h.record("train_loss", 0.4)
    h.record("val_loss", 0.5)
    h.record("lr", 0.01)
    return h


class TestAlignment:
    def test_late_key_is_nan_for_earlier_epochs(self):
        h = make_history()
        assert nan_equal(h["lr"], [math.nan, math.nan, 0.01])
        assert nan_equal(h["val_loss"], [math.nan, 0.8, 0.5])

    def test_key_missing_in_an_epoch_gets_nan(self):
        h = make_history()
        assert nan_equal(h["train_accuracy"], [0.5, 0.7, math.nan])
        assert h["train_loss"] == [1.0, 0.6, 0.4]

    def test_every_column_has_one_entry_per_epoch(self):
        h = make_history()
        h.new_epoch()  # a fresh row: nan everywhere until recorded
        assert h.epochs == 4
        assert all(len(h[k]) == 4 for k in h)
        assert all(math.isnan(h[k][-1]) for k in h)

    def test_record_overwrites_within_an_epoch(self):
        h = History()
        h.new_epoch()
        h.record("val_loss", 1.0)
        h.record("val_loss", 2.0)
        assert h["val_loss"] == [2.0]
        h.new_epoch()
        h.record("val_loss", 3.0)
        assert h["val_loss"] == [2.0, 3.0]

    def test_record_converts_to_float_and_keeps_integers(self):
        h = History()
        h.new_epoch()
        h.record("train_loss", torch.tensor(0.25, dtype=torch.float64))
        h.record("count", 3)
        h.record("numpy_count", np.int64(4))
        h.record("flag", True)
        assert h["train_loss"] == [0.25] and type(h["train_loss"][0]) is float
        assert h["count"] == [3] and type(h["count"][0]) is int  # a count prints as one: "3", not "3.000"
        assert h["numpy_count"] == [4] and type(h["numpy_count"][0]) is int
        assert h["flag"] == [1.0] and type(h["flag"][0]) is float
        h.new_epoch()
        assert math.isnan(h["count"][1])  # an epoch without one: nan, as for any key
        copy = History()
        copy.load_state_dict(h.state_dict())  # a checkpoint keeps the int
        assert type(copy["count"][0]) is int and type(copy["train_loss"][0]) is float

    def test_record_before_any_epoch_raises(self):
        h = History()
        with pytest.raises(
            RuntimeError,
            match=re.escape(
                "History.record() before the first epoch: history has rows only in fit, "
                "from epoch_begin on; in evaluate/predict"
            ),
        ):
            h.record("train_loss", 1.0)
        assert len(h) == 0 and h.epochs == 0


class TestMapping:
    def test_is_a_mapping(self):
        h = make_history()
        assert isinstance(h, Mapping)
        assert len(h) == 4
        assert list(h) == ["train_loss", "train_accuracy", "val_loss", "lr"]  # insertion order
        assert "val_loss" in h and "val_accuracy" not in h
        assert set(h.keys()) == {"train_loss", "train_accuracy", "val_loss", "lr"}
        assert dict(h.items())["train_loss"] == [1.0, 0.6, 0.4]
        assert h.get("missing") is None

    def test_getitem_returns_a_copy(self):
        h = make_history()
        column = h["train_loss"]
        column.append(123.0)
        column[0] = -1.0
        assert h["train_loss"] == [1.0, 0.6, 0.4]
        assert h["train_loss"] is not h["train_loss"]

    def test_no_item_assignment(self):
        h = make_history()
        with pytest.raises(TypeError):
            h["train_loss"] = [0.0]  # type: ignore[index]
        with pytest.raises(TypeError):
            del h["train_loss"]  # type: ignore[attr-defined]

    def test_keyerror_lists_available_keys(self):
        h = make_history()
        msg = "history has no key 'val_acc'; available: ['lr', 'train_accuracy', 'train_loss', 'val_loss']"
        with pytest.raises(KeyError, match=re.escape(msg)):
            h["val_acc"]

    def test_keyerror_on_empty_history(self):
        with pytest.raises(KeyError, match=re.escape("history has no key 'train_loss'; available: []")):
            History()["train_loss"]

    def test_empty(self):
        h = History()
        assert len(h) == 0 and list(h) == [] and h.epochs == 0
        assert h.rows() == [] and h.stop_reason is None

    def test_epochs_counts_rows_even_without_records(self):
        h = History()
        h.new_epoch()
        h.new_epoch()
        assert h.epochs == 2 and len(h) == 0
        h.record("x", 1.0)
        assert nan_equal(h["x"], [math.nan, 1.0])


class TestLast:
    def test_last_skips_nan(self):
        h = make_history()
        h.new_epoch()
        h.record("train_loss", 0.3)
        assert h.last("train_loss") == 0.3
        assert h.last("val_loss") == 0.5  # epoch 4 has nan
        assert h.last("train_accuracy") == 0.7  # epochs 3 and 4 have nan

    def test_last_default(self):
        h = make_history()
        assert math.isnan(h.last("missing"))
        assert h.last("missing", default=-1.0) == -1.0
        h.new_epoch()
        h.record("only_nan", math.nan)
        assert h.last("only_nan", 7.0) == 7.0


def test_rows():
    rows = make_history().rows()
    assert len(rows) == 3
    assert list(rows[0]) == ["train_loss", "train_accuracy", "val_loss", "lr"]
    assert rows[0]["train_loss"] == 1.0 and math.isnan(rows[0]["val_loss"]) and math.isnan(rows[0]["lr"])
    assert rows[1] == {"train_loss": 0.6, "train_accuracy": 0.7, "val_loss": 0.8, "lr": rows[1]["lr"]}
    assert math.isnan(rows[1]["lr"])
    assert rows[2]["lr"] == 0.01 and math.isnan(rows[2]["train_accuracy"])


def test_current_row_holds_what_this_row_recorded():
    h = History()
    h.new_epoch()
    h.record("train_loss", 0.5)
    h.record("val_loss", math.nan)
    h.new_epoch()
    h.record("val_loss", math.inf)
    h.record("lr", 0.1)
    assert list(h.current_row()) == ["val_loss", "lr"] and h.current_row()["val_loss"] == math.inf
    assert h.current_row(finite=True) == {"lr": 0.1}


def test_to_csv(tmp_path):
    h = make_history()
    path = h.to_csv(tmp_path / "history.csv")
    assert path == tmp_path / "history.csv"
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["epoch", "train_loss", "train_accuracy", "val_loss", "lr"]
    assert len(rows) == 4
    assert [row[0] for row in rows[1:]] == ["1", "2", "3"]  # 1-based epochs
    values = [[float(v) for v in row[1:]] for row in rows[1:]]
    assert nan_equal(values[0], [1.0, 0.5, math.nan, math.nan])
    assert nan_equal(values[1], [0.6, 0.7, 0.8, math.nan])
    assert nan_equal(values[2], [0.4, math.nan, 0.5, 0.01])


def test_to_csv_accepts_str_path(tmp_path):
    h = History()
    path = h.to_csv(str(tmp_path / "empty.csv"))
    with open(path, newline="") as file:
        assert list(csv.reader(file)) == [["epoch"]]


class TestPlot:
    @pytest.fixture(autouse=True)
    def _agg(self):
        matplotlib = pytest.importorskip("matplotlib")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        yield
        plt.close("all")

    def test_writes_png_and_returns_figure(self, tmp_path):
        from matplotlib.figure import Figure

        path = tmp_path / "history.png"
        fig = make_history().plot(path)
        assert isinstance(fig, Figure)
        assert path.exists() and path.stat().st_size > 0
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # one panel per metric name (loss, accuracy): lr has no train_/val_ prefix
        assert [ax.get_title() for ax in fig.axes] == ["loss", "accuracy"]
        loss_ax = fig.axes[0]
        assert [line.get_label() for line in loss_ax.get_lines()] == ["train", "val"]

    def test_without_path_returns_figure(self):
        fig = make_history().plot()
        assert len(fig.axes) == 2

    def test_selected_keys(self, tmp_path):
        fig = make_history().plot(tmp_path / "loss.png", keys=["loss"])
        assert [ax.get_title() for ax in fig.axes] == ["loss"]
        assert (tmp_path / "loss.png").stat().st_size > 0

    def test_a_notebook_shows_the_figure_once(self, monkeypatch):
        import matplotlib.pyplot as plt

        class ZMQInteractiveShell:
            pass

        monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
        before = plt.get_fignums()
        fig = make_history().plot()
        assert plt.get_fignums() == before  # pyplot will not show it besides the cell's value
        fig.savefig(io.BytesIO(), format="png")  # which still renders
        assert len(fig.axes) == 2

    def test_outside_a_notebook_pyplot_keeps_the_figure_for_show(self):
        import matplotlib.pyplot as plt

        before = plt.get_fignums()
        make_history().plot()
        assert len(plt.get_fignums()) == len(before) + 1

    def test_saving_leaves_the_backend_and_no_figure(self, tmp_path):
        import matplotlib
        import matplotlib.pyplot as plt

        plt.switch_backend("svg")  # the user's choice (a GUI or a notebook's backend, say)
        try:
            make_history().plot(tmp_path / "h.png")
            assert matplotlib.get_backend() == "svg" and plt.get_fignums() == []
            assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        finally:
            plt.switch_backend("Agg")

    def test_nothing_to_plot(self):
        h = History()
        h.new_epoch()
        h.record("lr", 0.1)
        with pytest.raises(
            ValueError, match=re.escape("nothing to plot: history has no train_/val_ keys (keys: ['lr'])")
        ):
            h.plot()

    def test_nothing_to_plot_empty(self):
        with pytest.raises(ValueError, match="nothing to plot"):
            History().plot()


def test_repr():
    h = make_history()
    assert repr(h) == "History(epochs=3, train_loss=0.4, train_accuracy=0.7, val_loss=0.5, lr=0.01)"
    h.new_epoch()
    h.record("x", 1 / 3)
    assert repr(h) == "History(epochs=4, train_loss=0.4, train_accuracy=0.7, val_loss=0.5, lr=0.01, x=0.3333)"


def test_repr_all_nan_key():
    h = History()
    h.new_epoch()
    h.record("val_loss", math.nan)
    assert repr(h) == "History(epochs=1, val_loss=nan)"


def test_repr_empty():
    assert repr(History()) == "History(epochs=0)"


def test_extend_appends_rows_and_aligns_keys():
    first, second = History(), History()
    for value in (1.0, 2.0):
        first.new_epoch()
        first.record("train_loss", value)
    second.new_epoch()
    second.record("train_loss", 0.5)
    second.record("val_loss", 0.7)
    second.stop_reason = "reached epochs=1"
    first.extend(second)
    assert first.epochs == 3 and first["train_loss"] == [1.0, 2.0, 0.5]
    assert all(math.isnan(v) for v in first["val_loss"][:2])
    assert first["val_loss"][2] == 0.7 and first.stop_reason == "reached epochs=1"
    assert first.current("val_loss") == 0.7  # the last row is the other's


def test_extend_keeps_the_others_column_order():
    first, second = History(), History()
    first.new_epoch()
    first.record("a", 1.0)
    second.new_epoch()
    for key in ("val_loss", "train_loss", "epoch_time", "z", "b"):
        second.record(key, 2.0)
    first.extend(second)
    assert list(first) == ["a", "val_loss", "train_loss", "epoch_time", "z", "b"]


def test_repr_after_a_restore_gives_the_restored_epochs_values():
    h = make_history()
    h.restored_epoch = 2  # the weights of epoch 2: its values, not the last epoch's (lr has none there)
    assert repr(h) == "History(epochs=3, restored_epoch=2, train_loss=0.6, train_accuracy=0.7, val_loss=0.8)"

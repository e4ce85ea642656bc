"""Whole arrays with several labels, as Keras takes them: fit((X, {"cls": y1, "reg": y2}), batch_size=...)."""

import numpy as np
import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.inputs.arrays import is_arrays


class TwoHeads(nn.Module):
    def __init__(self, named=True):
        super().__init__()
        self.body, self.cls, self.reg, self.named = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 1), named

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"cls": self.cls(h), "reg": self.reg(h)} if self.named else (self.cls(h), self.reg(h))


def arrays(n=40):
    g = np.random.default_rng(0)
    return g.normal(size=(n, 4)), g.integers(0, 3, size=n), g.normal(size=(n, 1))


def test_a_dict_of_label_arrays_trains_named_outputs_with_a_batch_size_and_a_split():
    x, y_cls, y_reg = arrays()
    torch.manual_seed(0)
    losses = {"cls": nn.CrossEntropyLoss(), "reg": nn.MSELoss()}
    estimator = Estimator(TwoHeads(), losses, optimizer="sgd", device="cpu")
    data = (x, {"cls": y_cls, "reg": y_reg})
    history = estimator.fit(data, batch_size=8, validation_split=0.25, epochs=2)
    assert {"train_cls_loss", "val_reg_loss"} <= set(history) and history.epochs == 2
    result = estimator.evaluate(data, batch_size=16)
    assert result["val_loss"] == pytest.approx(result["val_cls_loss"] + result["val_reg_loss"])


def test_a_tuple_of_label_arrays_trains_outputs_by_position():
    x, y_cls, y_reg = arrays()
    estimator = Estimator(TwoHeads(named=False), [nn.CrossEntropyLoss(), nn.MSELoss()], optimizer="sgd", device="cpu")
    history = estimator.fit((x, (y_cls, y_reg)), batch_size=10, epochs=1)
    assert {"train_loss_0", "train_loss_1"} <= set(history)


def test_label_arrays_of_other_lengths_or_keys_are_no_arrays():
    x, y_cls, y_reg = arrays()
    assert is_arrays((x, {"cls": y_cls})) and is_arrays((x, [y_cls, y_reg]))
    assert not is_arrays((x, {})) and not is_arrays((x, {1: y_cls})) and not is_arrays([(x, y_cls), (x, y_cls)])
    with pytest.raises(ValueError, match="lengths differ"):
        Estimator(TwoHeads(), {"cls": nn.CrossEntropyLoss()}, optimizer="sgd", device="cpu").fit(
            (x, {"cls": y_cls[:10]}), batch_size=8, epochs=1
        )

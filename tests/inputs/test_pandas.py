"""pandas DataFrames and Series are arrays, as in Keras: fit, evaluate, predict and validation_split
take them as their NumPy arrays (a fit on them equals the fit on ``.to_numpy()`` bit for bit), and a
column that is not numbers is a clear error naming it."""

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError

rng = np.random.default_rng(0)
FRAME = pd.DataFrame(rng.normal(size=(40, 3)), columns=["a", "b", "c"])
FRAME["target"] = (FRAME["a"] + FRAME["b"] > 0).astype(int)
X, Y = FRAME.drop(columns="target"), FRAME["target"]


def estimator():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01), device="cpu")


def trained(train_data, **kwargs):
    model = estimator()
    torch.manual_seed(1)  # the shuffle
    history = model.fit(train_data, epochs=2, **kwargs)
    return model, history


@pytest.mark.parametrize("kwargs", [{"batch_size": 8}, {}, {"batch_size": 8, "validation_split": 0.25}])
def test_a_fit_on_a_dataframe_and_a_series_equals_the_fit_on_their_arrays(kwargs):
    on_pandas, history = trained((X, Y), **kwargs)
    on_numpy, expected = trained((X.to_numpy(copy=True), Y.to_numpy(copy=True)), **kwargs)
    for key, value in on_numpy.net.state_dict().items():
        assert torch.equal(on_pandas.net.state_dict()[key], value)
    assert history["train_loss"] == expected["train_loss"]
    assert on_pandas.evaluate((X, Y)) == on_numpy.evaluate((X.to_numpy(copy=True), Y.to_numpy(copy=True)))
    assert torch.equal(on_pandas.predict(X), on_numpy.predict(X.to_numpy(copy=True)))


def test_a_one_column_dataframe_label_and_a_regression_target():
    model = Estimator(nn.Linear(3, 1), nn.MSELoss(), device="cpu", optimizer="sgd")
    history = model.fit((X, FRAME[["a"]] * 2.0), batch_size=8, epochs=1)
    assert len(history["train_loss"]) == 1


def test_a_column_that_is_not_numbers_is_named():
    frame = X.assign(city=["Paris", "Lyon"] * 20)
    with pytest.raises(FitforgeTypeError, match=r"train_data: X has columns that are not numbers: 'city' \("):
        estimator().fit((frame, Y), batch_size=8, epochs=1)
    with pytest.raises(FitforgeTypeError, match=r"val_data: y has columns that are not numbers: 'target'"):
        estimator().fit((X, Y), val_data=(X, Y.map({0: "no", 1: "yes"})), batch_size=8, epochs=1)
    with pytest.raises(FitforgeTypeError, match="X has columns that are not numbers: 'city'"):
        estimator().predict(frame)


def test_mixed_and_nullable_columns_are_one_array_of_their_common_type_and_missing_values_are_refused():
    frame = pd.DataFrame(
        {"a": X["a"], "count": range(40), "flag": [True, False] * 20, "n": pd.array(range(40), dtype="Int64")}
    )
    model = Estimator(nn.Linear(4, 2), nn.CrossEntropyLoss(), device="cpu", optimizer="sgd")
    history = model.fit((frame, Y), batch_size=8, epochs=1)
    assert len(history["train_loss"]) == 1 and history["train_loss"][0] == history["train_loss"][0]  # not nan
    frame.loc[3, "n"] = pd.NA
    with pytest.raises(FitforgeValueError, match=r"X has missing values \(NA\) in its nullable columns \['n'\]"):
        model.fit((frame, Y), batch_size=8, epochs=1)

"""FingerprintHandler: exact fingerprints of the loss and the parameters every n steps, kept on the device and
read once an epoch; ``fingerprint`` changes with any bit of any parameter, and with their places."""

import struct

import pytest
import torch

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CSVLoggerHandler, FingerprintHandler, LambdaHandler
from fitforge.handlers.fingerprint import fingerprint, loss_of
from fitforge.testing import linear_problem


def test_a_fingerprint_changes_with_one_bit_and_with_the_parameters_places():
    first, second = torch.randn(3, 4), torch.randn(5)
    base = fingerprint(torch.tensor(0.25), [first, second])
    assert torch.equal(base, fingerprint(torch.tensor(0.25), [first.clone(), second.clone()]))
    flipped = first.clone()
    flipped.view(torch.int32)[1, 2] ^= 1  # the lowest bit of one value
    assert base[1] != fingerprint(torch.tensor(0.25), [flipped, second])[1]
    assert base[1] != fingerprint(torch.tensor(0.25), [second, first])[1]
    assert base[0] != fingerprint(torch.tensor(0.5), [first, second])[0]
    assert struct.unpack("<d", struct.pack("<q", int(base[0])))[0] == 0.25  # the loss's exact value


def test_any_float_width_and_no_loss_or_parameter():
    half = [torch.randn(4, dtype=torch.bfloat16), torch.randn(2, dtype=torch.float16), torch.randn(3).double()]
    assert fingerprint(None, half).dtype == torch.int64
    assert fingerprint(torch.tensor(1.0, dtype=torch.bfloat16), []).tolist()[1] == 0


def test_every_nth_step_is_recorded_and_read_only_at_the_epochs_end(tmp_path):
    handler = FingerprintHandler(every=3)
    read_during_epochs, losses = [], []

    def look(state):
        read_during_epochs.append(len(handler.recorded))
        losses.append(float(state.output.loss.detach()))

    watch = LambdaHandler(batch_end=look, priority=1)
    estimator, train, _ = linear_problem()  # 8 batches an epoch
    estimator.fit(train, epochs=2, event_handlers=[handler, watch, CSVLoggerHandler(tmp_path / "log.csv")])
    assert read_during_epochs == [0] * 8 + [3] * 8  # nothing read until the first epoch ended
    steps = [entry[0] for entry in handler.recorded]
    assert steps == [0, 3, 6, 9, 12, 15]
    assert all(isinstance(loss, float) and len(params) == 16 for _, loss, params in handler.recorded)
    assert [entry[1] for entry in handler.recorded] == losses[::3]  # each step's loss, exactly


def test_the_fingerprints_go_back_to_a_checkpoints_state():
    handler = FingerprintHandler(every=1)
    handler.recorded = [[0, 1.5, "00ff"]]
    restored = FingerprintHandler(every=1)
    restored.load_state_dict(handler.state_dict())
    assert restored.recorded == [[0, 1.5, "00ff"]] and repr(restored) == "FingerprintHandler(every=1, keep=250)"


def test_past_keep_the_interval_doubles_and_the_odd_steps_go():
    handler = FingerprintHandler(every=1, keep=5)
    estimator, train, _ = linear_problem()  # 8 batches an epoch
    estimator.fit(train, epochs=2, event_handlers=[handler])
    # 8 steps at the first epoch's end: kept 0, 2, 4, 6; then every 2nd step of the second: 0, 4, 8, 12
    assert [entry[0] for entry in handler.recorded] == [0, 4, 8, 12] and handler.interval == 4
    assert handler.state_dict()["every"] == 4
    resumed = FingerprintHandler(every=1, keep=5)
    resumed.load_state_dict(handler.state_dict())
    assert resumed.interval == 4  # a resumed fit goes on at the saved interval
    for every, kept in ((3, 3), (2, 4), (1, 1)):  # 4 is not a doubling of 3; of 2 it is; 12 is not of 1
        other = FingerprintHandler(every=every)
        other.load_state_dict({**handler.state_dict(), "every": 12 if every == 1 else 4})
        assert other.interval == kept


def test_on_a_device_without_float64_the_loss_is_a_float32s_bits(monkeypatch):
    monkeypatch.setattr("fitforge.handlers.fingerprint._LOSS_FLOATS", {"cpu": torch.float32})  # as MPS
    loss = torch.tensor(0.1, dtype=torch.float64)
    bits = int(fingerprint(loss, [torch.ones(2)])[0])
    assert loss_of(bits, torch.device("cpu")) == float(torch.tensor(0.1, dtype=torch.float32))


@pytest.mark.parametrize(
    ("every", "error"), [(0, FitforgeValueError), (-2, FitforgeValueError), (1.5, FitforgeTypeError)]
)
def test_every_must_be_a_positive_int(every, error):
    with pytest.raises(error, match="FingerprintHandler.*every"):
        FingerprintHandler(every=every)


def test_keep_must_be_at_least_2():
    for keep in (1, 0):
        with pytest.raises(FitforgeValueError, match=r"FingerprintHandler: keep must be an int of at least 2"):
            FingerprintHandler(keep=keep)
    with pytest.raises(FitforgeTypeError, match=r"FingerprintHandler: keep must be an int of at least 2 .*, got '3'"):
        FingerprintHandler(keep="3")

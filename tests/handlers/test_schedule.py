"""ScheduleHandler: momentum, weight decay, Adam's betas... as functions of training progress,
read back from the optimizer at every step, and exactly across a resume."""

import logging
import math
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import BatchOutput, BatchProcessor, Estimator
from fitforge.events import BatchBegin
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, GradientUpdateHandler, ScheduleHandler
from fitforge.testing import linear_problem
from helpers import Crash


def momentum(progress):
    return 0.95 - 0.1 * progress  # 0.95 at the first step, 0.85 at the last


def decay(progress):
    return 1e-3 * (1 + math.cos(math.pi * progress)) / 2


class Settings(BatchBegin):
    """The settings each batch trains with (read from the optimizer: what its step uses)."""

    priority = 500

    def __init__(self, *keys):
        self.keys, self.seen = keys, []

    def batch_begin(self, state):
        group = state.estimator.optimizer.param_groups[0]
        self.seen.append(tuple(group[key] for key in self.keys))


def sgd_problem():
    estimator, train, _ = linear_problem()  # 8 batches per epoch
    estimator.optimizers = [torch.optim.SGD(estimator.net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.0)]
    return estimator, train


def test_momentum_and_weight_decay_follow_their_functions_at_each_step():
    estimator, train = sgd_problem()
    seen = Settings("momentum", "weight_decay")
    schedule = ScheduleHandler({"momentum": momentum, "weight_decay": decay})
    estimator.fit(train, epochs=2, event_handlers=[schedule, seen])
    expected = [(momentum(k / 15), decay(k / 15)) for k in range(16)]  # 16 optimizer steps: progress 0..1
    assert [m for m, _ in seen.seen] == pytest.approx([m for m, _ in expected])
    assert [w for _, w in seen.seen] == pytest.approx([w for _, w in expected])


def test_with_accumulation_progress_counts_optimizer_steps():
    estimator, train = sgd_problem()
    seen = Settings("momentum")
    handlers = [ScheduleHandler({"momentum": momentum}), seen, GradientUpdateHandler(accumulate=4)]
    estimator.fit(train, epochs=2, event_handlers=handlers)
    steps = [momentum(k / 3) for k in range(4)]  # 2 epochs x 8 / 4 = 4 steps
    assert [m for (m,) in seen.seen] == pytest.approx([value for value in steps for _ in range(4)])


def test_per_epoch_and_adams_betas_by_index():
    estimator, train, _ = linear_problem()
    estimator.optimizers = [torch.optim.Adam(estimator.net.parameters(), lr=0.01)]
    seen = Settings("betas")
    schedule = ScheduleHandler({"betas[0]": lambda p: 0.9 - 0.4 * p}, interval="epoch")
    estimator.fit(train, epochs=3, event_handlers=[schedule, seen])
    firsts = [betas[0] for (betas,) in seen.seen]
    # set at each epoch's start from the steps taken: 0, 8 and 16 of 24
    assert firsts == pytest.approx([0.9] * 8 + [0.9 - 0.4 * 8 / 23] * 8 + [0.9 - 0.4 * 16 / 23] * 8)
    assert all(betas[1] == 0.999 for (betas,) in seen.seen)


def test_only_the_groups_named_are_set():
    estimator, train, _ = linear_problem()
    net = estimator.net
    estimator.optimizers = [torch.optim.SGD([{"params": [net.weight]}, {"params": [net.bias]}], lr=0.1, momentum=0.5)]
    estimator.fit(train, epochs=1, event_handlers=[ScheduleHandler({"momentum": lambda p: 0.9}, groups=[1])])
    assert [group["momentum"] for group in estimator.optimizers[0].param_groups] == [0.5, 0.9]


g = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 6, generator=g), torch.randint(0, 3, (48,), generator=g)


def train(folder, seed=0, resume=False, extra=(), interval="batch"):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), device="cpu"
    )
    seen = Settings("momentum", "weight_decay")
    handlers = [
        ScheduleHandler({"momentum": momentum, "weight_decay": decay}, interval=interval),
        seen,
        CheckpointHandler(folder, batch_period=1, max_checkpoints=2, resume_from_checkpoint=resume),
        *extra,
    ]
    data = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)
    try:
        estimator.fit(data, epochs=2, event_handlers=handlers)
    except RuntimeError as error:
        assert str(error) == "crash"
    return {k: v.clone() for k, v in net.state_dict().items()}, seen.seen


@pytest.mark.parametrize("interval", ["batch", "epoch"])
def test_a_crash_and_resume_continues_the_schedules_exactly(tmp_path, tmp_path_factory, interval):
    whole, whole_seen = train(tmp_path_factory.mktemp("whole"), interval=interval)
    _, before = train(tmp_path, extra=[Crash(9)], interval=interval)  # in the middle of epoch 2
    resumed, after = train(tmp_path, seed=123, resume=True, interval=interval)
    assert before[:9] + after == whole_seen  # every step's settings, none repeated
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"schedules": {}}, FitforgeTypeError, "schedules must be a non-empty dict"),
        ({"schedules": {"momentum": 0.9}}, FitforgeTypeError, "the schedule of 'momentum' must be a function"),
        ({"schedules": {"betas(0)": momentum}}, FitforgeValueError, "'betas(0)' is no param-group key"),
        ({"schedules": {"momentum": momentum}, "interval": "step"}, FitforgeValueError, "interval must be"),
        ({"schedules": {"momentum": momentum}, "optimizer": "0"}, FitforgeTypeError, "optimizer must be an index"),
        ({"schedules": {"momentum": momentum}, "groups": []}, FitforgeTypeError, "groups must be a non-empty list"),
        ({"schedules": {"momentum": momentum}, "groups": [-1]}, FitforgeTypeError, "(ints >= 0), got list [-1]"),
        ({"schedules": {"momentum": momentum}, "total_steps": 0}, FitforgeTypeError, "total_steps must be an int"),
    ],
)
def test_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        ScheduleHandler(**kwargs)


@pytest.mark.parametrize(
    "schedules, message",
    [
        ({"momentun": momentum}, "SGD has no setting 'momentun'; its settings: ['dampening', "),
        ({"params": momentum}, "SGD has no setting 'params'"),
        ({"momentum[0]": momentum}, "SGD's 'momentum' is 0.9, which has no entry 0"),
        ({"nesterov": momentum}, "SGD's 'nesterov' is False, no number to schedule"),
    ],
)
def test_an_unknown_key_fails_at_fit_start_naming_the_optimizers_keys(schedules, message):
    estimator, train = sgd_problem()
    before = [p.clone() for p in estimator.net.parameters()]
    with pytest.raises(FitforgeValueError, match=re.escape(message)):
        estimator.fit(train, epochs=1, event_handlers=[ScheduleHandler(schedules)])
    assert all(torch.equal(a, b) for a, b in zip(before, estimator.net.parameters()))


def test_a_tuple_setting_is_scheduled_by_entry_and_a_bad_value_is_named():
    estimator, train, _ = linear_problem()
    estimator.optimizers = [torch.optim.Adam(estimator.net.parameters(), lr=0.01)]
    with pytest.raises(FitforgeValueError, match=re.escape("'betas' is a tuple (0.9, 0.999): schedule its entries")):
        estimator.fit(train, epochs=1, event_handlers=[ScheduleHandler({"betas": momentum})])
    with pytest.raises(FitforgeValueError, match=re.escape("the schedule of 'eps' gave float nan at progress 0")):
        estimator.fit(train, epochs=1, event_handlers=[ScheduleHandler({"eps": lambda p: math.nan})])


def test_numpy_and_tensor_values_are_taken():
    import numpy as np

    estimator, train = sgd_problem()
    schedule = ScheduleHandler({"momentum": lambda p: np.float32(0.5), "weight_decay": lambda p: torch.tensor(1e-4)})
    estimator.fit(train, epochs=1, event_handlers=[schedule])
    group = estimator.optimizer.param_groups[0]
    assert group["momentum"] == 0.5 and group["weight_decay"] == pytest.approx(1e-4)


class TwoTurns(BatchProcessor):
    def fit_batch(self, state, batch):
        out = super().fit_batch(state, batch)
        return BatchOutput(
            out.data, out.label, out.pred, out.loss, out.losses, out.batch_size, step=[state.global_step % 2]
        )


def test_optimizers_taking_turns_get_a_warning_and_total_steps_spans_the_schedule(caplog):
    def fit(handler):
        estimator, train, _ = linear_problem()
        net = estimator.net
        estimator.optimizers = [
            torch.optim.SGD([net.weight], lr=0.1, momentum=0.5),
            torch.optim.SGD([net.bias], lr=0.1, momentum=0.5),
        ]
        estimator.batch_processor = TwoTurns()
        estimator.fit(train, epochs=2, event_handlers=[handler])
        return estimator.optimizers[1].param_groups[0]["momentum"]

    with caplog.at_level(logging.WARNING, logger="fitforge"):
        fit(ScheduleHandler({"momentum": lambda p: p}, optimizer=1))
    assert "optimizer 1 stepped 0 of the fit's first 1 optimizer steps (optimizers taking turns)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        last = fit(ScheduleHandler({"momentum": lambda p: p}, optimizer=1, total_steps=8))  # 8 of the 16 batches
    assert "taking turns" not in caplog.text and last == pytest.approx(1.0)

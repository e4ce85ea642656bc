"""The engine as an object: names resolve to the built-in strategies, an instance is taken as it is,
and an engine of one's own (a Strategy subclass) is what fit, evaluate and predict go through."""

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.distributed import DDPStrategy, FSDPStrategy, Strategy
from fitforge.distributed.strategy import resolve_strategy
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from helpers import regression_batches


@pytest.mark.parametrize(
    ("name", "kind", "recorded"),
    [
        ("auto", DDPStrategy, "auto"),
        ("ddp", DDPStrategy, "ddp"),
        ("fsdp", FSDPStrategy, "fsdp"),
        ("none", Strategy, "none"),
        (None, Strategy, "none"),
    ],
)
def test_a_name_gives_its_engine(name, kind, recorded):
    strategy = resolve_strategy(name, {"find_unused_parameters": True} if kind is DDPStrategy else None)
    assert type(strategy) is kind and strategy.name == recorded
    assert strategy.sharded is (kind is FSDPStrategy) and strategy.inference_mode is (kind is not FSDPStrategy)


def test_an_instance_is_the_estimators_strategy_and_its_options_are_its_own():
    strategy = DDPStrategy(required=False, find_unused_parameters=True)
    estimator = Estimator(nn.Linear(1, 1), nn.MSELoss(), optimizer="sgd", device="cpu", strategy=strategy)
    assert estimator.strategy is strategy and strategy.options == {"find_unused_parameters": True}
    with pytest.raises(FitforgeValueError, match="give its options to its constructor"):
        Estimator(nn.Linear(1, 1), nn.MSELoss(), device="cpu", strategy=Strategy(), strategy_options={"x": 1})
    with pytest.raises(FitforgeTypeError, match=r"pass strategy=DDPStrategy\(...\), not the class"):
        Estimator(nn.Linear(1, 1), nn.MSELoss(), device="cpu", strategy=DDPStrategy)
    with pytest.raises(FitforgeTypeError, match="strategy_options must be a dict"):
        resolve_strategy("ddp", ["find_unused_parameters"])


class Doubled(nn.Module):
    """A wrapper an engine puts around the net: the forward goes through it."""

    def __init__(self, net):
        super().__init__()
        self.net, self.calls = net, 0

    def forward(self, x):
        self.calls += 1
        return self.net(x)


class Recording(Strategy):
    """An engine of one's own, in one class: it wraps the net and evaluates in no_grad mode."""

    name = "recording"
    inference_mode = False

    def __init__(self):
        self.prepared, self.evaluated = 0, 0

    def wrap(self, net, optimizers, device):
        return Doubled(net)

    def prepare_fit(self, estimator):
        self.prepared += 1
        super().prepare_fit(estimator)

    def evaluating(self, net, average=None):
        self.evaluated += 1
        return super().evaluating(net, average)


def test_an_engine_of_ones_own_is_what_fit_evaluate_and_predict_go_through():
    torch.manual_seed(0)
    strategy = Recording()
    net = nn.Linear(1, 1)
    estimator = Estimator(
        net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu", strategy=strategy
    )
    assert isinstance(estimator.train_net, Doubled) and estimator.net is net
    history = estimator.fit(regression_batches(), val_data=regression_batches(), epochs=2)
    assert estimator.train_net.calls == 2 * len(regression_batches())  # every training forward through the wrapper
    assert strategy.prepared == 1 and strategy.evaluated >= 2  # the checks' first validation batch, then each epoch
    assert history["val_loss"][-1] < history["val_loss"][0]
    with torch.enable_grad():
        evaluated = strategy.evaluated
        estimator.predict(torch.ones(4, 1))
        assert strategy.evaluated == evaluated + 1


def test_an_engine_adds_its_own_handlers_to_every_fit_and_they_are_checkpointed(tmp_path):
    from fitforge.checkpoint.files import load_checkpoint
    from fitforge.handlers import CheckpointHandler, LambdaHandler

    class Scheduled(Strategy):
        def __init__(self):
            self.steps = []
            self.handler = LambdaHandler(batch_end=lambda state: self.steps.append(state.global_step))

        def fit_handlers(self):
            return [self.handler]

    strategy = Scheduled()
    estimator = Estimator(nn.Linear(1, 1), nn.MSELoss(), optimizer="sgd", device="cpu", strategy=strategy)
    assert "LambdaHandler" in estimator.describe_loop()
    estimator.fit(regression_batches(), epochs=2, event_handlers=[CheckpointHandler(tmp_path)])
    assert strategy.steps == [0, 1, 2, 3, 4, 5]
    assert "LambdaHandler" in load_checkpoint(tmp_path / "model-epoch2batch6.pt")["handlers"]

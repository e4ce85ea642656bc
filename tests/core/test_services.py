"""The run's services: what handlers share without knowing each other (fitforge.core.services)."""

import ast
from pathlib import Path

import torch
from torch import nn

import fitforge
from fitforge import Estimator
from fitforge.events import BatchEnd, EpochEnd, Services, Stage, TrainBegin, Undoable
from fitforge.handlers import EMAHandler, GradientUpdateHandler, SpikeGuardHandler

HANDLERS = Path(fitforge.__file__).parent / "handlers"


def test_no_handler_module_reads_the_runs_handlers():
    found = []
    for path in sorted(HANDLERS.glob("*.py")):
        if path.name in ("__init__.py", "defaults.py"):  # defaults assembles the run's handlers
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "handlers" and ast.unparse(node.value) == "state":
                found.append(f"{path.name}:{node.lineno}")
    assert not found, "read what other handlers offer through state.services:\n" + "\n".join(found)


class Counter(TrainBegin, BatchEnd):
    """A handler of the user's: counts its batches, offering the count to be set back with the weights."""

    def __init__(self):
        self.batches = 0
        self.offered: Services | None = None

    def offer(self, services):
        self.offered = services
        services.undoables.append(Undoable(lambda: self.batches, self._rewind))

    def _rewind(self, batches):
        self.batches = batches

    def train_begin(self, state):
        assert state.services is self.offered  # offered before any train_begin, to the run's services

    def batch_end(self, state):
        self.batches += 1


def test_a_users_handler_offers_state_a_spike_recovery_sets_back():
    torch.manual_seed(0)
    x, y = torch.randn(64 * 40, 4), torch.randn(64 * 40, 1)
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, len(x), 64)]
    bad = list(batches)
    bad[30] = (bad[30][0] * float("nan"), bad[30][1])
    net = nn.Linear(4, 1)
    est = Estimator(net, nn.MSELoss(), device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.01))
    counter = Counter()
    guard = SpikeGuardHandler(snapshot_every=4)
    est.fit(bad, epochs=1, event_handlers=[guard, counter], default_handlers=False)
    assert guard.recoveries  # the nan batch was undone
    # Set back to the snapshot's count, then counting on: fewer than the 39 batches that reached batch_end.
    assert counter.batches < 39


def test_an_evaluation_has_the_services_its_own_handlers_offer():
    seen = []

    class Look(BatchEnd):
        def batch_end(self, state):
            seen.append(state.services)

    net = nn.Linear(2, 1)
    Estimator(net, nn.MSELoss(), device="cpu").evaluate([(torch.ones(2, 2), torch.ones(2, 1))], event_handlers=[Look()])
    # its MetricHandler's first-batch check and sums; nothing of a fit's
    assert len(seen[0].first_batch_checks) == 1 and not seen[0].checkpoints and seen[0].steps is None


class StepsAndAverage(BatchEnd, EpochEnd):
    """A user's handler: the run's optimizer steps and EMA weights, read through the services; it runs
    after the optimizer step because it reads what the step writes (its declared access), at the step's
    own stage and given first."""

    priority = Stage.STEP
    reads = ("services", "optimizer_steps")

    def __init__(self):
        self.seen, self.per_optimizer, self.average = [], None, None

    def batch_end(self, state):
        self.seen.append(state.optimizer_steps)

    def epoch_end(self, state):
        self.per_optimizer = state.services.steps.steps_per_optimizer(state)
        (average,) = state.services.averages
        self.average = average.averaged_state_dict()


def test_a_users_handler_reads_the_optimizer_steps_and_the_ema_weights_through_the_services():
    torch.manual_seed(0)
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)]
    net = nn.Linear(3, 1)
    est = Estimator(net, nn.MSELoss(), device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    user, ema = StepsAndAverage(), EMAHandler(decay=0.5)
    handlers = [user, GradientUpdateHandler(accumulate=2), ema]
    est.fit(batches, epochs=1, event_handlers=handlers, default_handlers=False, check_access=True)
    assert user.seen == [0, 1, 1, 2, 2, 3]  # after each batch's step (a step every 2 batches)
    assert user.per_optimizer == [3]
    assert all(torch.equal(user.average[k], v) for k, v in ema.averaged_state_dict().items())
    assert not torch.equal(user.average["weight"], net.weight)  # the average, not the trained weights


class AverageAtEachStep(BatchEnd):
    """A user's handler at the EMA's own stage, given before it: ordered after it by its declared read alone."""

    priority = Stage.METRICS
    reads = ("optimizer_steps", "services.averages")

    def __init__(self):
        self.seen = []

    def batch_end(self, state):
        (average,) = state.services.averages
        self.seen.append((state.optimizer_steps, average.updates))


def test_a_reader_of_the_averages_runs_after_the_ema_update_by_its_declared_access():
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    net = nn.Linear(3, 1)
    est = Estimator(net, nn.MSELoss(), device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    reader = AverageAtEachStep()
    est.fit(batches, epochs=1, event_handlers=[reader, EMAHandler(decay=0.5)], default_handlers=False)
    assert reader.seen == [(1, 1), (2, 2), (3, 3)]  # this step's average, not the one before


def test_services_show_what_was_offered():
    assert repr(Services(keys_complete=False)).startswith("Services(history_keys=<class 'list'>, keys_complete=False")


def test_an_old_role_import_says_what_to_offer_instead():
    import pytest

    with pytest.raises(ImportError, match="FirstBatchCheck is no longer a role.*first_batch_checks"):
        from fitforge.events import FirstBatchCheck  # noqa: F401

"""The run's services: what handlers share without knowing each other (fitforge.core.services)."""

import ast
from pathlib import Path

import torch
from torch import nn

import fitforge
from fitforge import Estimator
from fitforge.core.services import Services, Undoable
from fitforge.events import BatchEnd, TrainBegin
from fitforge.handlers import SpikeGuardHandler

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


def test_evaluate_and_predict_have_empty_services():
    seen = []

    class Look(BatchEnd):
        def batch_end(self, state):
            seen.append(state.services)

    net = nn.Linear(2, 1)
    Estimator(net, nn.MSELoss(), device="cpu").evaluate([(torch.ones(2, 2), torch.ones(2, 1))], event_handlers=[Look()])
    assert seen and not seen[0].undoables and not seen[0].checkpoints and not seen[0].epoch_lines

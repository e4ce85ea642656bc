"""One replica group of tests/fault_tolerance/test_replica_groups.py: ``python replica_group.py OUT GROUP``,
with the lighthouse in TORCHFT_LIGHTHOUSE and the plan in FT_PLAN (a JSON object):

- ``kill_at``: this group SIGKILLs itself at the start of that step (one life only: FT_LIFE=1);
- ``veto_at``: this group vetoes that step's first attempt;
- ``stall_at``: after committing that step, sleep ``stall_for`` seconds (the others go on without it);
- ``slow``: sleep that many seconds after every committed step;
- ``batch``, ``epochs``: other than BATCH and EPOCHS;
- ``checkpoints``: a CheckpointHandler every 7 batches in ``OUT/checkpoints-<group>`` (resumed from);
- ``seed``: the strategy's seed (None: drawn after ``torch.manual_seed(group)``, so the groups draw apart);
- ``pause_at``: after committing that step, wait until the file ``OUT/asked-<group>`` of ``pause_for`` exists
  (a restarted group writes it at train_begin, just before it asks for its first quorum), then a second.

The groups of one start (FT_GROUPS of them) wait for each other's ``OUT/up-<group>`` before their fit.

Each attempt is recorded in ``OUT/record-<group>-<life>.jsonl``: the step, the weights' digest at its start,
and, once committed, the samples it trained; the final weights go to ``OUT/final-<group>.pt``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.core.events import BatchBegin, BatchEnd, Stage, TrainBegin
from fitforge.fault_tolerance import FaultTolerantStrategy
from fitforge.handlers import CheckpointHandler

SIZE, BATCH, EPOCHS, SEED = 360, 12, 4, 1234


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SIZE, 8, generator=generator, dtype=torch.float64)
    y = x @ torch.randn(8, 1, generator=generator, dtype=torch.float64) + 0.1 * torch.randn(
        SIZE, 1, generator=generator, dtype=torch.float64
    )
    return TensorDataset(x, y)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def digest(net: nn.Module) -> list[float]:
    return [float(p.detach().double().sum()) for p in net.parameters()]


class Plan(TrainBegin, BatchBegin, BatchEnd):
    priority = Stage.STEP - 2  # before the quorum's handler: a veto counts for this step

    def __init__(self, out: Path, group: int, life: int, plan: dict, strategy: FaultTolerantStrategy) -> None:
        self.out, self.group, self.life, self.plan, self.strategy = out, group, life, plan, strategy
        self.record = (out / f"record-{group}-{life}.jsonl").open("a", buffering=1)  # kept open: a SIGKILL ends it
        self.vetoed = False

    def train_begin(self, state) -> None:
        if self.life > 1:
            (self.out / f"asked-{self.group}").touch()

    def batch_begin(self, state) -> None:
        step = state.global_step
        if self.plan.get("kill_at") == step and self.life == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        share = self.strategy.batches.share
        self.record.write(
            json.dumps({"attempt": step, "groups": share.groups, "digest": digest(state.estimator.net)}) + "\n"
        )

    def batch_end(self, state) -> None:
        if self.plan.get("veto_at") == state.global_step and not self.vetoed:
            self.vetoed = True
            self.strategy.veto_step("injected")


class Committed(BatchEnd):
    priority = Stage.STEP + 1  # after the optimizer step: only committed steps get here

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    def batch_end(self, state) -> None:
        share = self.plan.strategy.batches.share
        self.plan.record.write(
            json.dumps({"step": share.step, "indices": share.indices, "groups": share.groups, "weight": share.weight})
            + "\n"
        )
        if self.plan.plan.get("pause_at") == share.step:
            up = self.plan.out / f"asked-{self.plan.plan['pause_for']}"
            while not up.exists():
                os.sched_yield()
            time.sleep(1)  # its quorum request is then waiting at the lighthouse: the next quorum takes it in
        if self.plan.plan.get("stall_at") == share.step and self.plan.life == 1:
            time.sleep(self.plan.plan["stall_for"])
        time.sleep(self.plan.plan.get("slow", 0))


def main() -> None:
    out, group = Path(sys.argv[1]), int(sys.argv[2])
    life, plan = int(os.environ.get("FT_LIFE", "1")), json.loads(os.environ.get("FT_PLAN", "{}"))
    torch.set_num_threads(1)
    torch.manual_seed(group)
    strategy = FaultTolerantStrategy(replica_id=group, timeout=10.0, quorum_timeout=60.0, seed=plan.get("seed", SEED))
    net = model()
    estimator = Estimator(
        net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), strategy=strategy
    )
    (out / f"up-{group}").touch()
    while len(list(out.glob("up-*"))) < int(os.environ.get("FT_GROUPS", "1")):  # the groups start at once
        os.sched_yield()
    recorder = Plan(out, group, life, plan, strategy)
    loader = DataLoader(data(), batch_size=plan.get("batch", BATCH), shuffle=True)
    handlers = [recorder, Committed(recorder)]
    if plan.get("checkpoints"):
        handlers.append(
            CheckpointHandler(str(out / f"checkpoints-{group}"), batch_period=7, resume_from_checkpoint=True)
        )
    estimator.fit(loader, epochs=plan.get("epochs", EPOCHS), event_handlers=handlers)
    final = {name: p.detach() for name, p in net.state_dict().items()}
    torch.save({"weights": final, "seed": strategy.seed}, out / f"final-{group}.pt")


if __name__ == "__main__":
    main()

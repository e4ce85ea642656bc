"""Run under torchrun: a study of 2 trials on 2 ranks, as docs/tuning.md tells. Rank 0 runs the
study and passes its trial, the other rank runs the same objective with ``None``; the learning rate
rank 0 suggests reaches every rank. Validation every 2 batches is reported by batches, and the
pruner prunes trial 1 at step 6 (the 2nd batch of the 2nd epoch). Each rank writes, per trial, the
batches it trained, where it stopped and what fit raised, to OUT/result-rank<r>.json.

Usage: optuna_run.py OUT
"""

import contextlib
import json
import sys
from pathlib import Path

import optuna
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.distributed import rank
from fitforge.distributed.ranks import broadcast_from_main
from fitforge.handlers import LambdaHandler, OptunaPruningHandler, ValidationHandler

PRUNE_TRIAL, PRUNE_STEP = 1, 6
dist.init_process_group("gloo")  # before the first broadcast (an Estimator would make it only later)
out = Path(sys.argv[1])
generator = torch.Generator().manual_seed(0)
x = torch.rand(32, 1, generator=generator)
train = TensorDataset(x, 2 * x + 3)
val = TensorDataset(x[:16], 2 * x[:16] + 3)
trials: list[dict] = []


class PruneTrialAtStep(optuna.pruners.BasePruner):
    """Prunes trial PRUNE_TRIAL once it reported step PRUNE_STEP: a verdict known in advance."""

    def prune(self, study, trial) -> bool:
        return trial.number == PRUNE_TRIAL and PRUNE_STEP in trial.intermediate_values


def objective(trial: optuna.Trial | None) -> float:
    lr = broadcast_from_main(trial.suggest_float("lr", 0.01, 0.1) if trial is not None else None)
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=lr), device="cpu")
    seen: dict = {"batches": [], "lr": lr}
    handlers = [
        ValidationHandler(DataLoader(val, batch_size=4), batch_period=2, epoch_period=None),
        OptunaPruningHandler(trial),
        LambdaHandler(
            batch_end=lambda state: seen["batches"].append(state.global_step + 1),
            train_end=lambda state: seen.update(epoch=state.epoch, batch_idx=state.batch_idx, steps=state.global_step),
        ),
    ]
    trials.append(seen)
    try:
        history = estimator.fit(DataLoader(train, batch_size=4), epochs=4, event_handlers=handlers)
    except optuna.TrialPruned as pruned:
        seen["raised"] = str(pruned)
        raise
    return history["val_loss"][-1]


if rank() == 0:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=f"sqlite:///{out / 'study.db'}", pruner=PruneTrialAtStep())
    study.optimize(objective, n_trials=2)
    for seen, trial in zip(trials, study.trials):
        seen.update(state=trial.state.name, reported=sorted(trial.intermediate_values))
else:
    for _ in range(2):  # as many trials as rank 0's study runs
        with contextlib.suppress(optuna.TrialPruned):  # rank 0's study records it; here it only ends the trial
            objective(None)
(out / f"result-rank{rank()}.json").write_text(json.dumps(trials))

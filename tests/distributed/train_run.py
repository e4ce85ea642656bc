"""Run under torchrun (or plain python for one process): train a small classifier with fitforge's
automatic data parallelism, and write this rank's results to OUT/result-rank<r>.json.

Usage: train_run.py OUT CONFIG_JSON, where CONFIG_JSON holds: epochs (or batches), global_batch, and
optionally device (None: the rank's own), strategy, shuffle, batch_period, resume, per_rank_dirs
(each rank its own output folder, to see which ranks write), sigterm_at / sigterm_rank (that rank
sends itself SIGTERM after that batch), stop_at (rank 1 alone requests a stop after that batch),
cancel_fit_at (rank 1 alone raises CancelFit there), stop_at_epoch_begin (rank 1 alone requests a
stop at that epoch's begin), edge_eval (evaluate 1 sample, predict with drop_last), bypass_ddp (a
processor that forwards through estimator.net, not the DDP wrapper), user_ddp (the script
initialises the group and wraps the net and samplers itself), model_dir (a checkpoint folder shared
by runs), kill_at / kill_rank (that rank kills itself with SIGKILL after that batch, in torchrun's
first round only, for an elastic restart to resume from the newest checkpoint), agree_every (the
ranks agree on stops every that many batches, after the first; without it, as often as fit chooses),
finetune (the first layer frozen for a first fit of one epoch, then unfrozen for the fit measured),
async_save (CheckpointHandler(async_save=True)), batch_seconds (each batch sleeps that long),
fail_write (rank 0's n-th checkpoint write fails with a CheckpointError, as a full disk would; the
error lands in each rank's result as "error"), muon (optimizer="muon": Muon for the hidden layer's weight,
AdamW for the rest), export (after the fit, estimator.export(OUT/model.safetensors) on every rank), checkpointing
(activation_checkpointing=nn.Linear).
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fitforge import BatchProcessor, Estimator
from fitforge.distributed.ranks import rank
from fitforge.distributed.stop_agreement import StopAgreement
from fitforge.exceptions import CancelFit
from fitforge.handlers import CheckpointHandler, CSVLoggerHandler, LambdaHandler, ThroughputHandler

out, config = Path(sys.argv[1]), json.loads(sys.argv[2])
if config.get("agree_every"):  # a fixed interval: every proposal is the largest allowed
    StopAgreement.max_interval, StopAgreement.max_latency = config["agree_every"], 1e9
world = int(os.environ.get("WORLD_SIZE", "1"))
torch.manual_seed(0)
generator = torch.Generator().manual_seed(0)
x, y = torch.randn(80, 6, generator=generator), torch.randint(0, 3, (80,), generator=generator)
net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


class Bypass(BatchProcessor):
    def fit_batch(self, state, batch):
        state.estimator.train_net = state.estimator.net  # the mistake the replicas check catches
        return super().fit_batch(state, batch)


train_set, val_set = TensorDataset(x, y), TensorDataset(x[:50], y[:50])  # val: 25 per rank of 2, uneven batches
if config.get("finetune"):
    net[0].requires_grad_(False)
optimizer = "muon" if config.get("muon") else torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
model = net
train_options: dict = {"shuffle": config.get("shuffle", False)}
val_options: dict = {}
if config.get("user_ddp"):  # the script makes the group, the DDP wrapper and the samplers itself
    dist.init_process_group("gloo")
    model = DistributedDataParallel(net)
    train_options = {"sampler": DistributedSampler(train_set, shuffle=False)}
    val_options = {"sampler": DistributedSampler(val_set, shuffle=False)}
estimator = Estimator(
    model,
    nn.CrossEntropyLoss(),
    train_metrics="accuracy",
    device=config.get("device", "cpu"),
    optimizer=optimizer,
    strategy=config.get("strategy", "auto"),
    activation_checkpointing=nn.Linear if config.get("checkpointing") else None,
    batch_processor=Bypass() if config.get("bypass_ddp") else None,
)
me = rank()
train = DataLoader(train_set, batch_size=config["global_batch"] // world, **train_options)
val = DataLoader(val_set, batch_size=8, **val_options)
folder = out / f"rank{me}" if config.get("per_rank_dirs") else out
handlers = [
    CheckpointHandler(
        config.get("model_dir", folder / "checkpoints"),
        batch_period=config.get("batch_period"),
        resume_from_checkpoint=config.get("resume", False),
        async_save=config.get("async_save", False),
    ),
    CSVLoggerHandler(folder / "log.csv", append=config.get("resume", False)),
]
if config.get("sigterm_at") is not None and me == config.get("sigterm_rank", 1):

    def terminate(state):
        if state.global_step == config["sigterm_at"]:
            os.kill(os.getpid(), signal.SIGTERM)  # this rank only: the others learn of it by the reduced flag

    handlers.append(LambdaHandler(batch_end=terminate))
if config.get("batch_seconds"):  # slow batches: a test signals a launcher while training goes on
    import time

    handlers.append(LambdaHandler(batch_end=lambda state: time.sleep(config["batch_seconds"])))
if config.get("cancel_fit_at") is not None and me == 1:

    def cancel(state):
        if state.global_step == config["cancel_fit_at"]:
            raise CancelFit("rank 1 alone")

    handlers.append(LambdaHandler(batch_end=cancel))
if config.get("stop_at_epoch_begin") is not None and me == 1:
    handlers.append(
        LambdaHandler(
            epoch_begin=lambda state: (
                state.run.stop("rank 1 at epoch_begin") if state.epoch == config["stop_at_epoch_begin"] else None
            )
        )
    )
if config.get("stop_at") is not None and me == 1:
    handlers.append(
        LambdaHandler(
            batch_end=lambda state: (
                state.run.stop("rank 1's own reason") if state.global_step == config["stop_at"] else None
            )
        )
    )
if config.get("fail_write") and me == 0:
    from fitforge.checkpoint import storage
    from fitforge.exceptions import CheckpointError

    real_write, writes = storage.save_checkpoint, []

    def failing_write(checkpoint, path):
        writes.append(path)
        if len(writes) == config["fail_write"]:
            raise CheckpointError(f"cannot write {path}: No space left on device (injected)")
        return real_write(checkpoint, path)

    storage.save_checkpoint = failing_write
restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if config.get("kill_at") is not None and me == config.get("kill_rank", 1) and restarts == 0:

    def die(state):
        if state.global_step == config["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all, as the OOM killer or a lost node would do

    handlers.append(LambdaHandler(batch_end=die))
ended: dict = {}


def first_epoch_begin(state):  # the step a resumed run went on from
    ended.setdefault("first_step", state.global_step)


handlers.append(
    LambdaHandler(
        epoch_begin=first_epoch_begin,
        train_end=lambda state: ended.update(steps=state.global_step, reason=state.run.stop_reason),
    )
)

throughput = ThroughputHandler(flops=False)  # the default's class: it replaces it, and tells its count
handlers.append(throughput)
result: dict = {"rank": me, "world": world, "restarts": restarts}
if config.get("finetune"):  # DDP made with the first layer frozen syncs no gradient of it: fit wraps anew
    estimator.fit(train, epochs=1, default_handlers=False)
    net[0].requires_grad_(True)
try:
    history = estimator.fit(
        train, val_data=val, epochs=config.get("epochs"), batches=config.get("batches"), event_handlers=handlers
    )
    values = [key for key in history if key.startswith(("train_", "val_"))]
    result["history"] = {key: history[key] for key in values if not key.endswith("_per_s")}  # speeds differ by run
    result["samples_per_s"] = history.get("train_samples_per_s")
    result["samples"] = throughput.samples
    result["evaluate"] = estimator.evaluate(val)
    predictions = estimator.predict(val)
    result["predict"] = None if predictions is None else predictions.tolist()
    if config.get("edge_eval"):  # shares smaller than the ranks, and drop_last (not applied to shares)
        result["tiny_evaluate"] = estimator.evaluate(DataLoader(TensorDataset(x[:1], y[:1]), batch_size=4))
        dropped = estimator.predict(DataLoader(TensorDataset(x[:7], y[:7]), batch_size=2, drop_last=True))
        result["dropped_predict"] = None if dropped is None else dropped.tolist()
except SystemExit as stop:
    result["exit"] = stop.code
    raise
except Exception as err:
    result["error"] = f"{type(err).__name__}: {err}"
    raise
finally:
    result.update(ended)
    weights = net.state_dict()
    if estimator.strategy.sharded:  # each rank holds shards: gather the full tensors (a collective)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        weights = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    result["params"] = {name: value.tolist() for name, value in weights.items()}
    if config.get("export") and "error" not in result:  # every rank calls it; rank 0 writes
        estimator.export(out / "model.safetensors")
    (out / f"result-rank{me}.json").write_text(json.dumps(result))

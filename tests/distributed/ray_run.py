"""Start a local Ray cluster, train with fitforge inside a Ray TorchTrainer on 2 CPU workers (gloo),
and write OUT/result.json (rank 0's final weights and history, the checkpoint it resumed from, whether
fit used Ray's process group) and OUT/reported.json (what Ray kept: the last metrics and checkpoint).

Usage: ray_run.py OUT CONFIG_JSON, where CONFIG_JSON holds epochs, and optionally kill_at (in the
first attempt, worker 1 kills itself with SIGKILL after that global step; Ray restarts the group,
FailureConfig(max_failures=1)), batch_period, workers (default 2), and beside (the checkpoints saved
by a CheckpointHandler of the script's, in OUT/checkpoints, beside a RayTrainReportHandler that
reports them). The same script with workers 0 trains in this process without Ray (the reference).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

GLOBAL_BATCH, SAMPLES = 16, 96


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 6, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long())


def train(config: dict) -> dict:
    """One worker's fit (or the whole fit without Ray): the weights and history of this process."""
    from fitforge import Estimator
    from fitforge.distributed.ranks import rank, world_size
    from fitforge.handlers import LambdaHandler

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    )
    data = make_data()
    train_loader = DataLoader(data, batch_size=GLOBAL_BATCH // world_size(), shuffle=True)
    val_loader = DataLoader(data, batch_size=32)
    handlers: list = []
    saver = None
    if config.get("workers"):
        from fitforge.handlers import CheckpointHandler, RayTrainReportHandler

        if config.get("beside"):  # a CheckpointHandler of the user's, which the Ray handler reports
            folder = Path(config["out"]) / "checkpoints"
            handlers.append(
                CheckpointHandler(folder, batch_period=config.get("batch_period"), resume_from_checkpoint=True)
            )
            saver = RayTrainReportHandler()
        else:
            saver = RayTrainReportHandler(batch_period=config.get("batch_period"))
        handlers.append(saver)
        marker = Path(config["out"]) / "killed"
        if config.get("kill_at") is not None and rank() == 1 and not marker.exists():

            def die(state):
                if state.global_step == config["kill_at"]:
                    # Ray's controller takes in a report at its next poll of the workers (every
                    # RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): wait past a few, so the last report counts.
                    time.sleep(3)
                    marker.touch()
                    os.kill(os.getpid(), signal.SIGKILL)  # as a lost node or the OOM killer would

            handlers.append(LambdaHandler(batch_end=die))
    group = dist.group.WORLD if dist.is_initialized() else None  # Ray's, made before the loop runs
    history = estimator.fit(train_loader, val_data=val_loader, epochs=config["epochs"], event_handlers=handlers)
    if rank() == 0:
        result = {
            "world": world_size(),
            "same_group": dist.group.WORLD is group,
            "resumed_from": None if saver is None or saver.resumed_from is None else saver.resumed_from.name,
            "params": {name: value.tolist() for name, value in net.state_dict().items()},
            "history": {key: history[key] for key in history if key.startswith(("train_loss", "val_loss"))},
        }
        (Path(config["out"]) / "result.json").write_text(json.dumps(result))
    return {}


def main() -> None:
    out, config = Path(sys.argv[1]), json.loads(sys.argv[2])
    config["out"] = str(out)
    out.mkdir(parents=True, exist_ok=True)
    if not config.get("workers"):
        train(config)
        return
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        trainer = TorchTrainer(
            train,
            train_loop_config=config,
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=config["workers"], use_gpu=False),
            run_config=RunConfig(
                name="fitforge",
                storage_path=str(out / "ray"),
                failure_config=FailureConfig(max_failures=1),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),
        )
        result = trainer.fit()
        reported = {
            "metrics": {k: v for k, v in result.metrics.items() if isinstance(v, (int, float))},
            "checkpoint": sorted(os.listdir(result.checkpoint.path)) if result.checkpoint else None,
            "error": None if result.error is None else repr(result.error),
        }
        (out / "reported.json").write_text(json.dumps(reported))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

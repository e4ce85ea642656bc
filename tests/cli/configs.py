"""The config of the CLI tests' tiny run (tiny_run.py), written as YAML where a test needs it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

BASE: dict[str, Any] = {
    "seed": 0,
    "model": {"class_path": "tiny_run.TinyNet", "init_args": {"hidden": 8}},
    "data": {"function": "tiny_run.line_data", "args": {"n": 64}},
    "estimator": {
        "loss": "torch.nn.MSELoss",
        "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}},
        "train_metrics": ["mse"],
        "device": "cpu",
    },
    "fit": {"epochs": 3},
    "handlers": [
        {"class_path": "fitforge.handlers.CheckpointHandler", "init_args": {"model_dir": "ckpt"}},
        {"class_path": "fitforge.handlers.CSVLoggerHandler", "init_args": {"path": "log.csv"}},
    ],
}


def write_config(folder: Path, name: str = "cfg.yaml", **sections: Any) -> Path:
    """BASE with ``sections`` replacing its own, as a YAML file in ``folder``."""
    config = {**copy.deepcopy(BASE), **sections}
    path = folder / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path

"""The parser of ``fitforge fit|evaluate|predict``, typed from the signatures so that parsing checks every value."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace  # an optional extra, checked by fitforge.cli
from torch import nn

from fitforge.checkpoint.files import load_checkpoint
from fitforge.checks.options import OPTIMIZER_NAMES
from fitforge.core.events import EventHandler
from fitforge.estimator import Estimator
from fitforge.exceptions import ConfigError
from fitforge.metrics.base import SumCountMetric
from fitforge.metrics.resolve import NAMES

RUN_SECTIONS = ("seed", "model", "data", "estimator", "fit", "handlers")  # what a run's config holds and records
SPLITS = Literal["train", "val", "test", "predict"]

# Union members are tried in order: a module class_path before any callable (a class is callable
# too, and would be kept uninstantiated); a name first, as a Literal of the known ones, not a str:
# a str would take a misspelt class_path given on the command line as a name (failing only once
# the run is built), and serialize any value (a list of metrics as the text of a list).
_LOSS: Any = nn.Module | Callable
LOSSES: Any = _LOSS | list[_LOSS] | dict[str, _LOSS] | None
_OPTIMIZER_NAME: Any = Literal[OPTIMIZER_NAMES]
OPTIMIZER: Any = _OPTIMIZER_NAME | Callable[[Iterable], torch.optim.Optimizer] | None
# top<k>_accuracy for k up to 10 by name; TopKAccuracy by class_path for any k
_METRIC_NAME: Any = Literal[tuple(NAMES) + tuple(f"top{k}_accuracy" for k in range(1, 11))]


def _typed_here(torchmetrics: bool) -> dict[str, Any]:
    """The Estimator's arguments typed Any in its signature, typed here so that parsing checks them
    (torchmetrics metrics only when asked: an import of seconds)."""
    one: Any = _METRIC_NAME | SumCountMetric
    if torchmetrics:
        import torchmetrics as package

        one = one | package.Metric
    metrics = one | list[one] | dict[int | str, one | list[one]] | None
    return {"loss": LOSSES, "val_loss": LOSSES, "train_metrics": metrics, "val_metrics": metrics}


def command_parser(torchmetrics: bool = False) -> tuple[ArgumentParser, dict[str, ArgumentParser]]:
    """``fitforge`` with its commands, and each command's parser (of a whole run's config; ``diff``: of two runs)."""
    top = _new_parser(prog="fitforge", description="Train, evaluate and predict from a config (docs/cli.md).")
    commands = top.add_subcommands(dest="command", required=True)
    parsers = {name: _command_parser(name, torchmetrics) for name in ("fit", "evaluate", "predict")}
    helps = {
        "fit": "train the model",
        "evaluate": "the loss and metrics of a checkpoint",
        "predict": "write the predictions of a checkpoint to a file",
    }
    for name, parser in parsers.items():
        commands.add_subcommand(name, parser, help=helps[name])
    parsers["diff"] = _diff_parser()
    commands.add_subcommand("diff", parsers["diff"], help="what differs between two runs, and where they diverge")
    return top, parsers


def _diff_parser() -> ArgumentParser:
    parser = _new_parser(
        description="Compare two runs' manifest.json: their config, arguments, versions, seeds, hardware, commit and "
        "data order, and the first recorded step where they diverge (docs/reproducibility.md). Exit status: 0 when "
        "identical, 1 when they differ, 2 when a run has no manifest."
    )
    parser.add_argument(
        "run_a", type=str, help="a run's folder (where its checkpoints or logs are), its manifest.json, or a URL"
    )
    parser.add_argument("run_b", type=str, help="the other run")
    return parser


def _new_parser(**kwargs: Any) -> ArgumentParser:
    # Errors raise (fitforge.cli.suggest adds the nearest key); no abbreviated options (--fit.epoch
    # must not quietly mean --fit.epochs); our own --print_config, printed once the data's
    # arguments are resolved too (jsonargparse's prints before that).
    return ArgumentParser(exit_on_error=False, allow_abbrev=False, print_config=None, **kwargs)


def data_arguments(config: Namespace) -> ArgumentParser:
    """A parser of the data function's arguments, from its signature: checks ``data.args``."""
    parser = _new_parser()
    parser.add_function_arguments(config.data.function, as_group=False)
    return parser


def run_parser(description: str = "", torchmetrics: bool = False) -> ArgumentParser:
    """A parser of the run's sections, with ``--config`` and ``--print_config``."""
    parser = _new_parser(description=description)
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML or JSON config (several: later ones win)")
    parser.add_argument(
        "--print_config", action="store_true", help="print the resolved config and exit, having built nothing"
    )
    parser.add_argument("--seed", type=int | None, default=None, help="the generators' seed (None: draw one)")
    parser.add_subclass_arguments(nn.Module, "model", required=True, help="the model: class_path and init_args")
    parser.add_argument("--data.function", type=Callable, required=True, help="the import path of the data function")
    parser.add_argument("--data.args", type=dict[str, Any], default={}, help="the data function's arguments")
    typed_here = _typed_here(torchmetrics)
    parser.add_class_arguments(
        Estimator, "estimator", skip={"net", "val_net", "optimizer", *typed_here}, instantiate=False
    )
    for name, kind in typed_here.items():
        parser.add_argument(f"--estimator.{name}", type=kind, default=None, required=name == "loss")
    parser.add_argument(
        "--estimator.optimizer",
        type=OPTIMIZER,
        default=None,
        help="a name ('adam', 'sgd'...) or the class_path and init_args of a torch.optim class (without params)",
    )
    parser.add_method_arguments(Estimator, "fit", "fit", skip={"train_data", "val_data", "event_handlers"})
    parser.add_argument("--handlers", type=list[EventHandler], default=[], help="event handlers: class_path, init_args")
    return parser


def _command_parser(command: str, torchmetrics: bool) -> ArgumentParser:
    """The parser of ``fitforge <command>``: a run's sections and the command's own options."""
    if command == "fit":
        parser = run_parser("Train the model of a config.", torchmetrics)
        parser.add_argument(
            "--from_checkpoint",
            action=RecordedConfig,
            help="resume the run recorded in this checkpoint, from its config (options after this one override it)",
        )
        return parser
    evaluate = command == "evaluate"
    parser = run_parser(
        "Evaluate a checkpoint of the config's model on one of its data's splits."
        if evaluate
        else "Predict with a checkpoint of the config's model, to a file.",
        torchmetrics,
    )
    parser.add_argument(
        "--checkpoint",
        type=str,
        required=True,
        help=f"the checkpoint whose weights {'to evaluate' if evaluate else 'predict'}",
    )
    parser.add_argument("--split", type=SPLITS, default="val", help=f"the data to {command}: <split>_data")
    if evaluate:
        parser.add_argument("--output", type=str | None, default=None, help="also write the metrics to this JSON file")
    else:
        parser.add_argument("--output", type=str, required=True, help="the file the predictions go to (torch.save)")
    return parser


def recorded_config(path: str | os.PathLike) -> dict[str, Any]:
    """The resolved config recorded in a checkpoint of a run started from one (ConfigError if none)."""
    config = load_checkpoint(path).get("config")
    if not isinstance(config, dict):
        raise ConfigError(
            f"{path} holds no config: its run was not started from one (fitforge fit --config); "
            "pass the run's config with --config"
        )
    return config


class RecordedConfig(argparse.Action):
    """``--from_checkpoint PATH``: apply the config recorded in PATH where the option stands, as
    ``--config`` applies a file (options after it override it), and keep PATH."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        ActionConfigFile.apply_config(parser, namespace, "config", json.dumps(recorded_config(values)))
        namespace[self.dest] = values

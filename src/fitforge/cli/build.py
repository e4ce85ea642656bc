"""From a checked config to a run's objects: the seed, the data, the model, the estimator, the handlers."""

from __future__ import annotations

import difflib
import importlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from jsonargparse import ArgumentParser, Namespace

from fitforge.core.events import EventHandler, offered
from fitforge.core.roles import WeightAveraging
from fitforge.core.services import Services
from fitforge.estimator import Estimator
from fitforge.exceptions import ConfigError, describe

DATA_KEYS = ("train_data", "val_data", "test_data", "predict_data")


@dataclass
class Run:
    """A run's objects, built in a fixed order (seed, model, data): a config builds the same run."""

    estimator: Estimator
    data: dict[str, Any]
    handlers: list[EventHandler]


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's generators (every device's)."""
    random.seed(seed)
    torch.manual_seed(seed)
    numpy.random.seed(seed % 2**32)


def build(parser: ArgumentParser, data_parser: ArgumentParser, config: Namespace, handlers: bool = True) -> Run:
    """The run of a checked ``config``; ``handlers=False`` leaves fit's handlers out, for evaluate and predict."""
    seed_everything(config.seed)
    if not handlers:  # but an EMAHandler: evaluation runs with the average a checkpoint holds, as in fit
        config = config.clone()
        config.handlers = [handler for handler in config.handlers if _averages_weights(handler.class_path)]
    objects = parser.instantiate(config)
    arguments = dict(vars(objects.estimator))
    optimizer = arguments.pop("optimizer")
    net = objects.model
    if callable(optimizer):  # a torch.optim class given by class_path: jsonargparse leaves out params
        optimizer = optimizer(net.parameters())
    data_args = data_parser.instantiate(data_parser.parse_object(config.data.args))
    data = split_data(config.data.function(**vars(data_args)), config.data.function)
    estimator = Estimator(net, optimizer=optimizer, **arguments)
    if not handlers:
        for average in offered(objects.handlers, Services()).averages[:1]:  # as fit would choose it
            average.attach(estimator)  # load_checkpoint then loads the checkpoint's average into it
            estimator.weight_average = average
    return Run(estimator, data, list(objects.handlers) if handlers else [])


def _averages_weights(class_path: str) -> bool:
    """Whether the handler class at ``class_path`` (checked importable by the parser) averages weights."""
    module, _, name = class_path.rpartition(".")
    handler_class = getattr(importlib.import_module(module), name, None)
    return isinstance(handler_class, type) and issubclass(handler_class, WeightAveraging)


def split_data(returned: Any, function: Any) -> dict[str, Any]:
    """The data function's result as a dict of :data:`DATA_KEYS` (anything but a dict: ``train_data`` alone)."""
    if not isinstance(returned, Mapping):
        return {"train_data": returned}
    wrong = [key for key in returned if key not in DATA_KEYS]
    if wrong:
        nearest = difflib.get_close_matches(str(wrong[0]), DATA_KEYS, n=1)
        hint = f" (did you mean '{nearest[0]}'?)" if nearest else ""
        raise ConfigError(
            f"the data function {_name(function)} returned a dict with the key {wrong[0]!r}{hint}; its keys "
            f"must be among {', '.join(DATA_KEYS)}"
        )
    return dict(returned)


def data_of(run: Run, split: str, command: str, function: Any) -> Any:
    """``<split>_data`` of the run's data, or an error naming what the data function returned."""
    key = f"{split}_data"
    if key not in run.data:
        raise ConfigError(
            f"fitforge {command} reads {key} (--split {split}), but the data function {_name(function)} "
            f"returned {', '.join(run.data)} only; return a dict with {key!r}, or pick another --split"
        )
    return run.data[key]


def _name(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', describe(function))}"

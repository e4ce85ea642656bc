"""The hyperparameters of a run, as plain values, for the loggers (MLflow, TensorBoard, CSV)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from fitforge.checkpoint.resume import fit_data_order
from fitforge.core.history import History, numbered_key
from fitforge.core.state import TrainState
from fitforge.distributed.ranks import world_size
from fitforge.exceptions import FitforgeTypeError, describe
from fitforge.reporting.summary import model_name, parameter_counts

ParamValue = str | int | float | bool
_OPTIMIZER_SETTINGS = ("weight_decay", "momentum")  # besides lr and betas; kept to the common ones


def run_params(state: TrainState) -> dict[str, ParamValue]:
    """The run's hyperparameters as plain values, from ``state`` at ``train_begin`` (the keys are tabled in
    docs/handlers.md); an unknown value is left out, never None."""
    estimator = state.estimator
    total, trainable = parameter_counts(estimator.net)
    params: dict[str, Any] = {
        "model": model_name(estimator.net),
        "parameters": total,
        "trainable_parameters": trainable,
        "loss": _loss_name(estimator.loss),
    }
    for i, optimizer in enumerate(estimator.optimizers):
        params.update(_optimizer_params(optimizer, i))
    params["batch_size"] = _batch_size(state)
    params["epochs"], params["batches"] = state.run.max_epochs, state.run.max_batches
    params["precision"] = estimator.precision or "32-true"
    params["device"] = str(estimator.device)
    params["strategy"] = estimator.strategy.name
    params["world_size"] = world_size()
    params.update(config_params(estimator.run_config))
    return {key: value for key, value in params.items() if value is not None}


def config_params(config: Mapping[str, Any] | None, prefix: str = "config") -> dict[str, ParamValue]:
    """A nested config as flat parameters: ``{"model": {"init_args": {"hidden": 8}}}`` gives
    ``{"config.model.init_args.hidden": 8}``; flat keys, as every logger takes them and MLflow filters by
    each. A null or empty value is kept in its JSON spelling, so every key the config sets is recorded."""
    if config is None:
        return {}
    flat: dict[str, ParamValue] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for name, item in value.items():
                walk(f"{key}.{name}", item)
        elif isinstance(value, (list, tuple)) and value:
            for index, item in enumerate(value):
                walk(f"{key}.{index}", item)
        elif isinstance(value, (str, int, float, bool)):
            flat[key] = value
        else:
            flat[key] = json.dumps(value, default=str)

    walk(prefix, config)
    return flat


def _loss_name(loss: Any) -> str | None:
    if loss is None:
        return None  # the model computes its own loss
    if isinstance(loss, (list, tuple)):
        return ",".join(str(_loss_name(each)) for each in loss)
    return getattr(loss, "__name__", None) if not isinstance(loss, torch.nn.Module) else type(loss).__name__


def _optimizer_params(optimizer: torch.optim.Optimizer, index: int) -> dict[str, ParamValue]:
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    params: dict[str, ParamValue] = {numbered_key("optimizer", index): type(optimizer).__name__}
    settings = [(name, group.get(name)) for name in ("lr", *_OPTIMIZER_SETTINGS)]
    betas = group.get("betas")
    if isinstance(betas, (tuple, list)) and len(betas) == 2:
        settings += zip(("beta1", "beta2"), betas)
    for name, setting in settings:
        value = _number(setting)
        if value is not None:
            params[numbered_key(name, index)] = value
    return params


def _number(value: Any) -> float | None:
    """A plain float of an optimizer setting (a float, an int or a one-element tensor), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)  # once per fit, at train_begin
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _batch_size(state: TrainState) -> int | None:
    order = fit_data_order(state)
    loader = None if order is None else order.data
    if not isinstance(loader, torch.utils.data.DataLoader):
        return None
    if loader.batch_size is not None:
        return loader.batch_size
    size = getattr(loader.batch_sampler, "batch_size", None)  # a BatchSampler given as batch_sampler
    return size if isinstance(size, int) else None


def check_params(owner: str, params: Any, argument: str = "params") -> dict[str, ParamValue]:
    """User parameters (the argument ``argument``): None, or a mapping of str keys to str, int, float or bool
    values."""
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise FitforgeTypeError(
            f"{owner}: {argument} must be a dict of str to str/int/float/bool, got {describe(params)}"
        )
    for key, value in params.items():
        if not isinstance(key, str) or not isinstance(value, (str, int, float, bool)):
            raise FitforgeTypeError(
                f"{owner}: {argument} must map str keys to str, int, float or bool values, got "
                f"{describe(key)}: {describe(value)}"
            )
    return dict(params)


def last_values(history: History) -> dict[str, float]:
    """The latest finite value of every history key; keys with none are left out."""
    finite = {key: [value for value in history[key] if math.isfinite(value)] for key in history}
    return {key: values[-1] for key, values in finite.items() if values}

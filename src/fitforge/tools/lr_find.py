"""The learning-rate range test (Leslie Smith, 2015; fastai's ``lr_find``): the loss falls fastest
somewhat below the rate at which training blows up, a good maximum learning rate. The test changes
nothing: everything it touches is put back exactly afterwards, also when it fails midway.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fitforge.core.history import finish_figure
from fitforge.core.processor import bound_step
from fitforge.core.rng import restore_rng_states, rng_states
from fitforge.core.state import EstimatorLike, RunControl, TrainState
from fitforge.distributed.data_split import shard_train
from fitforge.distributed.ranks import mean_over_ranks
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_number, describe
from fitforge.handlers.gradient_update import step_optimizers
from fitforge.inputs.arrays import fit_loaders
from fitforge.inputs.sources import check_data
from fitforge.optim.learning_rate import write_rate
from fitforge.optim.optimizer_choice import OptimizerChoice
from fitforge.optim.schedule_free import to_train_mode

log = logging.getLogger("fitforge")


@dataclass
class LRFindResult:
    """What :func:`lr_find` found.

    Attributes:
        lrs: the learning rate of each step taken.
        losses: the smoothed (bias-corrected exponential moving average) loss at each step.
        raw_losses: each step's batch loss.
        suggestion: the learning rate of the smoothed loss's steepest fall against log(lr) (up to
            the lowest loss); ``min_loss_lr / 10`` when it never falls; None without a step.
        min_loss_lr: the learning rate of the lowest smoothed loss.
        diverged: whether the sweep stopped early because the loss blew up.
    """

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    raw_losses: list[float] = field(default_factory=list)
    suggestion: float | None = None
    min_loss_lr: float | None = None
    diverged: bool = False

    def plot(self, path: str | Path | None = None):
        """The matplotlib Figure of the smoothed loss against the learning rate, saved as a PNG to ``path``."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise ImportError("LRFindResult.plot() needs matplotlib: pip install 'fitforge[plot]'") from err
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        ax.plot(self.lrs, self.raw_losses, color="0.8", linewidth=0.8, label="batch loss")
        ax.plot(self.lrs, self.losses, label="smoothed loss")
        if self.suggestion is not None:
            ax.axvline(self.suggestion, color="tab:red", linestyle="--", label=f"suggestion {self.suggestion:.2g}")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        limits = self.loss_range()
        if limits is not None:
            ax.set_ylim(*limits)
        ax.legend()
        return finish_figure(fig, path)

    def loss_range(self) -> tuple[float, float] | None:
        """The plot's loss axis, so that a diverging sweep's far higher losses do not squash the curve."""
        finite = [loss for loss in self.losses if math.isfinite(loss)]
        if not finite:
            return None
        low, first = min(finite), finite[0]
        span = first - low if first > low else max(abs(low), 1e-8)
        return low - 0.1 * span, max(first, low) + 0.5 * span

    def __repr__(self) -> str:
        if not self.lrs:
            return "LRFindResult(steps=0)"
        suggestion = "None" if self.suggestion is None else f"{self.suggestion:.3g}"
        lowest = "None" if self.min_loss_lr is None else f"{self.min_loss_lr:.3g}"
        return (
            f"LRFindResult(steps={len(self.lrs)}, lrs={self.lrs[0]:.3g}..{self.lrs[-1]:.3g}, "
            f"suggestion={suggestion}, min_loss_lr={lowest}, diverged={self.diverged})"
        )


def lr_find(
    estimator: EstimatorLike,
    train_data: Iterable,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_steps: int = 100,
    smoothing: float = 0.05,
    diverge_factor: float = 4.0,
    batch_size: int | None = None,
) -> LRFindResult:
    """Sweep the learning rate exponentially over ``num_steps`` training batches; an :class:`LRFindResult`.

    Each step runs the batch processor's ``fit_batch`` and steps the optimizers (no clipping or
    accumulation); the sweep stops when the smoothed loss exceeds ``diverge_factor`` times the lowest
    so far, or a loss is not finite. Everything is restored afterwards.

    Args:
        estimator: the :class:`~fitforge.Estimator` to test.
        train_data: a re-iterable of training batches (a DataLoader, a list...), or arrays ``(X, y)``.
        start_lr, end_lr: the first and last learning rates (``0 < start_lr < end_lr``).
        num_steps: the number of batches of the sweep (>= 2).
        smoothing: the weight of each new loss in the moving average, in (0, 1] (1: no smoothing).
        diverge_factor: the blow-up that stops the sweep (> 1; ``math.inf`` never stops).
        batch_size: the batch size of arrays (default 32), as in ``fit``.
    """
    _check_arguments(estimator, start_lr, end_lr, num_steps, smoothing, diverge_factor)
    train_data, _ = fit_loaders(train_data, None, batch_size, None)  # arrays (X, y), as fit takes them
    if estimator.splits_data:
        train_data = shard_train(train_data)
    check_data(train_data, "train_data", None)
    saved = _snapshot(estimator)
    to_train_mode(estimator.optimizers)  # a schedule-free optimizer is built evaluating; put back after
    batches = _cycle(train_data)
    try:
        result = _sweep(estimator, batches, start_lr, end_lr, num_steps, smoothing, diverge_factor)
    finally:
        batches.close()  # ends a DataLoader's worker processes now
        _restore(estimator, saved)
    result.suggestion, result.min_loss_lr = _suggest(result.lrs, result.losses)
    log.info(
        "lr_find: %d step(s) from %.3g to %.3g%s; suggested learning rate %s",
        len(result.lrs),
        start_lr,
        result.lrs[-1] if result.lrs else start_lr,
        " (the loss diverged)" if result.diverged else "",
        "none" if result.suggestion is None else f"{result.suggestion:.3g}",
    )
    return result


def _check_arguments(
    estimator: EstimatorLike, start_lr: Any, end_lr: Any, num_steps: Any, smoothing: Any, diverge_factor: Any
) -> None:
    try:
        estimator.net, estimator.optimizers, estimator.batch_processor  # noqa: B018 (what an Estimator has)
    except AttributeError:
        raise FitforgeTypeError(f"lr_find: estimator must be a fitforge Estimator, got {describe(estimator)}") from None
    numbers = {"start_lr": start_lr, "end_lr": end_lr, "smoothing": smoothing, "diverge_factor": diverge_factor}
    for name, value in numbers.items():
        check_number("lr_find", name, value)
    if not 0 < start_lr < end_lr or math.isinf(end_lr):
        raise FitforgeValueError(
            f"lr_find: the learning rates must satisfy 0 < start_lr < end_lr < inf, got "
            f"start_lr={start_lr!r}, end_lr={end_lr!r}"
        )
    if isinstance(num_steps, bool) or not isinstance(num_steps, int):
        raise FitforgeTypeError(f"lr_find: num_steps must be an int >= 2, got {describe(num_steps)}")
    if num_steps < 2:
        raise FitforgeValueError(f"lr_find: num_steps must be an int >= 2, got {num_steps!r}")
    if not 0 < smoothing <= 1:
        raise FitforgeValueError(
            f"lr_find: smoothing must be in (0, 1] (the weight of each new loss), got {smoothing!r}"
        )
    if not diverge_factor > 1:
        raise FitforgeValueError(f"lr_find: diverge_factor must be > 1 (math.inf never stops), got {diverge_factor!r}")


def _cycle(data: Iterable) -> Generator[Any, None, None]:
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        if empty:
            raise FitforgeValueError(
                "lr_find: train_data yielded no batch; pass a non-empty re-iterable such as a DataLoader or a list"
            )


def _sweep(
    estimator: EstimatorLike,
    batches: Iterator[Any],
    start_lr: float,
    end_lr: float,
    num_steps: int,
    smoothing: float,
    diverge_factor: float,
) -> LRFindResult:
    result, optimizers, scaler = LRFindResult(), list(estimator.optimizers), estimator.scaler
    fit_batch = bound_step(estimator.batch_processor, estimator, "fit_batch")
    choice = OptimizerChoice(optimizers)
    state = TrainState(estimator, "train", run=RunControl(max_batches=num_steps))
    estimator.net.train()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    average, best, decay = 0.0, math.inf, 1.0 - smoothing
    for step in range(num_steps):
        lr = start_lr * (end_lr / start_lr) ** (step / (num_steps - 1))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                write_rate(group, lr)
        state.batch_idx, state.global_step = step, step
        state.batch = next(batches)
        state.output = fit_batch(state, state.batch)
        # The one host read per step; under torch.distributed the ranks' mean, so all decide alike.
        loss = mean_over_ranks(float(state.output.loss.detach()))  # type: ignore[union-attr]
        if not math.isfinite(loss):
            result.diverged = True
            break
        average = decay * average + smoothing * loss
        smoothed = average / (1.0 - decay ** (step + 1))  # bias-corrected: early values are not pulled to 0
        result.lrs.append(lr)
        result.raw_losses.append(loss)
        result.losses.append(smoothed)
        if best > 0 and smoothed > diverge_factor * best:
            result.diverged = True
            break
        best = min(best, smoothed)
        stepped = optimizers
        if state.output.step is not None:  # a step that chose its optimizers (a GAN's turns): only those
            chosen = choice.resolve(state.output.step, state)
            stepped = [optimizers[i] for i in chosen]
            choice.discard([i for i in choice.every if i not in chosen], chosen)
        step_optimizers(stepped, scaler)
    return result


def _suggest(lrs: list[float], losses: list[float]) -> tuple[float | None, float | None]:
    """``(steepest-descent lr, lowest-loss lr)``; the first is ``lowest / 10`` when the loss never falls."""
    if not losses:
        return None, None
    lowest = min(range(len(losses)), key=losses.__getitem__)
    x = [math.log(lr) for lr in lrs[: lowest + 1]]
    y = losses[: lowest + 1]
    if len(y) < 3:
        return lrs[lowest] / 10, lrs[lowest]
    # central differences inside, one-sided at the two ends (equal spacing in log(lr))
    slopes = [
        (y[min(i + 1, len(y) - 1)] - y[max(i - 1, 0)]) / (x[min(i + 1, len(x) - 1)] - x[max(i - 1, 0)])
        for i in range(len(y))
    ]
    steepest = min(range(len(slopes)), key=slopes.__getitem__)
    return (lrs[steepest] if slopes[steepest] < 0 else lrs[lowest] / 10), lrs[lowest]


def _snapshot(estimator: EstimatorLike) -> dict[str, Any]:
    net = estimator.net
    return {
        "weights": {k: v.detach().clone() for k, v in net.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in _parameters(estimator)],
        "optimizers": [copy.deepcopy(optimizer.state_dict()) for optimizer in estimator.optimizers],
        "scaler": None if estimator.scaler is None else copy.deepcopy(estimator.scaler.state_dict()),
        "modes": [(module, module.training) for module in net.modules()],
        "rng": rng_states(),
    }


def _restore(estimator: EstimatorLike, saved: dict[str, Any]) -> None:
    estimator.net.load_state_dict(saved["weights"])
    for parameter, grad in zip(_parameters(estimator), saved["grads"]):
        parameter.grad = grad
    for optimizer, state in zip(estimator.optimizers, saved["optimizers"]):
        optimizer.load_state_dict(state)
    if saved["scaler"] is not None and estimator.scaler is not None:
        estimator.scaler.load_state_dict(saved["scaler"])
    for module, training in saved["modes"]:
        module.training = training
    restore_rng_states(saved["rng"])


def _parameters(estimator: EstimatorLike) -> list[torch.nn.Parameter]:
    """The net's parameters and any other ones the optimizers step, each once."""
    stepped = (p for optimizer in estimator.optimizers for group in optimizer.param_groups for p in group["params"])
    return list({id(p): p for p in (*estimator.net.parameters(), *stepped)}.values())

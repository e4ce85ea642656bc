"""Which optimizers a batch steps: ``BatchOutput.step`` resolved to indices, and the parameters of each choice."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe


class OptimizerChoice:
    """The estimator's optimizers, their parameters, and what ``BatchOutput.step`` may name.
    ``shared``: some parameter is held by several optimizers (else gradients are discarded with
    plain ``zero_grad``)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.every = tuple(range(len(self.optimizers)))
        self._index = {id(o): i for i, o in enumerate(self.optimizers)}
        self.params = [list({id(p): p for g in o.param_groups for p in g["params"]}.values()) for o in self.optimizers]
        owners = [id(p) for params in self.params for p in params]
        self.shared = len(owners) != len(set(owners))
        self._union: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def resolve(self, choice: object, state: TrainState) -> Sequence[int]:
        """The indices ``choice`` names, sorted and without repeats; a clear error for anything else."""
        if not isinstance(choice, (list, tuple)):
            hint = f"; write step=[{choice!r}]" if isinstance(choice, int) and not isinstance(choice, bool) else ""
            raise FitforgeTypeError(
                f"{_where(state)} must be a list or tuple of indices into estimator.optimizers or of "
                f"optimizers (or None for every optimizer), got {describe(choice)}{hint}"
            )
        if not choice:
            raise FitforgeValueError(
                f"{_where(state)} is empty: name at least one optimizer (step=[0]), or step=None for every "
                "optimizer; to train nothing on a batch, raise fitforge.exceptions.CancelBatch in fit_batch"
            )
        indices = [self._index_of(item, state) for item in choice]
        return indices if len(indices) == 1 else sorted(set(indices))

    def _index_of(self, item: object, state: TrainState) -> int:
        count = len(self.optimizers)
        if isinstance(item, int) and not isinstance(item, bool):
            if not 0 <= item < count:
                raise FitforgeValueError(
                    f"{_where(state)} names optimizer {item}, but the estimator has {count} optimizer(s): "
                    f"use an index from 0 to {count - 1} into estimator.optimizers, or the optimizer itself"
                )
            return item
        index = self._index.get(id(item))
        if index is not None:
            return index
        if isinstance(item, torch.optim.Optimizer):
            raise FitforgeValueError(
                f"{_where(state)} holds {describe(item)}, which is not one of the estimator's {count} "
                "optimizer(s): give it to the Estimator (optimizer=[opt_d, opt_g]) and name it by its index "
                "or as one of estimator.optimizers"
            )
        raise FitforgeTypeError(
            f"{_where(state)} holds {describe(item)}; name optimizers by their index into "
            "estimator.optimizers (an int) or by the optimizer itself, e.g. step=[0] or step=[opt_g]"
        )

    def params_of(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """The parameters of the optimizers ``indices``, each once (clipping must not count one twice)."""
        key = tuple(indices)
        union = self._union.get(key)
        if union is None:
            union = self._union[key] = list({id(p): p for i in key for p in self.params[i]}.values())
        return union

    def discard(self, idle: Iterable[int], live: Sequence[int]) -> None:
        """Drop the gradients of the ``idle`` optimizers' parameters but those a ``live`` optimizer also holds."""
        if not self.shared:
            for i in idle:
                self.optimizers[i].zero_grad(set_to_none=True)
            return
        kept = {id(p) for p in self.params_of(live)}
        for i in idle:
            for p in self.params[i]:
                if id(p) not in kept:
                    p.grad = None


def _where(state: TrainState) -> str:
    return f"BatchOutput.step of batch {state.batch_idx} (epoch {state.epoch})"

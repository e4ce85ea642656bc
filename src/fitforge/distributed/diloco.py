"""DiLoCo (Douillard et al., 2023): data-parallel training for slow links. Each rank trains alone for
``sync_every`` optimizer steps, then an outer optimizer steps the last synced ("anchor") weights with
``anchor - mean(local)`` and every rank restarts from it (docs/extending.md#the-proof-diloco-in-one-class).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fitforge.core.coordinator import Alone, Coordinator
from fitforge.core.events import BatchEnd, EpochBegin, EpochEnd, EventHandler, Stage, TrainBegin, TrainEnd
from fitforge.core.state import EstimatorLike, TrainState
from fitforge.distributed.ranks import flat_collective, gather_to_main, rank, world_size
from fitforge.distributed.stop_agreement import StopAgreement
from fitforge.distributed.strategy import Distributed
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class DiLoCoStrategy(Distributed):
    """Local SGD with an outer optimizer every ``sync_every`` optimizer steps (module docstring).

    Between two syncs the ranks' weights differ (a checkpoint holds every rank's); every fit starts from
    rank 0's weights, and one that ends mid-round (not by an error or a preemption) closes the round.

    Args:
        sync_every: optimizer steps of each rank between two outer steps (the paper's H, e.g. 500).
        outer_lr: the outer SGD's learning rate.
        outer_momentum: the outer SGD's momentum, in [0, 1).
        nesterov: whether the outer SGD uses Nesterov momentum (needs ``outer_momentum > 0``).
        outer_optimizer: a callable making the outer optimizer from the anchor tensors, e.g.
            ``lambda params: torch.optim.SGD(params, lr=0.5)``; the three arguments above are then unused.
    """

    name = "diloco"
    required = False  # without a launcher: one process, the outer step applied to itself

    def __init__(
        self,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_optimizer: OuterFactory | None = None,
    ) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int):
            raise FitforgeTypeError(f"sync_every must be a positive int (optimizer steps), got {describe(sync_every)}")
        if sync_every < 1:
            raise FitforgeValueError(f"sync_every must be a positive int (optimizer steps), got {sync_every}")
        for arg, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise FitforgeTypeError(f"{arg} must be a float, got {describe(value)}")
        if not 0 < outer_lr < math.inf:
            raise FitforgeValueError(f"outer_lr must be a positive finite float, got {outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise FitforgeValueError(f"outer_momentum must be a float in [0, 1), got {outer_momentum!r}")
        if not isinstance(nesterov, bool):
            raise FitforgeTypeError(f"nesterov must be True or False, got {describe(nesterov)}")
        if nesterov and outer_momentum == 0 and outer_optimizer is None:
            raise FitforgeValueError("nesterov=True needs outer_momentum > 0, got outer_momentum=0")
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise FitforgeTypeError(
                f"outer_optimizer must be a callable taking the anchor tensors and returning a torch "
                f"optimizer, got {describe(outer_optimizer)}"
            )
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, outer_lr, outer_momentum
        self.nesterov, self.outer_factory = nesterov, outer_optimizer

    def wrap(self, net: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device) -> nn.Module:
        if self._wrapper is not None:
            raise FitforgeValueError(
                "strategy=DiLoCoStrategy trains the net itself, without gradient averaging: give the Estimator "
                "the module, not a DistributedDataParallel"
            )
        self.launch(device)  # the process group under a launcher; nothing in one process
        return net

    def fit_handlers(self) -> list[EventHandler]:
        return [DiLoCoHandler(self)]  # one per fit: each fit starts from rank 0's weights

    def coordinator(self, estimator: EstimatorLike) -> Coordinator:
        return Alone() if world_size() == 1 else StopAgreement(check_replicas=False)  # replicas differ mid-round

    def gradient_sync(self, estimator: EstimatorLike) -> None:
        return None  # no backward is a collective

    def averages_gradients(self, estimator: EstimatorLike) -> bool:
        return False

    def outer_optimizer(self, anchor: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer that steps the anchor with the averaged deltas."""
        if self.outer_factory is None:
            return torch.optim.SGD(anchor, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.nesterov)
        outer = self.outer_factory(anchor)
        if not isinstance(outer, torch.optim.Optimizer):
            raise FitforgeTypeError(f"outer_optimizer must return a torch optimizer, got {describe(outer)}")
        return outer

    def __repr__(self) -> str:
        return (
            f"DiLoCoStrategy(sync_every={self.sync_every}, outer_lr={self.outer_lr}, "
            f"outer_momentum={self.outer_momentum}, nesterov={self.nesterov}, outer_optimizer={self.outer_factory!r})"
        )


class DiLoCoHandler(TrainBegin, EpochBegin, BatchEnd, EpochEnd, TrainEnd):
    """The outer loop of one fit: counts optimizer steps and runs the outer step every ``sync_every``."""

    priority = Stage.STEP  # after the optimizer step (it reads optimizer_steps), before an EMA or a checkpoint
    reads = ("estimator", "optimizer_steps", "run")
    writes = ()

    def __init__(self, strategy: DiLoCoStrategy) -> None:
        self.strategy = strategy
        self.estimator: EstimatorLike | None = None  # set at train_begin, with the tensors below
        self.names: list[str] = []  # the parameters that train, and their anchor (the last synced values)
        self.params: list[nn.Parameter] = []
        self.anchor: list[torch.Tensor] = []
        self.steps = self.seen = 0  # optimizer steps in this round; state.optimizer_steps last seen

    def train_begin(self, state: TrainState) -> None:
        self.estimator = estimator = state.estimator
        if world_size() > 1:  # every rank starts from rank 0's weights and buffers, as DDP does
            flat_collective(list(estimator.net.state_dict().values()), partial(dist.broadcast, src=0))
        named = [(name, p) for name, p in estimator.net.named_parameters() if p.requires_grad]
        self.names, self.params = [name for name, _ in named], [p for _, p in named]
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer = self.strategy.outer_optimizer(self.anchor)
        self.steps, self.seen = 0, state.optimizer_steps
        self.started = self.restored = False  # the round starts at the first epoch, after a resume

    def epoch_begin(self, state: TrainState) -> None:
        if self.started:
            return
        self.started = True
        if not self.restored:  # resumed from a checkpoint without a round of its own (or none): one starts here
            with torch.no_grad():
                for anchor, param in zip(self.anchor, self.params):
                    anchor.copy_(param)
            self.seen = state.optimizer_steps

    def batch_end(self, state: TrainState) -> None:
        self.steps += state.optimizer_steps - self.seen
        self.seen = state.optimizer_steps
        if self.steps >= self.strategy.sync_every:
            self.outer_step()

    def epoch_end(self, state: TrainState) -> None:
        self.batch_end(state)  # an accumulation group's trailing step is taken at epoch end

    def train_end(self, state: TrainState) -> None:
        # Close an open round so every rank ends on one model; not after an error (a rank may be gone)
        # nor on a preemption, whose checkpoint holds the open round for the resumed run to finish.
        if self.steps and state.run.error is None and state.run.preempted is None:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the deltas from the anchor over the ranks, step the anchor, restart every rank from it."""
        deltas = [anchor - local for anchor, local in zip(self.anchor, self.params)]
        if world_size() > 1:
            flat_collective(deltas, dist.all_reduce)  # a sum, one flat all_reduce per dtype
        for anchor, delta in zip(self.anchor, deltas):
            anchor.grad = delta / world_size()
        self.outer.step()
        self.outer.zero_grad()
        for local, anchor in zip(self.params, self.anchor):
            local.copy_(anchor)
        self.steps = 0

    def state_dict(self) -> dict:
        """On every rank at once (it gathers): the round, anchor, outer state and every rank's own state."""
        if self.estimator is None:
            return {}
        own = {
            "weights": _cpu(self.estimator.net.state_dict()),
            "optimizers": [_cpu(optimizer.state_dict()) for optimizer in self.estimator.optimizers],
        }
        return {
            "steps": self.steps,
            "seen": self.seen,
            "world": world_size(),
            "anchor": dict(zip(self.names, _cpu(self.anchor))),
            "outer": _cpu(self.outer.state_dict()),
            "ranks": gather_to_main(own),  # None on ranks other than 0, which write nothing
        }

    def load_state_dict(self, state: dict) -> None:
        """After the checkpoint's (rank 0's) weights were loaded: this rank's own, the anchor and the outer state."""
        if not state or self.estimator is None:
            return
        world = world_size()
        if state["world"] != world and state["steps"]:
            raise FitforgeValueError(
                f"the checkpoint was written {state['steps']} optimizer step(s) into a DiLoCo round on "
                f"{state['world']} rank(s), whose weights differ until the round ends, and this fit runs on "
                f"{world}: resume on {state['world']} rank(s), or from a checkpoint written at a round's end "
                f"(after a multiple of sync_every={self.strategy.sync_every} optimizer steps)"
            )
        if list(state["anchor"]) != self.names:
            raise FitforgeValueError(
                f"the checkpoint's DiLoCo anchor holds the parameters {list(state['anchor'])}, and this fit trains "
                f"{self.names}: resume with the same parameters requiring grad"
            )
        with torch.no_grad():
            for anchor, name in zip(self.anchor, self.names):
                anchor.copy_(state["anchor"][name])
        self.outer.load_state_dict(state["outer"])
        self.steps, self.seen, self.restored = state["steps"], state["seen"], True
        if state["world"] == world:  # else a round's end: the weights are the anchor, inner states rank 0's
            own = state["ranks"][rank()]
            self.estimator.net.load_state_dict(own["weights"])
            for optimizer, saved in zip(self.estimator.optimizers, own["optimizers"]):
                optimizer.load_state_dict(saved)


def _cpu(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU (a checkpoint keeps a snapshot, not live tensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(item) for item in value)
    return value

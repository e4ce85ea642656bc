"""The engine of a fit: a :class:`Strategy` owns everything that differs between ways of training on
one or several processes, so the rest of fitforge asks it and never tests which engine runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fitforge.core.coordinator import Alone, Coordinator
from fitforge.core.events import EventHandler
from fitforge.core.run import inference
from fitforge.core.state import EstimatorLike, TrainState
from fitforge.distributed import fsdp
from fitforge.distributed.data_split import shard_train
from fitforge.distributed.ddp import adopt_wrapper, follow_trainable, wrap_ddp
from fitforge.distributed.fsdp import Where
from fitforge.distributed.gradient_sync import GradientSync, deferrable
from fitforge.distributed.process_group import init_process_group, quiet_other_ranks, release_at_exit, several_processes
from fitforge.distributed.ranks import initialized, launched, local_rank, rank, world_size
from fitforge.distributed.shard_writer import ShardWriter
from fitforge.distributed.stop_agreement import StopAgreement
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe


class Strategy:
    """One process, or ranks the script manages itself (``strategy="none"``): the net trains as it is
    and every rank reads all of its data. The base of every engine; its members: docs/extending.md.

    Attributes:
        name: the engine's name, as runs record it (``"none"``, ``"auto"``, ``"ddp"``, ``"fsdp"``...).
        places_net: whether the net stays on the estimator's device (checked at each fit).
    """

    name = "none"
    inference_mode = True
    collective_forward = False
    places_net = True
    sharded = False
    _wrapper: nn.Module | None = None  # a DistributedDataParallel the user made (see adopt)

    # -- set-up, in the Estimator's constructor ------------------------------------------------------
    def adopt(self, net: nn.Module) -> nn.Module:
        """The module the Estimator holds as ``net``: a DDP wrapper the user made is unwrapped (and kept)."""
        net, self._wrapper = adopt_wrapper(net)
        return net

    def device(self, device: Any) -> Any:
        """This rank's device, given the Estimator's ``device`` argument (None: picked later)."""
        return device

    def wrap(self, net: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device) -> nn.Module:
        """What ``fit``'s forward goes through (``estimator.train_net``); the optimizers have not stepped."""
        if initialized():  # a group the script made: fitforge's collectives run on its threads too
            release_at_exit(destroy=False)
        return net if self._wrapper is None else self._wrapper

    @property
    def splits_data(self) -> bool:
        """Whether fit, evaluate and predict split their data across the ranks."""
        return False

    # -- each fit -------------------------------------------------------------------------------------
    def train_data(self, data: Iterable) -> Iterable:
        """What a fit reads: this rank's share of ``data`` where :attr:`splits_data` (a Hugging Face stream
        is shared later, by the data order), else ``data`` itself."""
        return shard_train(data, streams=True) if self.splits_data else data

    def join(self, state: TrainState) -> None:
        """Once per fit, after every ``train_begin`` and a checkpoint's resume, before the first epoch."""

    def prepare_fit(self, estimator: EstimatorLike) -> None:
        """Before a fit's checks compare the net's parameters with the optimizers': :meth:`hold_shards`."""
        self.hold_shards(estimator.net)

    def follow_trainable(self, estimator: EstimatorLike) -> None:
        """Once per fit: make ``train_net`` train the parameters that require grad now."""
        estimator.train_net = follow_trainable(estimator.train_net, estimator.net, estimator.device)

    def fit_handlers(self) -> list[EventHandler]:
        """Handlers this engine adds to every fit, beside the user's (checkpointed as theirs are)."""
        return []

    def hold_shards(self, net: nn.Module) -> None:
        """Make ``net`` hold the parameters the optimizers step (a sharded engine may keep gathered ones)."""

    def coordinator(self, estimator: EstimatorLike) -> Coordinator:
        """What makes the ranks of one fit stop together (:mod:`fitforge.distributed.stop_agreement`)."""
        if world_size() == 1:
            return Alone()
        return StopAgreement(check_replicas=isinstance(estimator.train_net, DistributedDataParallel))

    def gradient_sync(self, estimator: EstimatorLike) -> GradientSync | None:
        """Under accumulation: the switch that lets only a group's last backward average the gradients."""
        return deferrable(estimator.train_net)

    def averages_gradients(self, estimator: EstimatorLike) -> bool:
        """Whether the backward averages the gradients over the ranks (through a DDP wrapper)."""
        return isinstance(estimator.train_net, DistributedDataParallel)

    def evaluating(self, net: nn.Module, average: Any = None) -> inference:
        """The block in which ``net`` evaluates (with ``average``'s weights, if any)."""
        return inference(net, self.inference_mode, average)

    # -- checkpoints ------------------------------------------------------------------------------------
    def model_state(self, estimator: EstimatorLike) -> dict[str, Any]:
        """The weights and optimizer states a checkpoint holds (with the fp16 GradScaler's)."""
        return {
            "model": estimator.net.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in estimator.optimizers],
            "optimizer_classes": [type(optimizer).__name__ for optimizer in estimator.optimizers],
            **({} if estimator.scaler is None else {"scaler": estimator.scaler.state_dict()}),
        }

    def load_weights(self, net: nn.Module, weights: dict[str, Any]) -> None:
        """Load a whole ``state_dict`` into ``net``."""
        net.load_state_dict(weights)

    def full_weights(self, net: nn.Module) -> dict[str, Any] | None:
        """``net``'s whole ``state_dict`` on rank 0, called on every rank (a sharded engine gathers it)."""
        return net.state_dict()

    def save_shards(self, estimator: EstimatorLike, folder: Where, grads: bool, storage_options: dict) -> None:
        """Every rank writes its shards into ``folder`` (a local path, or an fsspec URL): sharded engines."""
        raise NotImplementedError(f"{type(self).__name__} writes no shards")

    def shard_writer(self) -> Any:
        """A writer of shards in the background (made on every rank at once): sharded engines."""
        raise NotImplementedError(f"{type(self).__name__} writes no shards")

    def load_shards(
        self, estimator: EstimatorLike, folder: Where, optimizers: bool, grads: bool, storage_options: dict
    ) -> dict[str, torch.Tensor]:
        """Load the shards in ``folder`` (any engine can); the saved gradients by parameter name."""
        return fsdp.load_sharded(estimator, folder, optimizers, grads, storage_options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Distributed(Strategy):
    """The base of engines that take part in a launch (``torchrun``, SLURM, Ray). ``required``: an error
    when not launched with several processes (``False``: train in one process then)."""

    required = True

    def device(self, device: Any) -> Any:
        """Under a launcher, ``None`` or ``"cuda"`` becomes ``cuda:<LOCAL_RANK>`` (``None``: the CPU without CUDA)."""
        if not (launched() or several_processes()):
            return device
        if device is None:
            return f"cuda:{local_rank()}" if torch.cuda.is_available() else "cpu"
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda" and device.index is None):
            return f"cuda:{local_rank()}"
        if several_processes() and str(device).startswith("cuda:") and str(device) != f"cuda:{local_rank()}":
            warnings.warn(
                f"device={str(device)!r} under torchrun: every rank of this machine uses that one GPU; pass "
                f"device=None or 'cuda' for each rank's own (cuda:LOCAL_RANK)",
                UserWarning,
                stacklevel=3,
            )
        return device

    def launch(self, device: torch.device) -> bool:
        """Whether this run has several processes; the process group made when it has."""
        if initialized():
            release_at_exit(destroy=False)
        if not self.required and not several_processes():
            return False
        if not initialized() and not launched():
            raise FitforgeValueError(
                f"strategy={self.name!r} needs several processes started by a launcher: run the "
                "script with torchrun --nproc_per_node=N (see docs/distributed.md), or pass "
                "strategy='auto' to train in one process when not launched"
            )
        init_process_group(device)
        quiet_other_ranks()
        return True

    def wrap(self, net: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device) -> nn.Module:
        """Join the launch (:meth:`launch`), then train the net as it is."""
        self.launch(device)
        return super().wrap(net, optimizers, device)

    @property
    def splits_data(self) -> bool:
        return world_size() > 1


class DDPStrategy(Distributed):
    """Data-parallel training with ``DistributedDataParallel`` (``options`` go to it); ``required=False``
    is ``"auto"``: one process when the script was not launched with several."""

    def __init__(self, required: bool = True, **options: Any) -> None:
        self.required, self.options = required, options
        self.name = "ddp" if required else "auto"

    def wrap(self, net: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device) -> nn.Module:
        if self._wrapper is not None:  # the user's own, trained through as it is
            return super().wrap(net, optimizers, device)
        if not self.launch(device) or world_size() == 1:
            return net
        return wrap_ddp(net, device, self.options)

    def __repr__(self) -> str:
        options = "".join(f", {key}={value!r}" for key, value in self.options.items())
        return f"DDPStrategy(required={self.required}{options})"


class FSDPStrategy(Distributed):
    """Sharded data-parallel training with FSDP2's ``fully_shard`` (:mod:`fitforge.distributed.fsdp`).
    ``shard``: the classes of the units to shard (else the root's children that hold parameters);
    other ``options`` go to ``fully_shard`` (e.g. ``reshard_after_forward=False``)."""

    name = "fsdp"
    collective_forward = True
    inference_mode = False  # FSDP keeps the parameters it gathers for the next forward: no inference tensors
    places_net = False  # it places (and may offload) the shards itself
    sharded = True

    def __init__(self, **options: Any) -> None:
        self.options = options

    def wrap(self, net: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device) -> nn.Module:
        if self._wrapper is not None:
            raise FitforgeValueError(
                "strategy='fsdp' shards the net itself: give the Estimator the module, not a DistributedDataParallel"
            )
        self.launch(device)
        return fsdp.shard(net, optimizers, device, self.options)

    def hold_shards(self, net: nn.Module) -> None:
        fsdp.hold_shards(net)

    def averages_gradients(self, estimator: EstimatorLike) -> bool:
        return True

    def model_state(self, estimator: EstimatorLike) -> dict[str, Any]:
        return {"grads": {}}  # weights, optimizer states and an open group's gradients: in the shards

    def full_weights(self, net: nn.Module) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Gathered one parameter at a time into rank 0's host memory (the others get nothing).
        whole = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return whole if rank() == 0 else None

    def load_weights(self, net: nn.Module, weights: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(net, weights, options=StateDictOptions(full_state_dict=True))  # each keeps its shard

    def save_shards(self, estimator: EstimatorLike, folder: Where, grads: bool, storage_options: dict) -> None:
        fsdp.save_sharded(estimator, folder, grads, storage_options)

    def shard_writer(self) -> ShardWriter:
        return ShardWriter()

    def __repr__(self) -> str:
        return f"FSDPStrategy({', '.join(f'{key}={value!r}' for key, value in self.options.items())})"


def resolve_strategy(strategy: Any, options: Any) -> Strategy:
    """The engine ``Estimator(strategy=..., strategy_options=...)`` asks for (None is ``"none"``)."""
    if options is not None and not isinstance(options, dict):
        raise FitforgeTypeError(
            f"strategy_options must be a dict of keyword arguments for {strategy}, got {describe(options)}"
        )
    if isinstance(strategy, Strategy):
        if options:
            raise FitforgeValueError(
                f"strategy_options are for a strategy given by name; {strategy!r} is an instance: give its "
                "options to its constructor"
            )
        return strategy
    options = options or {}
    if strategy in ("auto", "ddp"):
        return DDPStrategy(required=strategy == "ddp", **options)
    if strategy == "fsdp":
        return FSDPStrategy(**options)
    if strategy in ("none", None):
        return Strategy()
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        raise FitforgeTypeError(f"strategy must be an instance: pass strategy={strategy.__name__}(...), not the class")
    raise FitforgeValueError(
        "strategy must be one of 'auto', 'ddp', 'fsdp', 'none', None or a fitforge.distributed.Strategy instance "
        f"(e.g. DiLoCoStrategy(sync_every=...)), got {describe(strategy)}"
    )

"""Data parallelism that survives a lost replica group without a restart, on torchft
(docs/distributed.md#fault-tolerance).

Each replica group (one process: a ``torchrun --nproc_per_node=1`` job, or a plain one) joins a quorum
kept by torchft's lighthouse before every step. The step's global batch is split over the groups in the
quorum (:mod:`fitforge.fault_tolerance.batches`); each scales its gradients by its share, one
all-reduce sums them with every group's veto, and the optimizers step only when every group commits. A
group that fails (a SIGKILL, a lost link) leaves the quorum at the next step, whose batch the others
share; a group that starts (again) receives the live state (weights, optimizer states, counters,
handler states: what a checkpoint holds) from a peer, not from a file.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from fitforge.checkpoint.files import restore_weights
from fitforge.checkpoint.resume import resume, stateful_handlers, training_state
from fitforge.core.coordinator import Alone, Coordinator
from fitforge.core.events import EventHandler
from fitforge.core.roles import Monitoring, players
from fitforge.core.state import EstimatorLike, TrainState
from fitforge.distributed.process_group import local_store
from fitforge.distributed.ranks import world_size
from fitforge.distributed.strategy import Strategy
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.fault_tolerance.batches import QuorumBatches
from fitforge.fault_tolerance.commit import QuorumStepHandler

log = logging.getLogger("fitforge")


def _torchft() -> Any:
    # torchft's Rust side logs every quorum at INFO unless RUST_LOG says otherwise when it loads: set for
    # its import only, so that the processes this one starts keep the environment they had.
    unset = "RUST_LOG" not in os.environ
    if unset:
        os.environ["RUST_LOG"] = "warn"
    try:
        import torchft
        import torchft.checkpointing.pg_transport
        import torchft.coordination
    except ImportError as err:
        raise ImportError('FaultTolerantStrategy needs torchft: pip install "fitforge[ft]"') from err
    finally:
        if unset:
            del os.environ["RUST_LOG"]
    if not torch.cuda.is_available():  # said at every new quorum, of NCCL's recorder, which gloo has not
        logging.getLogger("torchft.manager").addFilter(_not_of_nccl)  # once: the same filter is added once
    warnings.filterwarnings("ignore", re.escape("`isinstance(treespec, LeafSpec)`"), FutureWarning, "torchft")
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, "torchft")  # its transport's
    return torchft


def _not_of_nccl(record: logging.LogRecord) -> bool:
    return "flight recorder" not in record.getMessage()


@contextmanager
def lighthouse(
    min_replicas: int = 2, port: int = 0, join_timeout_ms: int = 60_000, heartbeat_timeout_ms: int = 5_000
) -> Iterator[str]:
    """A torchft lighthouse on 127.0.0.1 for a run on one machine; yields its address (``http://127.0.0.1:P``)
    for ``FaultTolerantStrategy(lighthouse=...)`` or ``TORCHFT_LIGHTHOUSE``, and stops it on exit.

    Args:
        min_replicas: the fewest replica groups a step trains with (2 or more: one alone would train apart).
        port: its port (0: any free one).
        join_timeout_ms: how long a quorum waits for a live group that has not asked yet (a group starting).
        heartbeat_timeout_ms: how long after its last heartbeat a group counts as lost.
    """
    server = _torchft().coordination.LighthouseServer(
        bind=f"127.0.0.1:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    try:
        yield f"http://127.0.0.1:{urlparse(server.address()).port}"  # address() names the host, not 127.0.0.1
    finally:
        server.shutdown()


class NoQuorum(TimeoutError):
    """Not enough replica groups met at the lighthouse within ``quorum_timeout``."""


class FaultTolerantStrategy(Strategy):
    """Data parallelism over torchft's replica groups, which go on when one is lost (module docstring).

    Every group runs the same script, with its own ``replica_id``; the lighthouse (``torchft_lighthouse
    --min_replicas 2``, or :func:`lighthouse` on one machine) must run first.

    Args:
        lighthouse: the lighthouse's address (default: the ``TORCHFT_LIGHTHOUSE`` environment variable).
        replica_id: this group's name, distinct per group (default: ``REPLICA_GROUP_ID`` from the environment;
            an int ``i`` becomes ``"fitforge_000i"``, which sorts as the ints do).
        min_replicas: the fewest groups a step commits with.
        timeout: seconds a collective, a recovery or a commit may take.
        quorum_timeout: seconds to wait for a quorum (groups starting included).
        max_retries: failed commits in a row before the fit fails.
        seed: the seed of every epoch's order (default: drawn from torch's generator; the first quorum
            gives every group the primary group's).
        host: the address the other groups reach this one at (default: ``127.0.0.1`` for a lighthouse on
            this machine's loopback, else this machine's host name; a pod's IP on Kubernetes).
    """

    name = "ft"

    def __init__(
        self,
        lighthouse: str | None = None,
        replica_id: str | int | None = None,
        min_replicas: int = 2,
        timeout: float = 30.0,
        quorum_timeout: float = 60.0,
        max_retries: int = 10,
        seed: int | None = None,
        host: str | None = None,
    ) -> None:
        self.lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not self.lighthouse:
            raise FitforgeValueError(
                "FaultTolerantStrategy needs the lighthouse's address: pass lighthouse='http://host:29510' or set "
                "TORCHFT_LIGHTHOUSE (start one with: torchft_lighthouse --min_replicas 2; see docs/distributed.md)"
            )
        replica_id = os.environ.get("REPLICA_GROUP_ID") if replica_id is None else replica_id
        if replica_id in (None, "") or isinstance(replica_id, bool) or not isinstance(replica_id, (str, int)):
            raise FitforgeValueError(
                "FaultTolerantStrategy needs this replica group's id, distinct per group: pass replica_id=0, 1... "
                f"or set REPLICA_GROUP_ID, got {describe(replica_id)}"
            )
        self.replica_id = f"fitforge_{int(replica_id):04d}" if str(replica_id).isdigit() else str(replica_id)
        for arg, value, least in (("min_replicas", min_replicas, 1), ("max_retries", max_retries, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise FitforgeTypeError(f"{arg} must be an int >= {least}, got {describe(value)}")
        for arg, seconds in (("timeout", timeout), ("quorum_timeout", quorum_timeout)):
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
                raise FitforgeValueError(f"{arg} must be a positive number of seconds, got {describe(seconds)}")
        self.min_replicas, self.max_retries = min_replicas, max_retries
        self.timeout, self.quorum_timeout = timedelta(seconds=timeout), timedelta(seconds=quorum_timeout)
        self.seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
        local = urlparse(self.lighthouse).hostname in ("127.0.0.1", "localhost", "::1")
        self.host = host or ("127.0.0.1" if local else socket.gethostname())
        self.manager: Any = None  # torchft's Manager, made when the Estimator wraps the net
        self.state: TrainState | None = None  # the fit under way (what a peer that heals receives)
        self.batches: QuorumBatches | None = None
        self.fresh = False  # a quorum was started for the next step already (by join)
        self._received: dict[str, Any] | None = None  # the state a peer sent at the last quorum
        self._veto: str | None = None
        self.decided = False  # whether this step's commit was decided (a veto then comes too late)
        self._store: Any = None

    # -- set-up -----------------------------------------------------------------------------------------
    def wrap(self, net: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device) -> nn.Module:
        if self._wrapper is not None:
            raise FitforgeValueError(
                "FaultTolerantStrategy averages the gradients over the replica groups itself: give the Estimator "
                "the module, not a DistributedDataParallel"
            )
        if world_size() > 1:
            raise FitforgeValueError(
                f"FaultTolerantStrategy runs replica groups of one process each, and this group has {world_size()}: "
                "start each group with torchrun --nproc_per_node=1 (or plain python), one per replica_id"
            )
        if self.manager is None:
            self.manager = self._manager(device)
        return net

    def _manager(self, device: torch.device) -> Any:
        torchft = _torchft()
        self._store, port = local_store()
        # The groups' collectives: NCCL between GPUs (untested here: no GPU in CI), gloo between CPUs.
        kind = torchft.ProcessGroupNCCL if device.type == "cuda" else torchft.ProcessGroupGloo
        pg = kind(timeout=self.timeout)
        manager = torchft.Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self.min_replicas,
            use_async_quorum=False,  # a group that heals takes part in the step it healed at
            timeout=self.timeout,
            quorum_timeout=self.quorum_timeout,
            connect_timeout=self.quorum_timeout,
            rank=0,
            world_size=1,
            store_addr=self.host,  # the store listens on every interface; the others are told this address
            store_port=port,
            lighthouse_addr=self.lighthouse,
            replica_id=self.replica_id,
            hostname=self.host,  # what the others reach this group's manager at
            checkpoint_transport=torchft.checkpointing.pg_transport.PGTransport(pg, self.timeout, device),
            max_retries=self.max_retries,
        )
        manager.register_state_dict_fn("fitforge", self._receive, self._live_state)
        atexit.register(manager.shutdown, wait=False)
        return manager

    # -- the engine's answers ---------------------------------------------------------------------------
    def train_data(self, data: Iterable) -> Iterable:
        if getattr(data, "num_workers", 0):
            log.info("FaultTolerantStrategy: train_data's samples are read in this process, not in its workers")
        self.batches = QuorumBatches(data, self)  # type: ignore[arg-type]
        return self.batches

    def coordinator(self, estimator: EstimatorLike) -> Coordinator:
        return Alone()  # every group stops at the same committed step, with no collective a lost group would hang

    def gradient_sync(self, estimator: EstimatorLike) -> None:
        return None

    def averages_gradients(self, estimator: EstimatorLike) -> bool:
        return False  # the handler sums them, weighted by each group's share

    def fit_handlers(self) -> list[EventHandler]:
        return [QuorumStepHandler(self)]  # one per fit: its changes and counts are the fit's

    # -- the quorum -------------------------------------------------------------------------------------
    def committed_steps(self) -> int:
        """Steps committed by the quorum so far (the run's ``global_step``)."""
        return int(self.manager.current_step())

    def next_quorum(self) -> tuple[int, int]:
        """Join the next step's quorum (healing from a peer if this group is behind); ``(groups, rank)``."""
        self.decided = False
        if self.fresh:
            self.fresh = False
        else:
            started = time.perf_counter()
            self._start_quorum()
            if self._received is not None:
                self._heal(in_loop=True)
            if self.state is not None:  # the wait for the next batch was the quorum's, not the data's
                self.state.run.clock.within_data("quorum", time.perf_counter() - started)
        return int(self.manager.num_participants()), int(self.manager.participating_rank())

    def join(self, state: TrainState) -> None:
        """Before the first epoch: the first quorum, at this fit's step; a group behind its peers (a new one)
        continues from the state the quorum's primary sent, as from a checkpoint."""
        steps = state.services.steps
        if steps is not None and steps.accumulate > 1:
            raise FitforgeValueError(
                "FaultTolerantStrategy commits every batch as one step: GradientUpdateHandler(accumulate>1) is not "
                "supported with it; raise the DataLoader's batch_size instead (it is the global batch)"
            )
        followed = [m.monitor for m in players(_handlers(state), Monitoring) if (m.monitor or "").startswith("train_")]
        if followed:
            raise FitforgeValueError(
                f"FaultTolerantStrategy: a handler monitors {followed[0]!r}, which each replica group measures on "
                "its own share of the batches, so the groups would act apart (a learning rate cut on one group "
                "only): monitor a validation value (val_*), the same on every group"
            )
        self.state = state
        self.manager.load_state_dict({"step": state.global_step, "batches_committed": state.global_step})
        log.info("FaultTolerantStrategy: %s asks %s for a quorum of replica groups", self.replica_id, self.lighthouse)
        self._start_quorum()
        self.fresh = True
        if self._received is not None:
            self._heal(in_loop=False)

    def _start_quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except TimeoutError as err:
            raise NoQuorum(
                f"FaultTolerantStrategy: no quorum of min_replicas={self.min_replicas} replica groups formed within "
                f"quorum_timeout={self.quorum_timeout.total_seconds():g} s at step {self.committed_steps()}: "
                f"start the other groups, each with its own replica_id, and check that they reach the "
                f"lighthouse at {self.lighthouse} and that it runs with --min_replicas {self.min_replicas}"
            ) from err

    def _live_state(self) -> dict[str, Any]:
        """What a group that heals receives (on torchft's thread, while this group waits in its quorum)."""
        state = self.state
        assert state is not None, "a quorum runs only within a fit"
        return {**self.model_state(state.estimator), **training_state(state, state.epoch, state.global_step)}

    def _receive(self, received: dict[str, Any]) -> None:
        self._received = received

    def _heal(self, in_loop: bool) -> None:
        received, self._received = self._received, None
        state = self.state
        assert state is not None and received is not None
        if in_loop and received["epochs_completed"] != state.epoch:
            raise FitforgeValueError(
                f"this replica group fell behind its peers into another epoch (it is in epoch {state.epoch + 1}, "
                f"they in {received['epochs_completed'] + 1}): restart it, and it joins them at their step"
            )
        restore_weights(state.estimator, received)
        if in_loop or received["global_step"] == state.global_step:  # the loop goes on (at step 0: the primary's start)
            state.global_step, state.optimizer_steps = received["global_step"], received["optimizer_steps"]
            state.batch_idx = received["position"] - 1  # the epoch's position: the peers' committed steps in it
            handlers = received.get("handlers", {})
            for key, handler in _stateful(state).items():
                if key in handlers:
                    handler.load_state_dict(handlers[key])
        else:
            resume(state, received)
        log.info("FaultTolerantStrategy: %s joined its peers at step %d", self.replica_id, received["global_step"])

    def veto_step(self, reason: str) -> None:
        """Make this step fail its commit on every group (none steps; the step is read again after a new
        quorum), e.g. from a handler that finds this group's gradients unusable: at ``backward_end``, or at
        ``batch_end`` with a priority below ``Stage.STEP - 1``, where the step's commit is decided."""
        if self.decided:
            raise FitforgeValueError(
                f"veto_step({reason!r}): this step's commit was decided already (at batch_end, priority "
                "Stage.STEP - 1): veto at backward_end, or at batch_end with a priority below Stage.STEP - 1 "
                "(e.g. Stage.GUARD)"
            )
        self._veto = reason

    def __repr__(self) -> str:
        return (
            f"FaultTolerantStrategy(lighthouse={self.lighthouse!r}, replica_id={self.replica_id!r}, "
            f"min_replicas={self.min_replicas}, host={self.host!r})"
        )


def _handlers(state: TrainState) -> Sequence[object]:
    return state._loop.handlers if state._loop else ()


def _stateful(state: TrainState) -> dict[str, EventHandler]:
    return stateful_handlers(_handlers(state))

"""What handlers see: :class:`TrainState`, the per-batch :class:`BatchOutput`, and the protocols
naming what the core needs of the Estimator and its batch processor (the Estimator itself is
assembled above every layer, so the core names it by what it offers, not by import)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fitforge.core.clock import RunClock
from fitforge.core.history import History
from fitforge.core.processes import ONE_PROCESS, Processes
from fitforge.core.services import Services, checked_value, dropped


class StepProcessor(Protocol):
    """What the loop calls per batch (:class:`~fitforge.BatchProcessor` is the implementation)."""

    allow_nonfinite: bool  # nan and inf accepted in the first batch's data
    logs: tuple[str, ...]  # the names its steps give state.log
    record_loss: bool  # False: its steps' loss is left out of train_loss/val_loss
    label_keys: tuple[str, ...]  # the keys of a dict batch's label

    def fit_batch(self, state: TrainState, batch: Any) -> BatchOutput: ...
    def evaluate_batch(self, state: TrainState, batch: Any) -> BatchOutput: ...
    def predict_batch(self, state: TrainState, batch: Any) -> Any: ...


class RunMachinery(Protocol):
    """What ``state._loop`` offers of the fit's :class:`~fitforge.core.run.RunContext`."""

    @property
    def data(self) -> object:
        """The training data, epoch by epoch: a fitforge.inputs.order.DataOrder in fit."""
        ...

    resume_from: dict[str, Any] | None  # the checkpoint fit resumes from (fitforge.checkpoint.resume)

    @property
    def handlers(self) -> Sequence[object]:
        """The run's handlers in dispatch order, for fitforge's checkpoints (a handler reads ``state.services``)."""
        ...


class EstimatorLike(Protocol):
    """What the layers below the Estimator use of it (``state.estimator``)."""

    net: torch.nn.Module
    val_net: torch.nn.Module
    train_net: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    device: torch.device
    scaler: torch.amp.GradScaler | None
    autocast_dtype: torch.dtype | None
    non_blocking: bool
    channels_last: bool
    strategy: Any  # a fitforge.distributed.Strategy (a layer above the core): the engine
    loss: Any  # the loss(es) as the user gave them: a module, a callable, a list or a dict by output name
    losses: Any  # resolved, a fitforge.losses.loss.Losses (a layer above the core): .train, .validate, .of(phase)
    train_metrics: list[Any]  # MetricSlot objects (fitforge.metrics, a layer above the core)
    val_metrics: list[Any]
    batch_processor: StepProcessor
    weight_average: Any  # the fit's WeightAveraging handler (EMA), whose weights evaluation uses; or None
    run_config: dict[str, Any] | None  # the resolved config of a run started from one (fitforge.cli)
    history: History  # every epoch of every fit
    precision: str | None  # as given: None (float32), "bf16-mixed", "16-mixed"

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def splits_data(self) -> bool: ...
    def compute_loss(self, pred: Any, label: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]: ...
    def compute_val_loss(self, pred: Any, label: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]: ...
    def evaluate(self, val_data: Iterable, event_handlers: Sequence[Any] | None = None) -> dict[str, float]: ...


@dataclass(slots=True)
class BatchOutput:
    """The result of one batch, produced by the :class:`~fitforge.BatchProcessor`.

    Attributes:
        data: the model inputs on the device: a tuple of tensors (passed to the net positionally),
            or the keyword inputs of a dict batch (passed as ``net(**data)``).
        label: the label on the device: a tensor, or a tuple with one tensor per loss (a dict by
            output name for named outputs).
        pred: the net's output: a tensor, or a tuple for multi-output nets (a dict for named outputs).
        loss: the total (weighted) loss, a scalar tensor still on the device; None in predict.
        losses: each loss's unweighted value, in loss order.
        batch_size: number of samples, used to weight loss and metric means.
        step: which optimizers :class:`~fitforge.handlers.GradientUpdateHandler` steps for this
            batch (indices into ``estimator.optimizers`` and/or optimizers of that list); None steps
            every optimizer. A GAN's turns: docs/custom-steps.md. Only fit reads it.
        items: how many items the batch's mean loss averages over (a 0-d tensor on the device), when
            the step backpropagated ``loss * items`` so that accumulated batches weigh by their items
            (see :mod:`fitforge.optim.item_counts`); None otherwise.

    In ``predict`` only ``pred`` and ``batch_size`` are set (``data=()``, ``label=None``, no loss).
    """

    data: tuple | dict
    label: Any
    pred: Any
    loss: torch.Tensor | None
    losses: tuple = ()
    batch_size: int = 0
    step: Sequence[int | torch.optim.Optimizer] | None = None
    items: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Ending:
    """How a stop ends ``fit`` when the run's outcome is not a plain finish (:meth:`RunControl.stop`):
    the closing log line opens with ``word`` (``"Pruned"``) and ``fit`` raises ``error`` once training
    stopped cleanly (docs/handlers.md, "Stopping and cancelling")."""

    word: str
    error: BaseException


@dataclass(slots=True, eq=False)
class RunControl:
    """``state.run``: the run's limits and processes, where it resumed, and how it stops and ends.
    Handlers read it and change it through :meth:`stop` alone (declared access: ``writes = ("run",)``).

    Attributes:
        max_epochs: the ``epochs`` given to fit (None if ``batches`` was given).
        max_batches: the ``batches`` given to fit (None if ``epochs`` was given).
        epochs_before: the epochs this estimator trained in earlier fits (``estimator.history``),
            so that logs number epochs across fits: ``epochs_before + epoch + 1``. 0 in a fit
            that resumes from a checkpoint, whose own history continues that run's count.
        resumed: whether this fit continues from a checkpoint (set after ``train_begin``, before
            the first ``epoch_begin``).
        resumed_at: where it continued, ``(epochs completed, global_step)`` of the checkpoint;
            None when it did not resume.
        epoch_finished: at ``epoch_end``, whether the run is through with the epoch: it went
            through all its data, or a ``CancelEpoch`` ended it (the next epoch follows); False when
            a stop (``batches=N``, a signal, a handler) cut it short before its last batch.
        preempted: the signal number (SIGTERM, SIGUSR1 or SIGINT) that asked fit to stop, else None.
            Under torch.distributed every rank sets it at the same point (a batch end, or the end of
            a validation it abandoned), whichever rank got the signal.
        error: at ``train_end``, the exception that is ending fit (a handler's, the step's, a
            second signal's ``KeyboardInterrupt``), else None; it is raised again after ``train_end``.
            A ``train_end`` hook that fails once training is over sets it for the hooks after it.
        training_over: the epochs are over and ``train_end`` runs for a run no exception ended.
        stop_requested, stop_reason, stop_every_rank, stop_ending: set by :meth:`stop` (its arguments).
        ranks: the processes of the run, for a decision every rank must share
            (:mod:`fitforge.core.processes`): ``state.run.ranks.main``, ``state.run.ranks.any(flag)``... In
            one process every answer is this process's own. A collective must be reached by every
            rank at the same point: in training every rank is at the same batch; an evaluate or
            predict pass's shares may differ in length, so ask only at its epoch ends there.
        clock: the fit's seconds by cause (:class:`~fitforge.core.clock.RunClock`): a handler times a cause
            of its own with ``with state.run.clock.timing("validation"): ...``.
    """

    max_epochs: int | None = None
    max_batches: int | None = None
    epochs_before: int = 0
    resumed: bool = False
    resumed_at: tuple[int, int] | None = None
    epoch_finished: bool = False
    preempted: int | None = None
    error: BaseException | None = None
    training_over: bool = False
    stop_requested: bool = False
    stop_reason: str | None = None
    stop_every_rank: bool = False
    stop_ending: Ending | None = None
    ranks: Processes = ONE_PROCESS
    clock: RunClock = field(default_factory=RunClock, repr=False)
    _state: Callable[[], Any] | None = field(default=None, repr=False)  # its TrainState's (weak) reference

    def stop(self, reason: str = "stop requested", every_rank: bool = False, ending: Ending | None = None) -> None:
        """Stop after the current batch's handlers: ``epoch_end`` runs for the partial epoch, then
        ``train_end``. The first reason given is kept (and stored in ``history.stop_reason``); the
        first ``ending`` given is kept, its reason replacing a plain stop's (docs/handlers.md).

        ``every_rank=True``: every rank requests this stop at this same batch, so the ranks agree on
        it at once; a rank that does not request it leaves the collectives unpaired (a hang). A stop
        with an ``ending`` should be requested so on every rank: the agreement carries that a stop
        was requested, not its ending (docs/distributed.md)."""
        self.stop_every_rank = self.stop_every_rank or every_rank
        if ending is not None and self.stop_ending is None:
            self.stop_ending = ending
            self._reason(reason)
        if not self.stop_requested:
            self.stop_requested = True
            self._reason(reason)

    def _reason(self, reason: str) -> None:
        self.stop_reason = reason
        state = None if self._state is None else self._state()
        if state is not None:  # its history keeps the reason (also a History put in later)
            state.history.stop_reason = reason

    @property
    def epoch_suspended(self) -> bool:
        """At ``epoch_end``, whether a signal came before the epoch was through: in its batches (its last
        one included), or in an ``epoch_end`` hook whose validation it abandoned. A resumed run will end
        it, so handlers that judge whole epochs (validation, early stopping, logs of epochs) leave it to
        that run."""
        return self.preempted is not None and not self.epoch_finished


# A weak reference from its run back to the state: no cycle, so a finished run's state, outputs and
# tensors are freed at once, not by the garbage collector (Python 3.10 keeps a strong one).
_WEAK_SLOT = {"weakref_slot": True} if sys.version_info >= (3, 11) else {}


@dataclass(slots=True, eq=False, **_WEAK_SLOT)
class TrainState:
    """The one object every hook receives. Which field holds what at which event, and how the
    counters count (0-based; ``global_step``: training batches completed before the current one):
    docs/handlers.md, "What a handler sees". In ``evaluate`` and ``predict`` the state is the pass's own.
    ``prefix``: the keys' first word, None for the phase's own (``evaluate(data, prefix="test")``: ``test_loss``).
    """

    estimator: EstimatorLike
    phase: str = "train"
    prefix: str | None = None
    epoch: int = 0
    batch_idx: int = -1
    global_step: int = 0
    optimizer_steps: int = 0
    accumulated_batches: int = 0
    num_batches: int | None = None
    batch: Any = None
    output: BatchOutput | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    history: History = field(default_factory=History)
    shared: dict[str, Any] = field(default_factory=dict)
    services: Services = field(default_factory=Services)
    run: RunControl = field(default_factory=RunControl)
    _loop: RunMachinery | None = None  # the fit's machinery, for fitforge's own checkpointing; None elsewhere

    def __post_init__(self) -> None:
        self.run._state = weakref.ref(self) if _WEAK_SLOT else lambda: self

    @property
    def restored_epoch(self) -> int | None:
        """``history.restored_epoch``: the 1-based epoch of this fit whose weights a handler put back
        (EarlyStoppingHandler's ``restore_best``). A field of its own for declared access: restoring
        weights records no value, so it orders its writer after no writer of ``history``."""
        return self.history.restored_epoch

    @restored_epoch.setter
    def restored_epoch(self, epoch: int | None) -> None:
        self.history.restored_epoch = epoch

    def running_metrics(self) -> dict[str, float]:
        """The epoch-so-far values of the loss and metrics, as a new dict of floats.

        This reads device values to the host; call it at epoch end or at a throttled interval."""
        values: dict[str, float] = {}
        for compute in self.services.running_values:
            values.update(compute())
        return values

    def log(self, name: str, value: torch.Tensor | float) -> None:
        """Log a named value (a tensor with one element, kept on its device, or a real number), e.g.
        ``state.log("g_loss", g_loss)`` in a GAN's ``fit_batch``: the MetricHandler averages it over the
        epoch into ``train_<name>``/``val_<name>`` (docs/custom-steps.md, "Logging values by name")."""
        entry = (name, checked_value(name, value))
        pending = self.services.logged
        # Kept until a MetricHandler takes them: in evaluate one always runs (before its first
        # epoch_begin, e.g. on the validation batch checked before training, they wait for it).
        if not pending.collected and self.phase != "validate":
            if not pending.dropping:  # a fit (it has a run) without MetricHandler warns, once
                dropped(pending, name, warn=self._loop is not None)
            return
        pending.append(entry)

"""What several handlers share, owned by the run: :class:`Services`, ``state.services`` in a fit.

A handler never looks for another handler: before any ``train_begin``, fit fills in what it knows
itself (the history keys, a validation between batches), then calls ``offer(services)`` on every
handler (:meth:`~fitforge.core.events.EventHandler.offer`), and the hooks read ``state.services``.

Among them the values a step or a handler logs with :meth:`TrainState.log <fitforge.TrainState.log>`, kept
in :class:`PendingValues` until the run's MetricHandler (a layer above) averages them per epoch.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

log = logging.getLogger("fitforge")


class PendingValues(list):
    """The ``(name, value)`` pairs logged and not yet taken by a MetricHandler.

    Attributes:
        collected: a MetricHandler takes the values (set at its first ``epoch_begin``); until then
            ``state.log`` drops them.
        dropping: the drop was reported (or needs no report): later values are dropped silently.
    """

    __slots__ = ("collected", "dropping")

    def __init__(self) -> None:
        super().__init__()
        self.collected = False
        self.dropping = False


def checked_value(name: Any, value: Any) -> torch.Tensor | float:
    """``value`` as ``state.log`` keeps it: a detached 0-d tensor (on its device: nothing is read
    to the host) or a float; a bad ``name`` or ``value`` raises naming the fix."""
    if not isinstance(name, str) or not name:
        raise FitforgeTypeError(
            f"state.log: name must be a non-empty str such as 'g_loss' (it becomes train_<name>/val_<name>), "
            f"got {describe(name)}"
        )
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise FitforgeValueError(
                f"state.log({name!r}, ...): value must be a tensor with one element, got one of shape "
                f"{tuple(value.shape)}; reduce it first, e.g. value.mean()"
            )
        if value.dtype == torch.bool or value.is_complex():
            kind = "a bool" if value.dtype == torch.bool else "a complex"
            raise FitforgeTypeError(
                f"state.log({name!r}, ...): value is {kind} tensor, which has no mean to log; "
                + ("log value.float() to average it as 0/1" if value.dtype == torch.bool else "log its .abs() or .real")
            )
        value = value.detach().reshape(())
        return value if value.is_floating_point() else value.to(torch.get_default_dtype())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = "log float(value) to average it as 0/1" if isinstance(value, bool) else "log a number or a tensor"
        raise FitforgeTypeError(
            f"state.log({name!r}, ...): value must be a real number or a tensor with one element, "
            f"got {describe(value)}; {hint}"
        )
    return float(value)


def dropped(pending: PendingValues, name: str, warn: bool) -> None:
    """Report once that logged values are dropped because no MetricHandler takes them."""
    pending.dropping = True
    if warn:
        log.warning(
            "state.log(%r, ...): no MetricHandler runs in this fit, so logged values are dropped; add "
            "fitforge.handlers.MetricHandler() to event_handlers (default_handlers=False leaves it out) "
            "to record them as train_<name>",
            name,
        )


class Accumulating:
    """Steps the optimizers every ``accumulate`` batches."""

    accumulate: int = 1
    count_items: Any = None  # an ItemCounter (fitforge.optim.item_counts) the default fit_batch weighs losses by

    def share_open_group(self, state: Any) -> None:
        """Make an open group's gradients equal on every rank before a checkpoint (a collective)."""

    def steps_per_optimizer(self, state: Any) -> list[int]:
        """The optimizer steps each optimizer took this run."""
        return [state.optimizer_steps] * len(state.estimator.optimizers)


class WeightAveraging:
    """Keeps averaged weights of ``estimator.net`` (an exponential moving average). fit makes the one
    offered to ``services.averages`` ``estimator.weight_average``; while its ``evaluates_averaged`` is
    True, ``evaluate``, ``predict``, the validation in fit and the best checkpoint run between
    :meth:`swap_in` and :meth:`swap_out` (no-ops until it holds an average)."""

    @property
    def evaluates_averaged(self) -> bool:
        """Whether evaluation runs with the averaged weights (the handler's switch)."""
        return True

    def swap_in(self) -> None:
        """Put the averaged weights into the net, keeping the trained ones aside."""

    def swap_out(self) -> None:
        """Put the trained weights back."""

    def averaged_net(self) -> Any:
        """The net whose weights it averages; None before it has one."""
        return None

    def averaged_state_dict(self) -> dict[str, Any]:
        """The net's ``state_dict`` with the averaged weights (copies), to save or load elsewhere."""
        net = self.averaged_net()
        if net is None:
            raise FitforgeValueError(f"{type(self).__name__}: no average yet: fit with this handler first")
        self.swap_in()
        try:
            return {key: value.detach().clone() for key, value in net.state_dict().items()}
        finally:
            self.swap_out()

    def sharded_averages(self) -> dict[str, Any]:
        """Under FSDP, the averages by parameter name, sharded as the parameters (DTensors), saved
        and loaded with the net's shards (:mod:`fitforge.distributed.fsdp`); else ``{}``."""
        return {}

    def load_averaged(self, weights: dict[str, Any]) -> None:
        """Copy ``weights`` (a ``state_dict`` of the net) into the average."""

    def attach(self, estimator: Any) -> None:
        """Track ``estimator.net`` outside fit, so that a checkpoint's average can be loaded into it."""


class Undoable(NamedTuple):
    """State that a handler undoing batches (``SpikeGuardHandler``) sets back with the weights:
    ``mark()`` copies it as it is now (on its device: no host read), ``rewind(mark)`` puts it back."""

    mark: Callable[[], Any]
    rewind: Callable[[Any], None]


@dataclass(frozen=True)
class SavedCheckpoints:
    """Where a checkpoint handler keeps its checkpoints and what it saved, for a handler
    that reports them elsewhere (Ray Train's). ``io``: its ``fitforge.checkpoint.CheckpointIO``;
    ``prefix``: the names' prefix; ``resumes``: it resumes from its newest at fit start;
    ``in_background``: it writes after returning; ``last``: the newest regular checkpoint this fit
    saved, on every rank (``saved``: rank 0's rotation list); ``best``, ``best_value``: the best one;
    ``checksums``: the checksum of each checkpoint this fit wrote, by name (rank 0's)."""

    io: Any
    root: Any
    prefix: str
    resumes: bool
    in_background: bool
    saved: list[Any]
    last: Any
    best: Any
    best_value: float | None
    resumed_from: Any
    checksums: dict[str, str] = field(default_factory=dict)


class CheckpointSaver(Protocol):
    """A handler saving the run's checkpoints (``CheckpointHandler``), as other handlers see it."""

    def saved_checkpoints(self) -> SavedCheckpoints | None:
        """Where it keeps checkpoints and what it saved (a ``SavedCheckpoints``), None if it does not say."""

    def best_checkpoint(self) -> Path | None:
        """The file of the best weights saved this fit, if any."""

    def best_weights(self) -> str | None:
        """``"saved"`` when it keeps the best weights by its monitor in a checkpoint of their own."""


class Services:
    """The services of one fit (an evaluation's: what its own handlers offer; none in ``predict``).

    Its services, who offers them and who reads them: docs/handlers.md ("Services: what handlers share").
    Those the table leaves out:

    Attributes:
        bars: the progress bars' epoch ends, which a handler printing an epoch's line calls first, so
            that the epoch's bar ends above the line (a second call does nothing).
        step_skips: the device flags (float 0-d, 1: skip) that fused optimizer steps skip on, as their
            offerers set them at their ``train_begin`` (NaNGuardHandler's, at ``Stage.GUARD``); the
            stepping reads them at its own, after.
        running_values: the epoch-so-far values' sources (MetricHandler's), which
            ``state.running_metrics()`` reads.
        logged: the named values ``state.log`` keeps until a MetricHandler takes them.
        run_folders: where the run's ``manifest.json`` goes: the folders (paths) or stores (a
            ``CheckpointIO`` with ``write_text``) of the handlers that keep the run's files.
        manifest_sections: called each time the manifest is written; each returns sections to put
            in it (``{"fingerprints": ...}``), as plain JSON values.
        after_save: called on every rank after a checkpoint saved mid-epoch (epoch ends and
            ``train_end`` are events of their own), with the state.
    """

    def __init__(
        self,
        history_keys: Callable[[], list[str]] = list,
        keys_complete: bool = True,
        validates_mid_epoch: bool = False,
    ) -> None:
        # Assigned here, not by a dataclass's fields: a run builds several, and factories cost more.
        self.history_keys = history_keys
        self.keys_complete = keys_complete
        self.validates_mid_epoch = validates_mid_epoch
        self.epoch_lines: list[Callable[[], bool]] = []
        self.bars: list[Callable[[Any], None]] = []
        self.guards_nonfinite = False
        self.undoables: list[Undoable] = []
        self.checkpoints: list[CheckpointSaver] = []
        self.steps: Accumulating | None = None
        self.averages: list[WeightAveraging] = []
        self.first_batch_checks: list[Callable[[Any], None]] = []
        self.before_save: list[Callable[[Any], None]] = []
        self.step_skips: list[Callable[[], Any]] = []
        self.running_values: list[Callable[[], dict[str, float]]] = []
        self.logged = PendingValues()
        self.run_folders: list[Any] = []
        self.manifest_sections: list[Callable[[], dict[str, Any]]] = []
        self.after_save: list[Callable[[Any], None]] = []

    def __repr__(self) -> str:
        return f"Services({', '.join(f'{name}={value!r}' for name, value in vars(self).items())})"

    def shows_epoch_lines(self) -> bool:
        """Whether a handler of the run prints each epoch's line now."""
        return any(shows() for shows in self.epoch_lines)

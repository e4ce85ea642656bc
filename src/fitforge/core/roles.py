"""Handler roles: what a handler is, declared by inheriting a small base, and asked by the framework.

fitforge never asks a handler's class or looks for an attribute by name: it asks for a role,
``role_of(handler, Validating)``, which finds it on the handler itself or on the handler a wrapper
holds (:class:`Wrapping`, e.g. ``throttle(...)``), so a wrapper keeps the roles of what it wraps
without forwarding anything. docs/handlers.md (Roles) tables what fitforge does with each role,
with an example of a validation of your own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from fitforge.core.events import EventHandler, Wrapping, unwrapped
from fitforge.core.services import Accumulating, WeightAveraging  # the types of two services, named here too

if TYPE_CHECKING:  # pragma: no cover
    from fitforge.core.state import EstimatorLike

R = TypeVar("R")
__all__ = [  # Wrapping and unwrapped live with the events (the dispatcher needs them); named here too
    "Accumulating",
    "KeyRecording",
    "Monitoring",
    "Stopping",
    "Validating",
    "ValidationSetup",
    "WeightAveraging",
    "Wrapping",
    "averaged_weights",
    "players",
    "plays",
    "role_of",
    "unwrapped",
]


def role_of(handler: object, role: type[R]) -> R | None:
    """The object playing ``role`` for ``handler``: the handler, or a handler it wraps; else None."""
    while True:
        if isinstance(handler, role):
            return handler
        if not isinstance(handler, Wrapping):
            return None
        handler = handler.handler


def players(handlers: Iterable[object], role: type[R]) -> list[R]:
    """The objects playing ``role`` among ``handlers``, in their order (see :func:`role_of`)."""
    found = []
    for handler in handlers:  # role_of inlined for the handlers that are no wrapper: most of them
        if isinstance(handler, role):
            found.append(handler)
        elif isinstance(handler, Wrapping) and (inner := role_of(handler.handler, role)) is not None:
            found.append(inner)
    return found


def plays(handlers: Iterable[object], role: type) -> bool:
    """Whether any of ``handlers`` plays ``role``."""
    return any(isinstance(h, role) or (isinstance(h, Wrapping) and role_of(h, role) is not None) for h in handlers)


class Monitoring:
    """Watches a history key, ``monitor`` (None: nothing this run), which fit checks the run produces.
    :meth:`best_weights` says whether it keeps the best weights by that key (``"saved"``: a best
    checkpoint) or puts them back (``"restored"``)."""

    monitor: str | None = None

    def best_weights(self) -> str | None:
        """``"saved"``, ``"restored"`` or None."""
        return None


class ValidationSetup(NamedTuple):
    """What a :class:`Validating` handler asks fit to check and set up before training: its
    ``val_data`` (re-iterable as often as it is read, not empty), and, ``by_estimator``, an
    evaluation of it by the estimator (loss and metrics, with ``event_handlers``), its first batch
    checked when ``check_first``. ``mid_epoch``: it also validates between training batches (its
    data is read more often than the epochs end). ``by_estimator=False``: it evaluates by its own
    means (an ``eval_fn``), so its keys are known only once it ran."""

    val_data: Iterable
    event_handlers: Sequence[EventHandler] = ()
    check_first: bool = True
    mid_epoch: bool = False
    by_estimator: bool = True


class Validating:
    """Evaluates held-out data during fit, recording ``val_*`` keys: monitors of them count as
    produced. :meth:`validation_setup` says what fit checks and sets up before training (None:
    nothing, its keys are checked at their first use); an evaluation by the estimator is handed to
    :meth:`use_evaluation`. Give it ``priority = Stage.METRICS + 1``, after the built-in validation,
    so that the handlers watching its keys run after it."""

    def validation_setup(self) -> ValidationSetup | None:
        return None

    def use_evaluation(self, evaluation: Any, checked: bool) -> None:
        """``evaluation()`` returns ``{"val_loss": ..., ...}``, one pass each call; ``checked``: its
        first batch was evaluated before training."""


class Stopping:
    """Ends training. :meth:`run_limits` (``(epochs, batches)``, None for no limit) fold into the
    fit's own, the first reached ending it; :meth:`ended_run` says that this handler had ended the
    run (restored from a checkpoint: the resumed fit is over at once)."""

    def run_limits(self) -> tuple[int | None, int | None]:
        return None, None

    def ended_run(self) -> bool:
        return False


class KeyRecording:
    """Records history keys known before training (``train_loss``, ``val_accuracy``...)."""

    def history_keys(self, estimator: EstimatorLike, phase: str) -> list[str]:
        """The keys it records in ``phase`` (``"train"`` or ``"validate"``)."""
        return []


class Accompanied:
    """Needs other handlers beside it in a fit: each of :meth:`companions` joins the fit unless the
    fit has a handler of its class already (as the default handlers do)."""

    def companions(self) -> list[EventHandler]:
        return []


@contextmanager
def averaged_weights(estimator: EstimatorLike) -> Iterator[WeightAveraging | None]:
    """The net holds the estimator's averaged weights (:class:`WeightAveraging`) in the block, when
    evaluation uses them; yields the averaging handler then, else None (the net as it is)."""
    average = estimator.weight_average
    if average is None or not average.evaluates_averaged:
        yield None
        return
    average.swap_in()
    try:
        yield average
    finally:
        average.swap_out()


ROLES = (Monitoring, Validating, Stopping, KeyRecording, Accompanied)  # the roles fit asks before training

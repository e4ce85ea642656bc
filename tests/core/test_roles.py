"""Handler roles: the framework asks what a handler is (fitforge.core.roles), never its class or
an attribute name, so a user's handler declaring a role takes part as the built-in one does."""

import ast
import importlib
import inspect
import pkgutil
import warnings
from pathlib import Path

import pytest

import fitforge
import fitforge.handlers
from fitforge.core.events import EventHandler
from fitforge.events import EpochEnd, KeyRecording, Monitoring, Stage, Stopping, TrainBegin, Validating, role_of
from fitforge.exceptions import FitforgeTypeError, HandlerOrderError, MonitorKeyError
from fitforge.handlers import CheckpointHandler, EarlyStoppingHandler, StoppingHandler, ValidationHandler
from fitforge.handlers.throttle import throttle
from fitforge.testing import linear_problem

SOURCE = Path(fitforge.__file__).parent


def _built_in_handlers() -> dict[str, type]:
    """Every handler class fitforge ships, by name."""
    classes = {}
    for info in pkgutil.iter_modules(fitforge.handlers.__path__):
        try:
            module = importlib.import_module(f"fitforge.handlers.{info.name}")
        except ImportError:  # an optional extra that is not installed
            continue
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, EventHandler) and value.__module__ == module.__name__:
                classes[name] = value
    return classes


HANDLERS = _built_in_handlers()


def _handler_attributes() -> set[str]:
    """The public names a built-in handler has: its class's attributes and methods (the base's and
    the roles' included) and what its methods assign to ``self``."""
    names: set[str] = set()
    for cls in HANDLERS.values():
        for klass in cls.__mro__:
            if klass.__module__.startswith("fitforge"):
                names |= {n for n in vars(klass) if not n.startswith("_")}
        for node in ast.walk(ast.parse(inspect.getsource(inspect.getmodule(cls)))):
            stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if stored and isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr[0] != "_":
                names.add(node.attr)
    return names


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in sorted(SOURCE.rglob("*.py"))]


def _names(node: ast.expr) -> list[str]:
    """The class names in isinstance's second argument: ``A``, ``(A, B)``, ``module.A``."""
    parts = node.elts if isinstance(node, ast.Tuple) else [node]
    return [p.id if isinstance(p, ast.Name) else p.attr for p in parts if isinstance(p, (ast.Name, ast.Attribute))]


def _calls(tree: ast.Module, *functions: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions
    ]


def test_no_module_asks_a_handler_s_concrete_class_outside_that_handler_s_own_module():
    found = []
    for path, tree in _modules():
        for call in _calls(tree, "isinstance", "issubclass", "acts_as"):
            for name in _names(call.args[1]) if len(call.args) == 2 else []:
                cls = HANDLERS.get(name)
                if cls is not None and Path(inspect.getfile(cls)) != path:
                    found.append(f"{path.relative_to(SOURCE)}:{call.lineno} asks isinstance(..., {name})")
    assert not found, "ask a role (fitforge.core.roles), not a handler's class:\n" + "\n".join(found)


def test_no_module_reads_a_handler_attribute_by_name():
    attributes = _handler_attributes()
    assert {"monitor", "save_best", "restore_best", "stopped_epoch", "check_first_batch"} <= attributes
    found = []
    for path, tree in _modules():
        for call in _calls(tree, "getattr", "hasattr"):
            name = call.args[1] if len(call.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in attributes:
                found.append(f"{path.relative_to(SOURCE)}:{call.lineno} reads {name.value!r} by name")
    assert not found, "declare and ask a role instead of reading an attribute by name:\n" + "\n".join(found)


def test_throttle_forwards_no_attribute_by_name():
    tree = ast.parse((SOURCE / "handlers" / "throttle.py").read_text())
    assert not _calls(tree, "getattr", "hasattr", "property")


def test_a_wrapper_plays_the_roles_of_what_it_wraps():
    stopper = EarlyStoppingHandler("train_loss", restore_best=True)
    wrapped = throttle(throttle(stopper, every_n_epochs=2), every_n_epochs=3)
    assert role_of(wrapped, Monitoring) is stopper and role_of(wrapped, Stopping) is stopper
    assert role_of(wrapped, Validating) is None and role_of(stopper, KeyRecording) is None
    assert (
        role_of(CheckpointHandler("unused", monitor="val_loss", save_best=True), Monitoring).best_weights() == "saved"
    )
    assert StoppingHandler(max_epochs=3).run_limits() == (3, None)


class ScoreValidation(TrainBegin, EpochEnd, Validating):
    """A user's own validation: it records val_score by its own means."""

    priority = Stage.METRICS + 1  # after the built-in validation, before the handlers that read this epoch's values

    def train_begin(self, state):
        self.scores = []

    def epoch_end(self, state):
        score = 1.0 / (1 + state.epoch)
        self.scores.append(score)
        state.metrics["val_score"] = score
        state.history.record("val_score", score)


def test_a_user_written_validating_handler_counts_for_val_monitors():
    estimator, data, _ = linear_problem()
    stopper = EarlyStoppingHandler("val_score", mode="max", patience=1)
    history = estimator.fit(data, epochs=5, event_handlers=[ScoreValidation(), stopper])
    assert history["val_score"] == [1.0, 0.5] and history.stop_reason.startswith("early stopping")
    # Without the role, the same handler is no validation: the monitor is refused before training.
    plain = type("PlainScore", (TrainBegin, EpochEnd), dict(vars(ScoreValidation)))
    with pytest.raises(MonitorKeyError, match="No validation runs in this fit"):
        estimator.fit(data, epochs=1, event_handlers=[plain(), EarlyStoppingHandler("val_score", mode="max")])


def test_a_throttled_validation_is_set_up_and_checked_before_training():
    estimator, data, _ = linear_problem()
    validation = ValidationHandler(data)
    history = estimator.fit(data, epochs=2, event_handlers=[throttle(validation, every_n_epochs=2)])
    assert validation.checked_first and len([v for v in history["val_loss"] if v == v]) == 1


def test_training_values_come_before_validation_values_whoever_gives_the_metric_handler():
    from fitforge.handlers import MetricHandler

    estimator, data, val = linear_problem()
    for handlers, defaults in (([MetricHandler()], True), ([MetricHandler()], False), ([], True)):
        history = estimator.fit(data, val_data=val, epochs=1, event_handlers=handlers, default_handlers=defaults)
        keys = list(history)
        assert keys.index("train_loss") < keys.index("val_loss"), keys


def test_a_handler_defining_a_role_s_name_without_the_role_is_warned_once():
    class Watches(EpochEnd):
        def __init__(self):
            self.monitor = "val_los"

        def epoch_end(self, state):
            pass

    estimator, data, _ = linear_problem()
    with pytest.warns(UserWarning, match=r"Watches defines 'monitor' but does not inherit the role Monitoring"):
        estimator.fit(data, epochs=1, event_handlers=[Watches()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        estimator.fit(data, epochs=1, event_handlers=[Watches()])  # once per class and name


def test_a_monitor_running_before_the_validation_of_its_key_is_refused_before_training():
    estimator, data, _ = linear_problem()
    late = type("LateScore", (ScoreValidation,), {"priority": 0})
    stopper = EarlyStoppingHandler("val_score", mode="max")
    with pytest.raises(
        HandlerOrderError, match=r"runs before it at epoch_end.*give LateScore priority=Stage.METRICS \+ 1"
    ):
        estimator.fit(data, epochs=1, event_handlers=[stopper, late()])
    estimator.fit(
        data, epochs=1, event_handlers=[late(), EarlyStoppingHandler("val_score", mode="max")]
    )  # listed first


def test_a_role_without_an_event_mixin_is_told_to_add_one():
    with pytest.raises(FitforgeTypeError, match=r"handles no event.*\(a role such as Monitoring is inherited beside"):
        linear_problem()[0].fit(
            linear_problem()[1], epochs=1, event_handlers=[type("M", (EventHandler, Monitoring), {})()]
        )


class OwnKeys(EpochEnd, KeyRecording):
    """A user's key recorder: the built-ins' run_after by role must not pull them after it."""

    def epoch_end(self, state):
        self.seen = dict(state.metrics)

    def history_keys(self, estimator, phase):
        return []


@pytest.mark.parametrize("priority", [Stage.USER, Stage.REPORT])
def test_a_key_recorder_of_yours_leaves_validation_at_its_stage(priority):
    estimator, data, val = linear_problem()
    mine = type("Mine", (OwnKeys,), {"priority": priority, "run_after": (ValidationHandler,)})()
    order = estimator.describe_loop([mine], val_data=val).splitlines()
    epoch_end = next(line for line in order if line.startswith("epoch_end"))
    assert epoch_end.index("ValidationHandler") < epoch_end.index("LoggingHandler")  # the line shows val_ values
    assert epoch_end.index("ValidationHandler") < epoch_end.index("Mine")
    estimator.fit(data, val_data=val, epochs=1, event_handlers=[mine])
    assert "val_loss" in mine.seen  # validation ran before it, at its own stage

"""The size of what a handler author learns (issue 47): stages, roles, the state's fields, core's modules."""

import dataclasses
from pathlib import Path

import fitforge
from fitforge.core.roles import ROLES
from fitforge.core.state import RunControl, TrainState
from fitforge.events import Stage


def test_six_stages_five_roles_and_sixteen_fields_a_handler_sees():
    assert [s.name for s in Stage] == ["GUARD", "STEP", "METRICS", "USER", "PERSIST", "REPORT"]
    assert len(ROLES) <= 5
    public = [f.name for f in dataclasses.fields(TrainState) if not f.name.startswith("_")]
    assert len(public) <= 16 and "run" in public
    assert "stop" in dir(RunControl) and not hasattr(TrainState, "request_stop")


def test_core_holds_at_most_fifteen_modules():
    core = Path(fitforge.__file__).parent / "core"
    assert len([p for p in core.glob("*.py") if p.name != "__init__.py"]) <= 15

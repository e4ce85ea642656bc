"""ProfilerHandler: a Chrome trace per cycle holding exactly its active steps, the profiler off (and the
handler idle but for one comparison) outside its cycles, the traces' folder, the ranks traced, and its
arguments checked when it is built."""

import json
import logging
import sys

import pytest
import torch

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, LambdaHandler, ProfilerHandler
from fitforge.testing import linear_problem


def fit(handlers, epochs=2, **kwargs):
    """linear_problem's fit: 8 batches per epoch."""
    estimator, train, _ = linear_problem()
    return estimator.fit(train, epochs=epochs, event_handlers=handlers, **kwargs)


def labelled(state):
    """A mark of the batch's global step in whatever trace records it."""
    with torch.profiler.record_function(f"batch{state.global_step}"):
        pass


def names(path, prefix):
    events = json.loads(path.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith(prefix)})


def steps(path):
    """The global steps a trace recorded: its ProfilerStep#N, checked against the batches' own marks."""
    numbers = sorted(int(name.split("#")[1]) for name in names(path, "ProfilerStep#"))
    assert names(path, "batch") == sorted(f"batch{n}" for n in numbers)
    return numbers


def test_a_trace_per_cycle_holding_exactly_its_active_steps(tmp_path):
    tracer = ProfilerHandler(wait=1, warmup=1, active=2, repeat=2, log_dir=tmp_path / "profile")
    fit([tracer, LambdaHandler(batch_begin=labelled)], check_access=True)
    # Steps 0-3: wait, warmup, active, active; steps 4-7 again; then nothing (16 batches).
    assert sorted((tmp_path / "profile").iterdir()) == tracer.traces and len(tracer.traces) == 2
    assert [steps(path) for path in tracer.traces] == [[2, 3], [6, 7]]
    assert all(path.name.startswith("rank0.") and path.name.endswith(".pt.trace.json") for path in tracer.traces)


def test_the_profiler_records_only_in_active_steps_and_is_off_between_cycles(tmp_path):
    recording = {}
    probe = LambdaHandler(
        batch_begin=lambda s: recording.__setitem__(s.global_step, torch.autograd._profiler_enabled())
    )
    fit([ProfilerHandler(wait=2, warmup=1, active=1, repeat=2, log_dir=tmp_path), probe])
    assert [step for step, on in recording.items() if on] == [3, 7]
    assert not torch.autograd._profiler_enabled()


def test_outside_its_cycles_batch_end_calls_nothing(tmp_path):
    """The cost outside the cycles is batch_end's one comparison: it calls nothing, Python or C."""
    acting = set()
    code = ProfilerHandler.batch_end.__code__

    def watch(frame, event, arg):
        if event == "call" and frame.f_back is not None and frame.f_back.f_code is code:
            acting.add(frame.f_back.f_locals["state"].global_step)
        elif event == "c_call" and frame.f_code is code:
            acting.add(frame.f_locals["state"].global_step)

    tracer = ProfilerHandler(wait=2, warmup=1, active=1, repeat=2, log_dir=tmp_path)
    estimator, train, _ = linear_problem()
    sys.setprofile(watch)
    try:
        estimator.fit(train, epochs=2, event_handlers=[tracer])
    finally:
        sys.setprofile(None)
    # Each cycle acts at the step before its warmup (start), its warmup step (step) and its last step (stop).
    assert acting == {1, 2, 3, 5, 6, 7}


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ({"wait": 0, "warmup": 0, "active": 1, "repeat": 3}, [[0], [1], [2]]),  # from the first batch, back to back
        ({"wait": 1, "warmup": 0, "active": 1, "repeat": 0}, [[1], [3], [5], [7]]),  # repeat=0: until the fit ends
        ({"wait": 5, "warmup": 1, "active": 3, "repeat": 1}, [[6, 7, 8]]),  # across the epochs' boundary
    ],
)
def test_schedules(tmp_path, schedule, expected):
    tracer = ProfilerHandler(**schedule, log_dir=tmp_path)
    fit([tracer, LambdaHandler(batch_begin=labelled)], epochs=1 if schedule["repeat"] == 0 else 2)
    assert [steps(path) for path in tracer.traces] == expected


def test_a_cycle_the_fit_ends_is_written_with_its_recorded_steps(tmp_path, caplog):
    tracer = ProfilerHandler(wait=0, warmup=1, active=5, log_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="fitforge"):
        fit([tracer, LambdaHandler(batch_begin=labelled)], epochs=None, batches=3)
    assert len(tracer.traces) == 1 and names(tracer.traces[0], "batch") == ["batch1", "batch2"]
    assert "ended inside a profiling cycle" in caplog.text
    assert not torch.autograd._profiler_enabled()


def test_a_fit_ended_in_warmup_writes_nothing_and_a_new_fit_starts_afresh(tmp_path):
    tracer = ProfilerHandler(wait=0, warmup=2, active=1, log_dir=tmp_path)
    fit([tracer], epochs=None, batches=1)
    assert tracer.traces == [] and not any(tmp_path.iterdir())
    fit([tracer, LambdaHandler(batch_begin=labelled)], epochs=1)
    assert [steps(path) for path in tracer.traces] == [[2]]


def test_a_second_profiler_in_the_process_is_not_started(tmp_path, caplog):
    first, second = (ProfilerHandler(wait=1, warmup=1, active=1, log_dir=tmp_path / n) for n in "ab")
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        fit([first, second], epochs=1)
    assert len(first.traces) == 1 and second.traces == []
    assert "another profiler is running in this process (ProfilerHandler(" in caplog.text
    caplog.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]), caplog.at_level(logging.WARNING):
        fit([second], epochs=1)  # the caller's own profiler
    assert second.traces == [] and "(torch.profiler), and torch runs one at a time" in caplog.text


def test_steps_count_from_a_resumed_fits_first_batch(tmp_path):
    fit([CheckpointHandler(tmp_path / "run" / "checkpoints")], epochs=1)
    tracer = ProfilerHandler(wait=1, warmup=0, active=1)
    saver = CheckpointHandler(tmp_path / "run" / "checkpoints", resume_from_checkpoint=True)
    fit([saver, tracer, LambdaHandler(batch_begin=labelled)], epochs=2)
    # The resumed fit starts at global step 8: its second batch is traced, under its own number.
    assert tracer.folder == tmp_path / "run" / "profile"  # beside the checkpoints
    assert [steps(path) for path in tracer.traces] == [[9]]


def test_the_default_folder_without_checkpoints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracer = ProfilerHandler(wait=0, warmup=0, active=1)
    fit([tracer], epochs=1)
    assert tracer.folder == tmp_path.joinpath("runs", "profile").relative_to(tmp_path)
    assert [path.parent for path in tracer.traces] == [tracer.folder]


def test_a_rank_not_chosen_traces_nothing(tmp_path):
    tracer = ProfilerHandler(wait=0, warmup=0, active=1, log_dir=tmp_path / "profile", ranks=[1, 2])
    fit([tracer], epochs=1)
    assert tracer.traces == [] and not (tmp_path / "profile").exists()


def test_it_runs_last_at_every_event():
    estimator, _, _ = linear_problem()
    lines = estimator.describe_loop([ProfilerHandler(), LambdaHandler(batch_end=print, priority=1000)]).splitlines()
    assert lines[4].startswith("batch_end") and lines[4].endswith("-> ProfilerHandler(1001)")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"wait": -1}, FitforgeValueError, r"ProfilerHandler: wait must be a non-negative int, got -1"),
        ({"warmup": 1.5}, FitforgeTypeError, r"warmup must be a non-negative int, got float 1.5"),
        ({"active": 0}, FitforgeValueError, r"active must be a positive int, got 0"),
        ({"repeat": True}, FitforgeTypeError, r"repeat must be a non-negative int, got bool True"),
        ({"log_dir": 3}, FitforgeTypeError, r"log_dir must be a folder path or None, got int 3"),
        ({"ranks": 0}, FitforgeTypeError, r"ranks must be the ranks to trace, e\.g\. \(0,\)"),
        ({"ranks": ["0"]}, FitforgeTypeError, r"ranks must hold ints"),
        ({"ranks": ()}, FitforgeValueError, r"ranks must hold one or more non-negative ints"),
        ({"ranks": (0, -1)}, FitforgeValueError, r"ranks must hold one or more non-negative ints"),
        ({"record_shapes": 1}, FitforgeTypeError, r"record_shapes must be True or False, got int 1"),
    ],
)
def test_bad_arguments_are_refused_when_it_is_built(kwargs, error, message):
    with pytest.raises(error, match=message):
        ProfilerHandler(**kwargs)

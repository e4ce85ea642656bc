"""The figures the fault-injection (reliability/) and torchrun (distributed/) suites measure,
printed at the end of the run by conftest.py. Each test records what it measured here."""

from __future__ import annotations

FIGURES: dict = {
    "injected": [],  # fault names injected (reliability suite)
    "survived": [],  # fault names whose run ended as the uninterrupted one
    "lost": {},  # kind -> {fault: steps lost}
    "torn": 0,  # files under a checkpoint name that did not load after a crash
    "poisoned": None,  # checkpoints written holding non-finite weights or optimizer state
    "finite_kept": None,  # after a run went non-finite, a finite checkpoint is still on disk
    "bad_inputs": {},  # bad-input case -> rejected before the first optimizer step
    "elastic": None,  # a torchrun elastic restart resumed exactly
    "save_latency": {},  # signal -> seconds from the signal to its checkpoint committed (reliability suite)
}


def summary_lines() -> list[str]:
    """The figures recorded in this run, one line each (none when neither suite ran)."""
    lines = []
    if FIGURES["injected"]:
        lines.append(f"faults survived: {len(FIGURES['survived'])}/{len(FIGURES['injected'])}")
        lines += [f"steps lost per kill ({name}): {steps}" for name, steps in FIGURES["lost"].items()]
        lines.append(
            f"torn checkpoints seen (files under a checkpoint name that do not load after a crash): {FIGURES['torn']}"
        )
    if FIGURES["save_latency"]:
        latencies = FIGURES["save_latency"]
        each = ", ".join(f"{name} {seconds:.2f}" for name, seconds in latencies.items())
        lines.append(
            f"checkpoint committed after a signal (s, at most 2): slowest {max(latencies.values()):.2f}; {each}"
        )
    if FIGURES["poisoned"] is not None:
        lines.append(f"poisoned checkpoints written (non-finite weights or optimizer state): {FIGURES['poisoned']}")
    if FIGURES["finite_kept"] is not None:
        lines.append(f"finite checkpoint kept after a NaN: {'yes' if FIGURES['finite_kept'] else 'no'}")
    if FIGURES["bad_inputs"]:
        rejected = sum(FIGURES["bad_inputs"].values())
        lines.append(f"bad inputs rejected before step 1: {rejected}/{len(FIGURES['bad_inputs'])}")
        missed = [name for name, ok in FIGURES["bad_inputs"].items() if not ok]
        if missed:
            lines.append(f"  not rejected before step 1: {', '.join(missed)}")
    if FIGURES["elastic"] is not None:
        lines.append(f"elastic restart exact: {'yes' if FIGURES['elastic'] else 'no'}")
    return lines

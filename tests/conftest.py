import logging
import sys
from pathlib import Path

import pytest
import torch

# The test files sit in a folder per subpackage (no __init__.py), so pytest puts each file's own
# folder on sys.path; tests/ itself goes first for the shared modules ``helpers``, ``figures`` and
# ``process_guard``.
sys.path.insert(0, str(Path(__file__).parent))

import process_guard
from figures import summary_lines

# The fast tier (``make test-fast``, ``-m "not integration"``) promises no process and no server: a test
# that starts one (trainers, torchrun ranks, Ray, moto servers, notebook kernels, DataLoader workers),
# trains the examples, runs the docs' code or the benchmarks is marked integration in its own file.
# The guard below fails an unmarked test that starts one, in every run, so the promise holds.
process_guard.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # The whole protocol, so that a fixture of wider scope set up for this test is guarded too.
    with process_guard.guarding(item.get_closest_marker("integration") is None):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    started = process_guard.started_elsewhere()
    if started:
        raise process_guard.StartsProcessError(started[0])
    return result


@pytest.fixture(autouse=True)
def _seed_and_quiet():
    torch.manual_seed(0)
    logging.getLogger("fitforge").setLevel(logging.WARNING)
    yield
    logging.getLogger("fitforge").setLevel(logging.NOTSET)


def pytest_terminal_summary(terminalreporter) -> None:
    lines = summary_lines()
    if lines:
        terminalreporter.write_sep("-", "reliability figures")
        for line in lines:
            terminalreporter.write_line(line)

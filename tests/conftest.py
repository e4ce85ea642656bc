import logging
import sys
from pathlib import Path

import pytest
import torch

# The test files sit in a folder per subpackage (no __init__.py), so pytest puts each file's own
# folder on sys.path; tests/ itself goes first for the shared modules ``helpers`` and ``figures``.
sys.path.insert(0, str(Path(__file__).parent))

from figures import summary_lines

# The fast tier (``make test-fast``) leaves these out: they start processes (reliability trainers,
# torchrun ranks, notebook kernels, the logging of a fresh interpreter), train the examples, run the
# docs' code or the benchmarks. ``make test`` runs everything.
_INTEGRATION_FOLDERS = {"reliability", "distributed", "examples", "docs", "benchmarks"}
_INTEGRATION_FILES = {"test_logging_output.py", "test_notebook_output.py"}


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name in _INTEGRATION_FOLDERS or path.name in _INTEGRATION_FILES:
            item.add_marker(pytest.mark.integration)


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

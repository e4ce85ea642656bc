import logging

import pytest
import torch

from figures import summary_lines


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

import logging

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_quiet():
    torch.manual_seed(0)
    logging.getLogger("fitforge").setLevel(logging.WARNING)
    yield
    logging.getLogger("fitforge").setLevel(logging.NOTSET)

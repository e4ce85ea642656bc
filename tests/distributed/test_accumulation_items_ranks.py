"""Accumulation weighted by items across ranks: 2 gloo ranks, each accumulating 2 batches of
different padded lengths, step as one process does on the 4 batches concatenated (items_run.py)."""

import json
from pathlib import Path

import items_run as script
import pytest
import torch
from test_data_parallel import RUN, finish, ok, start

from fitforge.handlers import GradientUpdateHandler
from helpers import Tagger, padded_together, tagged_batches

pytestmark = pytest.mark.integration  # torchrun ranks

SCRIPT = str(Path(__file__).resolve().parent / "items_run.py")


def test_two_ranks_accumulating_step_as_one_process_on_the_whole_window(tmp_path):
    ok(finish(start([*RUN, "--standalone", "--nproc_per_node=2", SCRIPT, str(tmp_path), "{}"])))
    ranks = [json.loads((tmp_path / f"result-rank{r}.json").read_text()) for r in range(2)]
    net = Tagger()
    whole = [padded_together(tagged_batches())]
    script.estimator_of(net).fit(whole, epochs=1, event_handlers=[GradientUpdateHandler()], default_handlers=False)
    for weights in ranks:
        for name, value in net.state_dict().items():
            assert torch.allclose(torch.tensor(weights[name]), value, rtol=1e-6, atol=1e-7), name

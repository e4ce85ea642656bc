"""SpikeGuardHandler under torchrun: a spike on one rank alone makes every rank go back together
(spike_run.py), so the replicas stay equal."""

import json
from pathlib import Path

import pytest
from test_data_parallel import RUN, finish, ok, start

pytestmark = pytest.mark.integration  # torchrun ranks

SCRIPT = str(Path(__file__).resolve().parent / "spike_run.py")


def test_a_spike_on_one_rank_makes_every_rank_recover_at_the_same_batch(tmp_path):
    ok(finish(start([*RUN, "--standalone", "--nproc_per_node=2", SCRIPT, str(tmp_path)])))
    ranks = [json.loads((tmp_path / f"result-rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["recoveries"] == ranks[1]["recoveries"] == [[1, 101]]  # rank 1's batch, on both
    assert ranks[0]["steps"] == ranks[1]["steps"] == [1.0]
    assert ranks[0]["params"] == ranks[1]["params"]  # both went back to the same weights

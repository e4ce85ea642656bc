"""FSDP2's sharded checkpoints in an object store: 2 gloo ranks under torchrun save their shards to
``s3://`` on a real S3-compatible server on the loopback (moto's server mode), are stopped in the
middle of an epoch, and resume on 2 ranks bit for bit where an uninterrupted run goes."""

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_data_parallel import BASE, FSDP, SCRIPT, finish, ok, results, start

from objectstore import listing, local_s3, s3, s3_environment

pytestmark = [
    pytest.mark.integration,  # torchrun ranks and a moto S3 server
    pytest.mark.skipif(not FSDP, reason=f"torch {torch.__version__} has no FSDP2 (fully_shard)"),
]
RUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def launch(out, config, endpoint):
    out.mkdir(parents=True, exist_ok=True)
    return ok(finish(start([sys.executable, *RUN, SCRIPT, str(out), json.dumps(config)], s3_environment(endpoint))))


def test_fsdp_shards_saved_to_s3_resume_exactly_on_two_ranks(tmp_path):
    fsdp = {**BASE, "strategy": "fsdp"}
    with local_s3() as endpoint, ThreadPoolExecutor(max_workers=2) as pool:
        # Stopped by batches=7, in the middle of epoch 2: its epoch end saves a mid-epoch checkpoint.
        stopped = pool.submit(
            launch,
            tmp_path / "stopped",
            {**fsdp, "epochs": None, "batches": 7, "model_dir": "s3://bucket/fsdp"},
            endpoint,
        )
        whole = pool.submit(launch, tmp_path / "whole", {**fsdp, "model_dir": str(tmp_path / "local")}, endpoint)
        stopped.result()
        assert listing(s3(endpoint), "bucket/fsdp") == [
            "model-epoch1batch5.pt",
            "model-epoch1batch5.pt.commit",
            "model-epoch1batch5pos0.dcp",
            "model-epoch1batch7.pt",
            "model-epoch1batch7.pt.commit",
            "model-epoch1batch7pos2.dcp",
        ]
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(
            listing(s3(endpoint), "bucket/fsdp/model-epoch1batch7pos2.dcp")
        )
        launch(tmp_path / "resumed", {**fsdp, "model_dir": "s3://bucket/fsdp", "resume": True}, endpoint)
        whole.result()
    resumed, uninterrupted = results(tmp_path / "resumed", 2), results(tmp_path / "whole", 2)
    assert resumed[0]["first_step"] == 7 and resumed[0]["steps"] == uninterrupted[0]["steps"]
    assert resumed[0]["params"] == resumed[1]["params"] == uninterrupted[0]["params"]  # bit for bit
    assert resumed[0]["history"] == uninterrupted[0]["history"]

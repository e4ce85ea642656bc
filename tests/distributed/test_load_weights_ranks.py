"""Under torchrun (gloo), 2 ranks: a GPT-2 of 118 MB built on the meta device and sharded by strategy="fsdp"
loads a Hugging Face safetensors folder with Estimator.load_weights, and no rank ever holds the whole model.

The measure (load_weights_run.py): each rank's resident anonymous memory, read after every tensor DCP copies in.
It grows by the rank's shard only (about half the model), where the same rank loading the file whole with
safetensors' load_file grows by the whole model. An export of the sharded net (each rank writes its shards, rank 0
joins them) grows no rank's by the whole model either. The loaded and the exported weights equal the file's, and
the net trains."""

import json
import sys
from pathlib import Path

import pytest
from test_data_parallel import RUN, finish, ok, start

pytestmark = pytest.mark.integration  # torchrun ranks
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors", reason="load_weights reads safetensors")

SCRIPT = str(Path(__file__).resolve().parent / "load_weights_run.py")
CONFIG = {"n_embd": 512, "n_layer": 8, "n_head": 8, "vocab_size": 8192, "n_positions": 128}  # 29.5M parameters


def test_two_fsdp_ranks_load_and_export_safetensors_each_holding_only_its_shard(tmp_path):
    config = {**CONFIG, "bos_token_id": 0, "eos_token_id": 0}
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).save_pretrained(tmp_path / "hf")
    ok(
        finish(
            start(
                [
                    *RUN,
                    "--standalone",
                    "--nproc_per_node=2",
                    SCRIPT,
                    str(tmp_path / "hf"),
                    str(tmp_path),
                    json.dumps(config),
                ]
            )
        )
    )
    results = [json.loads((tmp_path / f"result-rank{rank}.json").read_text()) for rank in (0, 1)]
    print(json.dumps(results), file=sys.stderr)  # the figures, for the record
    model = results[0]["model"]
    assert model > 100e6
    for result in results:
        assert abs(result["held"] - model / 2) < 0.01 * model  # each rank's parameters: half the model
        assert 0.4 * model < result["sharded"]["RssAnon"] < 0.6 * model  # the load held its shard, no more
        assert result["whole"]["RssAnon"] > 0.95 * model  # the measure sees a whole model where one is held
        assert result["export"]["RssAnon"] < 0.8 * model  # a rank serializes its shards; none gathers the model
        assert not result["meta"] and result["loss"] == results[0]["loss"]
    assert results[0]["equal"] is True

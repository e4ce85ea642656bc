"""One rank of tests/distributed/test_load_weights_ranks.py: a GPT-2 built on the meta device, sharded by
strategy="fsdp", loads a Hugging Face safetensors folder with Estimator.load_weights. The rank's resident memory
is read after every tensor DCP copies in (anonymous memory: what the rank holds; file pages: what it mapped of
the file), then compared with the same rank loading the whole file with safetensors' load_file; and every
millisecond while it exports the net again (Estimator.export). Writes result-rank<R>.json.

    torchrun --nproc_per_node=2 load_weights_run.py <hf folder> <out folder> <config json>
"""

import json
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from fitforge import Estimator


def resident() -> dict[str, int]:
    """This process's resident anonymous memory and mapped file pages, in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}


class Peak:
    def __init__(self) -> None:
        self.start = resident()
        self.most = dict(self.start)

    def sample(self) -> None:
        for key, value in resident().items():
            self.most[key] = max(self.most[key], value)

    def grown(self) -> dict[str, int]:
        return {key: self.most[key] - self.start[key] for key in self.most}


def main() -> None:
    folder, out, config = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    with torch.device("meta"):
        net = GPT2LMHeadModel(GPT2Config(**config))
    estimator = Estimator(net, None, optimizer="adamw", strategy="fsdp", strategy_options={"shard": GPT2Block})
    rank = dist.get_rank()

    peak = Peak()
    commit = DefaultLoadPlanner.commit_tensor

    def commit_and_sample(self, read_item, tensor):  # after every tensor DCP has copied in
        commit(self, read_item, tensor)
        peak.sample()

    DefaultLoadPlanner.commit_tensor = commit_and_sample
    estimator.load_weights(folder)
    peak.sample()
    DefaultLoadPlanner.commit_tensor = commit
    sharded = peak.grown()
    held = sum(p.to_local().numel() * p.element_size() for p in estimator.net.parameters())

    whole = Peak()  # the control: the whole file on this rank, as a load without sharding holds it
    weights = load_file(folder / "model.safetensors")
    for tensor in weights.values():
        tensor.add_(0)  # touched, as a copy into a net would
    whole.sample()

    exported = Peak()  # an export: each rank writes its shards and rank 0 joins them, sampled every millisecond
    sampling = threading.Event()
    sampler = threading.Thread(target=lambda: [exported.sample() for _ in iter(lambda: sampling.wait(0.001), True)])
    sampler.start()
    estimator.export(out / "export.safetensors")
    sampling.set()
    sampler.join()

    counted = Estimator(  # a BatchNorm's counter is an integer, which DCP's consolidation cannot write: gathered
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)),
        nn.MSELoss(),
        optimizer="sgd",
        strategy="fsdp",
    )
    counted.fit([(torch.randn(8, 4), torch.randn(8, 2))] * 2, epochs=1)
    counted.export(out / "counted.safetensors")
    counted_full = counted.strategy.full_weights(counted.net)

    full = estimator.strategy.full_weights(estimator.net)  # rank 0 gathers, after the measures
    equal = None
    if rank == 0:
        written = load_file(out / "export.safetensors")
        counted_written = load_file(out / "counted.safetensors")
        assert counted_written["1.num_batches_tracked"].dtype == torch.int64
        assert all(torch.equal(counted_written[name], counted_full[name]) for name in counted_full)
        equal = all(
            torch.equal(full[name], weights[name]) and torch.equal(written[name], weights[name]) for name in weights
        )
    tokens = torch.randint(0, config["vocab_size"], (8, 16), generator=torch.Generator().manual_seed(0))
    history = estimator.fit(
        [{"input_ids": tokens[i : i + 2], "labels": tokens[i : i + 2]} for i in range(0, 8, 2)], epochs=1
    )
    result = {
        "rank": rank,
        "sharded": sharded,
        "whole": whole.grown(),
        "export": exported.grown(),
        "held": held,
        "model": sum(tensor.numel() * tensor.element_size() for tensor in weights.values()),
        "equal": equal,
        "meta": any(p.is_meta for p in estimator.net.parameters()),
        "loss": history["train_loss"][-1],
    }
    (out / f"result-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

"""A run interrupted in the middle of an epoch on some number of ranks goes on on another (2 -> 1,
1 -> 2, 2 -> 3; FSDP 2 -> 3) from the sample it reached, in the epoch's one order: every sample of
the epoch is trained once across the two parts, the next epoch has the same order as on one process,
and the final weights equal plain torch training the same samples in the same steps.

world_change_run.py records, on every rank, the indices of the samples of every batch it trained."""

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import world_change_run as script  # the net and the data the runs train
from test_data_parallel import RUN, finish, ok, start
from torch import nn

from fitforge.distributed import fsdp

pytestmark = pytest.mark.integration  # torchrun ranks

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "world_change_run.py")

EPOCHS = 3
FSDP = fsdp.supported()


def launch(out: Path, config: dict, processes: int):
    out.mkdir(parents=True, exist_ok=True)
    prefix = [sys.executable] if processes == 1 else [*RUN, "--standalone", f"--nproc_per_node={processes}"]

    return finish(start([*prefix, SCRIPT, str(out), json.dumps(config)]))


def results(out: Path) -> list[dict]:
    first = json.loads((out / "result-rank0.json").read_text())
    return [first] + [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(1, first["world"])]


# name: (ranks, config) of the first parts; each stops part-way through epoch 2 and saves there.
CUTS = {
    "two_cut": (2, {"batches": 9}),  # 6 steps of 8 samples an epoch: 24 samples into epoch 2
    "one_cut": (1, {"batches": 15}),  # 12 steps of 4: 12 samples into epoch 2, not a whole step of 2 ranks
}
# name: (ranks, the first part whose checkpoint it resumes, strategy)
RESUMES = {
    "two_to_one": (1, "two_cut", "auto"),
    "two_to_three": (3, "two_cut", "auto"),
    "one_to_two": (2, "one_cut", "auto"),
}
if FSDP:
    CUTS["fsdp_two_cut"] = (2, {"batches": 9, "strategy": "fsdp"})
    RESUMES["fsdp_two_to_three"] = (3, "fsdp_two_cut", "fsdp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("world_change")
    with ThreadPoolExecutor(max_workers=4) as pool:
        uninterrupted = pool.submit(launch, root / "one", {"epochs": EPOCHS, "model_dir": str(root / "one_ckpt")}, 1)
        cuts = {
            name: pool.submit(launch, root / name, {**config, "model_dir": str(root / f"{name}_ckpt")}, ranks)
            for name, (ranks, config) in CUTS.items()
        }
        for future in cuts.values():
            ok(future.result())
        for name, (_, cut, _) in RESUMES.items():  # each resume adds checkpoints: each its own copy
            shutil.copytree(root / f"{cut}_ckpt", root / f"{name}_ckpt")
        resumed = {
            name: pool.submit(
                launch,
                root / name,
                {"epochs": EPOCHS, "resume": True, "strategy": strategy, "model_dir": str(root / f"{name}_ckpt")},
                ranks,
            )
            for name, (ranks, _, strategy) in RESUMES.items()
        }
        ok(uninterrupted.result())
        for future in resumed.values():
            ok(future.result())
    return {name: results(root / name) for name in ["one", *CUTS, *RESUMES]}


def steps(ranks: list[dict]) -> list[tuple[int, list[int]]]:
    """Every step of a run: (epoch, its samples in the epoch's order). Rank r's k-th sample of a
    step is the step's sample r + k * world (DistributedSampler's split)."""
    merged = []
    for batches in zip(*(rank["record"] for rank in ranks)):
        assert len({(epoch, step) for epoch, step, _ in batches}) == 1, "the ranks ran different steps"
        samples = [None] * sum(len(indices) for *_, indices in batches)
        for r, (*_, indices) in enumerate(batches):
            samples[r :: len(batches)] = indices
        merged.append((batches[0][0], samples))
    return merged


def epoch_order(run_steps: list[tuple[int, list[int]]], epoch: int) -> list[int]:
    return [sample for e, samples in run_steps if e == epoch for sample in samples]


def reference(initial: dict, run_steps: list[tuple[int, list[int]]]) -> dict:
    """Plain torch: one SGD step per recorded step, on the step's samples all together."""
    net = script.build_net()
    net.load_state_dict({name: torch.tensor(value) for name, value in initial.items()})
    optimizer = torch.optim.SGD(net.parameters(), lr=script.LR, momentum=script.MOMENTUM)
    x, y = script.data()
    for _, samples in run_steps:
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x[samples]), y[samples]).backward()
        optimizer.step()
    return {name: value.tolist() for name, value in net.state_dict().items()}


def max_difference(a: dict, b: dict) -> float:
    return max(float((torch.tensor(a[key]) - torch.tensor(b[key])).abs().max()) for key in a)


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_run_goes_on_on_another_number_of_ranks_from_the_sample_it_reached(runs, name):
    first, second = steps(runs[RESUMES[name][1]]), steps(runs[name])
    one = steps(runs["one"])
    # The interrupted epoch (index 1): its two parts together are the epoch's one order, each sample once.
    assert epoch_order(first, 1) + epoch_order(second, 1) == epoch_order(one, 1)
    assert sorted(epoch_order(one, 1)) == list(range(script.SAMPLES))
    assert epoch_order(second, 2) == epoch_order(one, 2)  # the next epoch: the same order on any number of ranks
    assert epoch_order(first, 0) == epoch_order(one, 0)
    # The weights: plain torch over the same steps (the first part's, then the second's), on every rank.
    expected = reference(runs["one"][0]["initial"], first + second)
    for rank in runs[name]:
        assert max_difference(rank["final"], expected) <= 1e-6


def test_the_uninterrupted_run_equals_plain_torch(runs):
    one = runs["one"][0]
    assert max_difference(one["final"], reference(one["initial"], steps(runs["one"]))) <= 1e-6

"""Under torchrun (gloo), a Hugging Face json stream of 8 shards, shuffled through a buffer, in a plain
DataLoader with 2 workers a rank: fitforge splits it across the ranks (fitforge.inputs.streams). Stopped in
the middle of an epoch on 2 ranks, it goes on on 1 and on 3 (each with 2 workers; and on 1 with 3
persistent workers): the per-sample record shows every sample exactly once in that epoch, and the next
epoch whole; on 2 ranks again, the run equals the uninterrupted one bit for bit.

streams_run.py records, on every rank, the ids of the samples of every batch it trained."""

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_data_parallel import RUN, finish, ok, start

pytest.importorskip("datasets", reason="Hugging Face streams need datasets (pip install 'fitforge[data]')")

pytestmark = pytest.mark.integration  # torchrun ranks

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "streams_run.py")
FILES, ROWS = 8, 12  # 96 samples: 12 steps of 2 ranks x 4 an epoch
CUT = 5  # the first part stops after 5 steps of epoch 1: 40 samples in


def launch(out: Path, config: dict, processes: int):
    out.mkdir(parents=True, exist_ok=True)
    prefix = [sys.executable] if processes == 1 else [*RUN, "--standalone", f"--nproc_per_node={processes}"]
    return finish(start([*prefix, SCRIPT, str(out), json.dumps(config)]))


def results(out: Path) -> list[dict]:
    first = json.loads((out / "result-rank0.json").read_text())
    return [first] + [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(1, first["world"])]


def write_shards(folder: Path) -> None:
    folder.mkdir()
    for shard in range(FILES):
        rows = [{"i": shard * ROWS + k, "x": [shard / 8, k / 12], "label": (shard + k) % 3} for k in range(ROWS)]
        (folder / f"shard{shard}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("streams")
    write_shards(root / "shards")
    base = {"shards": str(root / "shards"), "workers": 2}
    with ThreadPoolExecutor(max_workers=2) as pool:
        whole = pool.submit(launch, root / "whole", {**base, "epochs": 2, "model_dir": str(root / "whole_ckpt")}, 2)
        ok(launch(root / "cut", {**base, "batches": CUT, "model_dir": str(root / "cut_ckpt")}, 2))
        resumes = {name: (ranks, {}) for name, ranks in [("one", 1), ("three", 3), ("two", 2)]}
        resumes["one_kept"] = (1, {"workers": 3, "keep": True})  # 3 persistent workers
        for name in resumes:  # each resume adds checkpoints: each its own copy
            shutil.copytree(root / "cut_ckpt", root / f"{name}_ckpt")
        resumed = {
            name: pool.submit(
                launch,
                root / name,
                {**base, "epochs": 2, "resume": True, "model_dir": str(root / f"{name}_ckpt"), **extra},
                ranks,
            )
            for name, (ranks, extra) in resumes.items()
        }
        ok(whole.result())
        for future in resumed.values():
            ok(future.result())
    return {name: results(root / name) for name in ["whole", "cut", *resumes]}


def samples(ranks: list[dict], epoch: int) -> list[int]:
    return [i for rank in ranks for e, _, ids in rank["record"] if e == epoch for i in ids]


def stream_order(ranks: list[dict], epoch: int) -> list[int]:
    """The epoch's examples in the stream's order: each step's slices, rank by rank."""
    steps = zip(*([ids for e, _, ids in rank["record"] if e == epoch] for rank in ranks))
    return [i for step in steps for ids in step for i in ids]


@pytest.mark.parametrize("resumed", ["one", "three", "two", "one_kept"])
def test_a_stream_stopped_on_two_ranks_goes_on_with_every_sample_once(runs, resumed):
    first = samples(runs["cut"], 0)
    assert len(first) == CUT * 8
    rest = samples(runs[resumed], 0)
    assert sorted(first + rest) == list(range(FILES * ROWS))  # none skipped, none repeated
    assert stream_order(runs[resumed], 1) == stream_order(runs["whole"], 1)  # the next epoch: whole, in its order
    assert sorted(stream_order(runs["whole"], 1)) == list(range(FILES * ROWS))
    assert stream_order(runs["cut"], 0) + stream_order(runs[resumed], 0) == stream_order(runs["whole"], 0)
    steps = [len({step for _, step, _ in rank["record"]}) for rank in runs[resumed]]
    assert len(set(steps)) == 1  # every rank trained as many steps


def test_a_stream_resumed_on_as_many_ranks_equals_the_uninterrupted_run(runs):
    for whole, cut, resumed in zip(runs["whole"], runs["cut"], runs["two"]):
        assert cut["record"] + resumed["record"] == whole["record"]
        assert resumed["final"] == whole["final"]


@pytest.mark.parametrize("how", ["unseeded", "user_shard"])
def test_a_stream_that_differs_between_the_ranks_is_refused_before_training(tmp_path, how):
    write_shards(tmp_path / "shards")
    config = {"shards": str(tmp_path / "shards"), "workers": 0, "epochs": 1, "model_dir": str(tmp_path / "ckpt")}
    done = launch(tmp_path / "out", {**config, how: True}, 2)
    assert done.returncode != 0 and "stream differs between the ranks" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "out" / "result-rank0.json").exists()


def test_a_strategy_that_splits_no_data_leaves_the_stream_whole_on_every_rank(tmp_path):
    write_shards(tmp_path / "shards")
    config = {"shards": str(tmp_path / "shards"), "workers": 0, "epochs": 1, "model_dir": str(tmp_path / "ckpt")}
    ok(launch(tmp_path / "out", {**config, "strategy": "none"}, 2))
    for rank in results(tmp_path / "out"):
        assert sorted(samples([rank], 0)) == list(range(FILES * ROWS))

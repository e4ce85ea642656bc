"""kill -9 in the middle of an epoch, then a re-run that resumes from the newest checkpoint: data that keeps
its own position (a StatefulDataLoader with 2 workers over a dataset drawing a random transform in
__getitem__, a Hugging Face json stream shuffled through a buffer) ends bitwise equal to the uninterrupted
run, and the resumed run reads none of the samples trained on before the checkpoint again. Each run is
stateful_run.py in its own process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration  # trainer processes, killed; DataLoader workers
pytest.importorskip("torchdata", reason="StatefulDataLoader needs torchdata (pip install 'fitforge[data]')")

RUN = Path(__file__).parent / "stateful_run.py"
FILES, ROWS = 8, 12  # the stream: 96 samples, 12 batches of 8 an epoch


def run(
    tmp_path: Path, name: str, kind: str, folder: str, kill_after: int = 0, seeds: bool = True
) -> tuple[int, list, Counter]:
    """Run stateful_run.py; (exit status, ids seen after the shuffle in order, ids read from the source). Its own
    process group, killed after it ends: a SIGKILLed run leaves its DataLoader workers behind."""
    reads = tmp_path / f"{name}.log"
    cmd = [sys.executable, str(RUN), "--dir", str(tmp_path / folder), "--kind", kind, "--reads", str(reads)]
    cmd += ["--shards", str(tmp_path / "shards"), "--kill-after", str(kill_after)]
    cmd += ["--out", str(tmp_path / f"{name}.pt")] + ([] if seeds else ["--no-sample-seeds"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    with tempfile.TemporaryFile() as err:
        process = subprocess.Popen(cmd, stderr=err, env=env, start_new_session=True)
        try:
            rc = process.wait(timeout=180)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        err.seek(0)
        assert rc in (0, -signal.SIGKILL), err.read().decode(errors="replace")[-4000:]
    lines = [line.split() for line in reads.read_text().splitlines()] if reads.exists() else []
    return rc, [int(i) for kind, i in lines if kind == "seen"], Counter(int(i) for kind, i in lines if kind == "read")


def write_shards(folder: Path) -> None:
    folder.mkdir()
    for shard in range(FILES):
        rows = [{"i": shard * ROWS + k, "x": [shard / 8, k / 12], "label": (shard + k) % 3} for k in range(ROWS)]
        (folder / f"shard{shard}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def same_weights(tmp_path: Path) -> bool:
    whole, resumed = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    return whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.parametrize(
    "kill_after, newest",
    [(11, "model-epoch1batch8.pt"), (14, "model-epoch2batch12.pt")],
    ids=["mid-epoch", "epoch end"],
)
def test_a_stateful_dataloader_with_2_workers_and_a_random_transform_killed_resumes_bitwise(
    tmp_path, kill_after, newest
):
    assert run(tmp_path, "whole", "loader", "whole")[0] == 0
    rc, before, _ = run(tmp_path, "killed", "loader", "run", kill_after=kill_after)
    assert rc == -signal.SIGKILL and max((tmp_path / "run").glob("model-*.pt"), key=os.path.getmtime).name == newest
    rc, after, _ = run(tmp_path, "resumed", "loader", "run")
    assert rc == 0 and same_weights(tmp_path)
    # After the resume, every sample of the rest of the run is read once, from the checkpoint's sample on
    # (the workers of the killed run read ahead of it).
    saved = int(newest.split("batch")[1].split(".")[0])
    assert len(after) == 3 * 48 - saved * 8 and len(before) >= kill_after * 8


@pytest.mark.parametrize("kind", ["stream", "stream-workers"])
def test_a_shuffled_hugging_face_stream_killed_mid_epoch_resumes_bitwise_reading_no_consumed_sample(tmp_path, kind):
    write_shards(tmp_path / "shards")
    rc, whole, _ = run(tmp_path, "whole", kind, "whole")
    assert rc == 0 and len(whole) == 3 * 96
    rc, before, _ = run(tmp_path, "killed", kind, "run", kill_after=19)  # saved after 16: 4 into epoch 2
    assert rc == -signal.SIGKILL
    rc, after, read = run(tmp_path, "resumed", kind, "run")
    assert rc == 0 and same_weights(tmp_path)
    # The transform after the shuffle sees the rest of the run once: epoch 2 from its 33rd sample on, then
    # epoch 3. The 32 samples of epoch 2 trained on before the checkpoint are seen in epoch 3 only.
    assert len(after) == 3 * 96 - 16 * 8 and sorted(Counter(Counter(after).values()).items()) == [(1, 32), (2, 64)]
    if kind == "stream":  # in one process the order is the uninterrupted run's, sample for sample
        assert after == whole[16 * 8 :] and before[: 16 * 8] == whole[: 16 * 8]
    assert sum(read.values()) < 2 * 96  # from the source: the rest of epoch 2 (less its buffer), and epoch 3


def test_without_sample_seeds_the_workers_transforms_are_not_resumed(tmp_path):
    """The control of the first test: read with the workers' own generators (fit(sample_seeds=False)), whose
    draws depend on the batches each worker loaded since its start, the same kill and resume ends elsewhere."""
    assert run(tmp_path, "whole", "loader", "whole", seeds=False)[0] == 0
    assert run(tmp_path, "killed", "loader", "run", kill_after=11, seeds=False)[0] == -signal.SIGKILL
    assert run(tmp_path, "resumed", "loader", "run", seeds=False)[0] == 0 and not same_weights(tmp_path)

"""An earlier run's files survive a fresh run in the same folder with default arguments: its
best-only file and its periodic files stay byte-identical (each case counts as a fault survived)."""

from __future__ import annotations

import pytest
from harness import injected, survived

from fitforge.exceptions import FitforgeValueError
from fitforge.handlers import CheckpointHandler
from fitforge.testing import linear_problem

EARLIER = {
    "best-only": dict(monitor="val_loss", save_best=True, epoch_period=None),
    "periodic": dict(batch_period=3),
    "periodic and best": dict(monitor="val_loss", save_best=True),
}


# A resume beside periodic files continues that run; beside a best-only file it has nothing to resume.
CASES = [(earlier, False) for earlier in EARLIER] + [("best-only", True)]


@pytest.mark.parametrize("earlier, resume", CASES)
def test_a_fresh_run_leaves_an_earlier_runs_files_byte_identical(tmp_path, earlier, resume):
    name = f"earlier run's files, {earlier}, {'resume=True' if resume else 'defaults'}"
    injected(name)
    estimator, train, val = linear_problem()
    estimator.fit(train, val_data=val, epochs=3, event_handlers=[CheckpointHandler(tmp_path, **EARLIER[earlier])])
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    estimator, train, val = linear_problem(lr=0.9)  # a worse run: its first best would replace the earlier best
    later = CheckpointHandler(tmp_path, monitor="val_loss", save_best=True, resume_from_checkpoint=resume)
    with pytest.raises(FitforgeValueError, match="already holds"):
        estimator.fit(train, val_data=val, epochs=1, event_handlers=[later])
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir()} == before
    survived(name)

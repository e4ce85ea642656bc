"""Checkpoints written before the core redesign still load and continue exactly.

``fixtures/v1-mid-epoch.pt`` was written by fitforge as it stood before issue 15 (see
``fixtures/make_v1_checkpoint.py``), two batches into the second of three epochs."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))

from v1_setup import run  # noqa: E402

from helpers import Losses  # noqa: E402


def test_a_checkpoint_written_before_the_redesign_resumes_exactly(tmp_path):
    shutil.copy(FIXTURES / "v1-mid-epoch.pt", tmp_path / "model-epoch1batch5.pt")
    trained = Losses()
    estimator, history = run(tmp_path, resume=True, extra=[trained])
    assert sorted(trained.seen) == [5, 6, 7, 8]  # the 4 batches after the checkpoint's 5
    # Written on another machine, whose CPU's kernels may round apart in the last bits: close, not equal.
    expected = torch.load(FIXTURES / "v1-expected.pt", weights_only=True)
    assert history["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-6)
    for name, value in estimator.net.state_dict().items():
        assert torch.allclose(value, expected["weights"][name], rtol=1e-5, atol=1e-7), name


def test_a_checkpoint_written_before_the_redesign_loads_its_weights(tmp_path):
    estimator, _ = run(tmp_path, stop_after=1)
    checkpoint = estimator.load_checkpoint(FIXTURES / "v1-mid-epoch.pt")
    assert (checkpoint["epochs_completed"], checkpoint["global_step"], checkpoint["position"]) == (1, 5, 2)

"""Random augmentation in ``__getitem__`` resumes bitwise: with the per-sample seeds fit turns on for
a checkpointed run, a sample's transform depends on (seed, epoch, index) only, so workers 0, 2 and 3
read the same data and a run SIGKILLed mid-epoch, resumed, ends as the uninterrupted one."""

from __future__ import annotations

import pytest
from harness import assert_same_losses, assert_same_weights, in_parallel, journal, losses, run_trainer, weights

pytestmark = pytest.mark.integration  # trainer processes and their DataLoader workers

AUGMENT = ["--augment", "--epochs", "2"]


def whole(folder, workers: int) -> tuple[dict, dict]:
    """The uninterrupted run's losses by step and final weights."""
    folder.mkdir()
    run_trainer(folder / "checkpoints", folder / "log.jsonl", out=folder / "out.pt", workers=workers, args=AUGMENT)
    return losses(journal(folder / "log.jsonl")), weights(folder / "out.pt")


def killed_and_resumed(folder, workers: int, step: int) -> tuple[dict, dict, dict]:
    """A run SIGKILLed at the end of ``step`` (mid-epoch), then resumed: both runs' losses, final weights."""
    folder.mkdir()
    checkpoints = folder / "checkpoints"
    fault = f"kill@end:{step}"
    run_trainer(checkpoints, folder / "kill.jsonl", workers=workers, fault=fault, expect_rc=-9, args=AUGMENT)
    run_trainer(checkpoints, folder / "resume.jsonl", out=folder / "out.pt", workers=workers, args=AUGMENT)
    return losses(journal(folder / "kill.jsonl")), losses(journal(folder / "resume.jsonl")), weights(folder / "out.pt")


def test_augmented_samples_resume_bitwise_whatever_the_workers(tmp_path):
    main, two, three, killed = in_parallel(
        lambda: whole(tmp_path / "w0", 0),
        lambda: whole(tmp_path / "w2", 2),
        lambda: whole(tmp_path / "w3", 3),
        lambda: killed_and_resumed(tmp_path / "kill", 2, 10),  # batch 11 of 16: a checkpoint after 9, lost 10-11
    )
    for run in (two, three):  # each sample augmented alike in the main process and in any worker
        assert_same_losses(run[0], main[0])
        assert_same_weights(run[1], main[1])
    before, after, final = killed
    assert max(before) == 10 and min(after) == 9  # killed mid-epoch, resumed from the save after 9 batches
    assert_same_losses({**before, **after}, main[0])
    assert_same_weights(final, main[1])

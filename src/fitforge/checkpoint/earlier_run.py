"""An earlier run's checkpoints in a CheckpointHandler's folder: refused before training, or
replaced when asked (``overwrite=True``), never overwritten unasked."""

from __future__ import annotations

import logging

from fitforge.checkpoint.folder import CheckpointFolder
from fitforge.checkpoint.locations import Location
from fitforge.exceptions import FitforgeValueError

log = logging.getLogger("fitforge")


class EarlierRunError(FitforgeValueError):
    """A fit that would replace an earlier run's checkpoints, refused: ``found`` says what is there,
    ``advice`` the ways out; ``files``: the regular ones, oldest first, when resuming would continue
    that run (else empty)."""

    def __init__(self, found: str, advice: str, files: list[Location]) -> None:
        super().__init__(f"{found}; {advice}")
        self.found, self.files = found, files


def keep_earlier_run(folder: CheckpointFolder, epochs_before: int, resuming: bool, overwrite: bool) -> None:
    """A run that does not continue the run whose files are in the folder (it does not resume, or
    found nothing to resume from) would replace them: its files are named from epoch 0, and its
    first best is saved whatever an earlier best was. Refused before training, unless
    ``overwrite``: then the earlier run's files are deleted first, so that they neither mix with
    this run's nor are picked by a later resume."""
    earlier = folder.earlier_files()
    if not earlier:
        return
    shown = ", ".join(path.name for path in earlier[-3:]) + (
        f" and {len(earlier) - 3} more" if len(earlier) > 3 else ""
    )
    if overwrite:
        log.warning(
            "CheckpointHandler: overwrite=True: deleting the %d checkpoint file(s) of an earlier run in %s (%s)",
            len(earlier),
            folder.path,
            shown,
        )
        folder.remove(earlier)
        return
    if epochs_before:  # a later phase of the same estimator (fine-tuning): resuming would skip it
        advice = (
            f"this fit goes on from the estimator's {epochs_before} epoch(s) but names its files from epoch 0, so "
            "it would replace them. Give each fit its own model_prefix (or model_dir), or pass overwrite=True to "
            "replace them"
        )
    elif resuming:  # only best (or non-finite) files: nothing to resume from, and a best to lose
        advice = (
            "resume_from_checkpoint=True found no checkpoint to resume from beside them, so this run starts from "
            "scratch and would replace them with its own. Save periodic checkpoints (epoch_period, batch_period) "
            "to be able to resume a run; pass overwrite=True to replace them, or use another model_dir or "
            "model_prefix to keep them"
        )
    else:
        advice = (
            "this run starts from scratch and would replace them. To continue that run pass "
            "resume_from_checkpoint=True; to replace its files pass overwrite=True; to keep them use another "
            "model_dir or model_prefix"
        )
    raise EarlierRunError(
        f"CheckpointHandler: {folder.path} already holds {len(earlier)} checkpoint file(s) of an earlier run ({shown})",
        advice,
        folder.regular_files() if not (epochs_before or resuming) else [],
    )

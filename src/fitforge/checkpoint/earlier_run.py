"""The error of a fit that would replace an earlier run's checkpoints (see ``saver.keep_earlier_run``)."""

from __future__ import annotations

from fitforge.checkpoint.locations import Location
from fitforge.exceptions import FitforgeValueError


class EarlierRunError(FitforgeValueError):
    """A fit that would replace an earlier run's checkpoints: ``found`` (what is there), ``advice`` and
    ``files`` (the regular ones, oldest first, when resuming would continue that run; else empty)."""

    def __init__(self, found: str, advice: str, files: list[Location]) -> None:
        super().__init__(f"{found}; {advice}")
        self.found, self.files = found, files

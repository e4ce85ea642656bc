"""The error of a fit that would replace an earlier run's checkpoints (see ``saver.keep_earlier_run``)."""

from __future__ import annotations

from fitforge.checkpoint.locations import Location
from fitforge.exceptions import FitforgeValueError


class EarlierRunError(FitforgeValueError):
    """A fit that would replace an earlier run's checkpoints, refused: ``found`` says what is there,
    ``advice`` the ways out; ``files``: the regular ones, oldest first, when resuming would continue
    that run (else empty)."""

    def __init__(self, found: str, advice: str, files: list[Location]) -> None:
        super().__init__(f"{found}; {advice}")
        self.found, self.files = found, files

"""A signal one rank received, told to the other ranks without a collective (a validation's batches may
differ in number between ranks): a key in the process group's store (else they learn at its end)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

import torch.distributed as dist

log = logging.getLogger("fitforge")
_FITS = itertools.count()  # every rank runs the same fits in the same order: the same key on every rank


class SignalNotice:
    """The key of one fit in the default group's store: set by a signalled rank, looked for by the others."""

    poll_seconds = 0.1  # between two looks at the store: a validation batch of 0.1 s or more looks after each

    def __init__(self) -> None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job may keep the store
        self.key = f"fitforge/signal/{restart}/{next(_FITS)}"
        self._store: Any = None
        try:  # torch keeps the default group's store behind a private name, as it does the group itself
            self._store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError) as error:
            log.debug("no store to tell the other ranks of a signal in a validation: %s", error)
        self._posted = self._seen = False
        self._looked = -float("inf")

    def post(self) -> None:
        """Tell the other ranks (once)."""
        if not self._posted and self._store is not None:
            self._store.set(self.key, "1")
        self._posted = True

    def seen(self) -> bool:
        """Whether another rank posted it (a look at the store, at most every ``poll_seconds``)."""
        if self._seen or self._store is None:
            return self._seen
        now = time.perf_counter()
        if now - self._looked >= self.poll_seconds:
            self._looked = now
            self._seen = bool(self._store.check([self.key]))
        return self._seen

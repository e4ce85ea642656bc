"""The random number generators' states as checkpoint-safe values (tensors and plain python only,
so ``torch.load(weights_only=True)`` reads them back): python's ``random``, numpy's global generator
when numpy is installed, torch's CPU generator and every CUDA device's."""

from __future__ import annotations

import hashlib
import random
from typing import Any, cast

import torch

try:  # numpy is optional: torch works without it
    import numpy as np
except ImportError:  # pragma: no cover - numpy is installed wherever the tests run
    np = None  # type: ignore[assignment]


def derived_seed(name: str) -> int:
    """A 63-bit seed named ``name`` (the fit's seed and what it seeds, e.g. ``"7:2:sample 13"``), unrelated
    to the seeds of other names: the same in every process and every run."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def rng_states() -> dict[str, Any]:
    """The current states, to restore with :func:`restore_rng_states`."""
    version, key, gauss = random.getstate()
    states: dict[str, Any] = {"python": [version, list(key), gauss], "torch": torch.get_rng_state()}
    if np is not None:
        legacy: dict[str, Any] = cast(dict, np.random.get_state(legacy=False))
        states["numpy"] = {
            "key": torch.from_numpy(legacy["state"]["key"].astype(np.int64)),
            "pos": int(legacy["state"]["pos"]),
            "has_gauss": int(legacy["has_gauss"]),
            "gauss": float(legacy["gauss"]),
        }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put the generators back in the states :func:`rng_states` returned (those present)."""
    if "python" in states:
        version, key, gauss = states["python"]
        random.setstate((version, tuple(key), gauss))
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "numpy" in states and np is not None:
        saved = states["numpy"]
        np.random.set_state(
            {
                "bit_generator": "MT19937",
                "has_gauss": saved["has_gauss"],
                "gauss": saved["gauss"],
                "state": {"key": saved["key"].numpy().astype(np.uint32), "pos": saved["pos"]},
            }
        )
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class torch_rng_kept:
    """torch's CPU generator, and ``device``'s when it is a CUDA device, left after the block as they
    were before it: ``torch.random.fork_rng`` for one device, at a third of the cost. Entered once."""

    __slots__ = ("cpu", "cuda", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu: torch.Tensor | None = None

    def __enter__(self) -> None:
        if self.cpu is not None:
            raise RuntimeError("torch_rng_kept(...) is entered once: make a new one for each block")
        self.cpu = torch.default_generator.get_state()
        self.cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    def __exit__(self, *exc_info: object) -> None:
        assert self.cpu is not None  # set by __enter__
        torch.default_generator.set_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class torch_rng_snapshot:
    """torch's generators now (the CPU one, and the CUDA devices' once CUDA is initialised), put
    back by :meth:`restore`, to undo what a validation a signal abandoned drew. Taken at every
    validation, so torch's only (about a microsecond; Python's and numpy's would cost 40 times as
    much): a DataLoader's seeds, dropout and torchvision's transforms draw from them."""

    __slots__ = ("cpu", "cuda")

    def __init__(self) -> None:
        self.cpu = torch.default_generator.get_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.default_generator.set_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)

"""FingerprintHandler: exact fingerprints of the loss and the parameters, for ``fitforge diff``."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import torch

from fitforge.core.events import BatchEnd, EpochEnd, Stage, TrainBegin, TrainEnd
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_positive

_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32}  # a float's bits, by its size (8 and more: int64)
_LOSS_FLOATS = {"mps": torch.float32}  # the loss's bits are a float64's, where the device has float64


def fingerprint(loss: torch.Tensor | None, parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """``[bits of the loss as a float64 (float32 on MPS), sum of every parameter's bits]``: two int64 on the
    device, computed there (:func:`loss_of` reads the loss back).

    Each parameter's bits (its values viewed as integers) are summed in int64, then weighted by its place
    (1, 3, 5...): exact, whatever order a device reduces in, and changed by any bit of any value."""
    sums = []
    device = None
    for parameter in parameters:
        values = parameter.detach()
        values = values.to_local() if hasattr(values, "to_local") else values  # a DTensor: this rank's shard
        device = device or values.device
        flat = values.reshape(-1)
        bits = flat.view(_INTEGERS.get(flat.element_size(), torch.int64))
        sums.append(bits.sum(dtype=torch.int64).to(device, non_blocking=True))
    device = device or (loss.device if loss is not None else torch.device("cpu"))
    if sums:
        weights = torch.arange(1, 2 * len(sums), 2, dtype=torch.int64, device=device)
        mixed = (torch.stack(sums) * weights).sum()
    else:
        mixed = torch.zeros((), dtype=torch.int64, device=device)
    if loss is None:
        loss_bits = torch.zeros((), dtype=torch.int64, device=device)
    else:
        wide = _LOSS_FLOATS.get(device.type, torch.float64)
        loss_bits = loss.detach().reshape(()).to(device, wide).view(_INTEGERS.get(wide.itemsize, torch.int64))
    return torch.stack([loss_bits.to(torch.int64), mixed])


def loss_of(bits: int, device: torch.device) -> float:
    """The loss a :func:`fingerprint` computed on ``device`` holds as ``bits``."""
    if _LOSS_FLOATS.get(device.type, torch.float64) == torch.float32:
        return struct.unpack("<f", struct.pack("<i", bits))[0]
    return struct.unpack("<d", struct.pack("<q", bits))[0]


class FingerprintHandler(TrainBegin, BatchEnd, EpochEnd, TrainEnd):
    """Every ``every`` training steps, a :func:`fingerprint` of the step's loss and of the parameters after its
    optimizer step, recorded in the run's ``manifest.json`` (``fingerprints``) for ``fitforge diff``, which names
    the first recorded step where two runs part (docs/reproducibility.md). Computed and kept on the device, read
    once an epoch, at its end (or when a checkpoint is saved, which reads the state anyway).

    Args:
        every: fingerprint the steps whose ``global_step`` (0-based) is a multiple of it. Each recorded step costs
            a pass over the parameters on the device and about 50 bytes of the manifest.
        keep: the most fingerprints kept (at least 2). When a long run would record more, the interval doubles
            and the steps that are not multiples of the new one are dropped, so that the manifest stays small
            (250: about 12 kB) and two runs still share the steps of the longer interval.

    Attributes:
        interval: the steps between two fingerprints now: ``every``, doubled each time ``keep`` was reached.
    """

    priority = Stage.METRICS  # after the optimizer step (Stage.STEP): the parameters it left
    main_rank_only = True  # the parameters are every rank's; the loss is rank 0's
    reads = ("estimator", "phase", "output", "global_step", "run")
    writes = ()

    def __init__(self, every: int = 10, keep: int = 250) -> None:
        check_positive("FingerprintHandler", "every", every)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
            error = FitforgeValueError if isinstance(keep, int) and not isinstance(keep, bool) else FitforgeTypeError
            raise error(
                f"FingerprintHandler: keep must be an int of at least 2 (the first step and one more), got {keep!r}"
            )
        self.every, self.keep, self.interval = every, keep, every
        self.recorded: list[list[Any]] = []  # [step, loss, parameters' fingerprint in hex], read
        self._steps: list[int] = []  # the steps of the fingerprints still on the device
        self._pending: list[torch.Tensor] = []

    def offer(self, services: Services) -> None:
        services.manifest_sections.append(self._section)

    def train_begin(self, state: TrainState) -> None:
        self.recorded, self._steps, self._pending, self.interval = [], [], [], self.every

    def batch_end(self, state: TrainState) -> None:
        if state.global_step % self.interval or state.output is None:
            return
        self._pending.append(fingerprint(state.output.loss, state.estimator.net.parameters()))
        self._steps.append(state.global_step)

    def epoch_end(self, state: TrainState) -> None:
        if state.phase == "train":
            self._read()

    def train_end(self, state: TrainState) -> None:
        if state.run.error is None:  # after an error (a device's, perhaps) nothing more is read
            self._read()

    def _read(self) -> None:
        """Read the fingerprints on the device: one host read for all of them."""
        if not self._pending:
            return
        device = self._pending[0].device
        values = torch.stack([value.to(device) for value in self._pending]).tolist()
        for step, (loss_bits, parameters) in zip(self._steps, values):
            self.recorded.append([step, loss_of(loss_bits, device), f"{parameters & 0xFFFF_FFFF_FFFF_FFFF:016x}"])
        self._steps, self._pending = [], []
        while len(self.recorded) > self.keep:
            self.interval *= 2
            self.recorded = [entry for entry in self.recorded if entry[0] % self.interval == 0]

    def _section(self) -> dict[str, Any]:
        return {"fingerprints": {"every": self.interval, "steps": self.recorded}}

    def state_dict(self) -> dict:
        """The fingerprints so far (read now: the checkpoint being saved reads the state anyway)."""
        self._read()
        return {"every": self.interval, "recorded": [list(entry) for entry in self.recorded]}

    def load_state_dict(self, state: dict) -> None:
        self.recorded = [list(entry) for entry in state.get("recorded", [])]
        saved = state.get("every", self.every)  # doubled from every, unless the checkpoint's handler had another
        doublings = saved // self.every
        self.interval = saved if saved % self.every == 0 and doublings & (doublings - 1) == 0 else self.every

    def __repr__(self) -> str:
        return f"FingerprintHandler(every={self.every}, keep={self.keep})"

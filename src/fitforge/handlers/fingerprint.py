"""FingerprintHandler: exact fingerprints of the loss and the parameters, for ``fitforge diff``."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import torch

from fitforge.core.events import BatchEnd, EpochEnd, Stage, TrainBegin, TrainEnd
from fitforge.core.services import Services
from fitforge.core.state import TrainState
from fitforge.exceptions import check_positive

_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32}  # a float's bits, by its size (8 and more: int64)


def fingerprint(loss: torch.Tensor | None, parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """``[bits of the loss as a float64, sum of every parameter's bits]``: two int64 on the device, computed there.

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
        loss_bits = loss.detach().reshape(()).to(device, torch.float64).view(torch.int64)
    return torch.stack([loss_bits, mixed])


class FingerprintHandler(TrainBegin, BatchEnd, EpochEnd, TrainEnd):
    """Every ``every`` training steps, a :func:`fingerprint` of the step's loss and of the parameters after its
    optimizer step, recorded in the run's ``manifest.json`` (``fingerprints``) for ``fitforge diff``, which names
    the first recorded step where two runs part (docs/reproducibility.md). Computed and kept on the device, read
    once an epoch, at its end (or when a checkpoint is saved, which reads the state anyway).

    Args:
        every: fingerprint the steps whose ``global_step`` (0-based) is a multiple of it. Each recorded step costs
            a pass over the parameters on the device and about 40 bytes of the manifest.
    """

    priority = Stage.METRICS  # after the optimizer step (Stage.STEP): the parameters it left
    main_rank_only = True  # the parameters are every rank's; the loss is rank 0's
    reads = ("estimator", "phase", "output", "global_step", "run")
    writes = ()

    def __init__(self, every: int = 10) -> None:
        check_positive("FingerprintHandler", "every", every)
        self.every = every
        self.recorded: list[list[Any]] = []  # [step, loss, parameters' fingerprint in hex], read
        self._steps: list[int] = []  # the steps of the fingerprints still on the device
        self._pending: list[torch.Tensor] = []

    def offer(self, services: Services) -> None:
        services.manifest_sections.append(self._section)

    def train_begin(self, state: TrainState) -> None:
        self.recorded, self._steps, self._pending = [], [], []

    def batch_end(self, state: TrainState) -> None:
        if state.global_step % self.every or state.output is None:
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
        values = torch.stack([value.to(self._pending[0].device) for value in self._pending]).tolist()
        for step, (loss_bits, parameters) in zip(self._steps, values):
            loss = struct.unpack("<d", struct.pack("<q", loss_bits))[0]
            self.recorded.append([step, loss, f"{parameters & 0xFFFF_FFFF_FFFF_FFFF:016x}"])
        self._steps, self._pending = [], []

    def _section(self) -> dict[str, Any]:
        return {"fingerprints": {"every": self.every, "steps": self.recorded}}

    def state_dict(self) -> dict:
        """The fingerprints so far (read now: the checkpoint being saved reads the state anyway)."""
        self._read()
        return {"every": self.every, "recorded": [list(entry) for entry in self.recorded]}

    def load_state_dict(self, state: dict) -> None:
        self.recorded = [list(entry) for entry in state.get("recorded", [])]

    def __repr__(self) -> str:
        return f"FingerprintHandler(every={self.every})"

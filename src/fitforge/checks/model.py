"""The model before a run: on the estimator's device, every trainable parameter held by an
optimizer (see :mod:`fitforge.checks.untrained`), and a precision the CPU runs fast."""

from __future__ import annotations

import logging
import platform

import torch
from torch import nn

from fitforge.checkpoint.load_weights import refuse_meta
from fitforge.checks.forward_errors import same_device
from fitforge.checks.untrained import warn_untrained
from fitforge.core.modules import tensors_of
from fitforge.core.state import EstimatorLike
from fitforge.exceptions import DeviceMismatchError

log = logging.getLogger("fitforge")
_NOTED: set[str] = set()  # the notes given in this process (each once)


def cpu_has_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (x86: AVX512-BF16 or AMX; other CPUs are not judged)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    checks = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(check() for check in checks if check is not None)


def note_slow_precision(estimator: EstimatorLike) -> None:
    """Once per process: bf16 autocast on a CPU without bfloat16 instructions, which torch emulates
    several times slower than float32."""
    if estimator.autocast_dtype is not torch.bfloat16 or estimator.device.type != "cpu" or "bf16" in _NOTED:
        return
    _NOTED.add("bf16")
    if not cpu_has_bf16():
        log.warning(
            "precision='bf16-mixed' on a CPU without bfloat16 instructions (AVX512-BF16 or AMX): torch emulates "
            "them, so training is likely several times slower than float32 (precision=None). Check a CPU with: "
            'python -c "import torch; print(torch.cpu._is_avx512_bf16_supported(), '
            'torch.cpu._is_amx_tile_supported())"'
        )


def check_placement(estimator: EstimatorLike, *nets: str) -> None:
    """The named nets (``"net"``, ``"val_net"``) must still be on the device the Estimator placed
    them on. Not under an engine that places them itself (FSDP, which may offload the shards)."""
    if not estimator.strategy.places_net:  # it may offload the shards, but gives none to the meta device
        if any(tensor.is_meta for tensor in tensors_of(estimator.net)):
            refuse_meta(estimator.net, "net")
        return
    checked: list[nn.Module] = []
    for name in nets:
        net = estimator.net if name == "net" else estimator.val_net
        if not any(net is other for other in checked):  # val_net is usually net itself
            check_devices(net, estimator.device, name)
            checked.append(net)


def check_trainable(estimator: EstimatorLike) -> None:
    """Once per fit, as ``requires_grad`` may have changed (freeze, fit, unfreeze, fit): warn of
    trainable parameters no optimizer holds (under FSDP the shards, held again by the units first),
    and make the engine's wrapper follow those that train now
    (:func:`~fitforge.distributed.ddp.follow_trainable`). One pass over the parameters."""
    estimator.strategy.prepare_fit(estimator)
    warn_untrained(estimator.net, estimator.optimizers)
    estimator.strategy.follow_trainable(estimator)


def check_devices(net: nn.Module, device: torch.device, argument: str) -> None:
    """Every parameter and buffer of ``net`` must be on ``device``, where the Estimator placed it (after a
    ``net.to(...)`` the forward fails, or trains a copy the optimizer never sees)."""
    if all(same_device(found, device) for found in {t.device for t in tensors_of(net)}):
        return  # every fit checks: the names (a slower walk of the modules) only for the error
    refuse_meta(net, argument)  # a net moved to the meta device has lost its values: moving it back cannot help
    for kind, named in (("parameter", net.named_parameters()), ("buffer", net.named_buffers())):
        for name, tensor in named:
            if not same_device(tensor.device, device):
                raise DeviceMismatchError(
                    f"{kind} {name!r} of {argument} is on {tensor.device}, but the estimator's device is {device}: "
                    f"the net was moved after the Estimator placed it (net.to(...), .cuda(), .cpu()); give the "
                    f"device to the Estimator instead (Estimator(..., device=...)), or move the net back: "
                    f"estimator.{argument}.to({str(device)!r})"
                )

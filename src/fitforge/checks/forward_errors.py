"""Explain an error the net raises on a run's first batch: which layer failed, what it received, and a
likely fix (a feature or channel count that does not match, tensors on different devices, data of
another dtype than the weights).

The layer is the innermost frame of the error's traceback whose ``self`` is a module of the net, so
nothing is hooked into the net and only a failure pays for the search; what the net itself received
is read in the same traceback (:func:`net_arguments`).
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Iterable
from types import CodeType, FrameType

import torch
from torch import nn

from fitforge.exceptions import DeviceMismatchError, ForwardError
from fitforge.losses.hints import dtype_name, spec

_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


# The frames of torch's Module.__call__: ``_wrapped_call_impl`` holds the arguments as the caller gave
# them, ``_call_impl`` after it the same names rebound to what the forward pre-hooks returned.
_MODULE_CALLS: frozenset[CodeType] = frozenset(
    getattr(nn.Module, name).__code__
    for name in ("_wrapped_call_impl", "_call_impl")
    if hasattr(getattr(nn.Module, name, None), "__code__")
)


def net_arguments(error: BaseException, net: nn.Module) -> tuple:
    """The positional then keyword arguments the outermost call of ``net`` in ``error``'s traceback gave
    its forward, as the pre-hooks left them (FSDP's mixed precision casts the input). () when that
    call is not in the traceback (an error from elsewhere, or ``net.forward(...)`` called)."""
    found: tuple | None = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code in _MODULE_CALLS and frame.f_locals.get("self") is net:
            arguments, keywords = frame.f_locals.get("args"), frame.f_locals.get("kwargs")
            if isinstance(arguments, tuple):
                found = arguments + (tuple(keywords.values()) if isinstance(keywords, dict) else ())
        elif found is not None:  # past the outermost call's frames: a nested call of the net is not it
            break
    return found or ()


def same_device(found: torch.device, device: torch.device) -> bool:
    """Whether a tensor on ``found`` is on ``device`` (``cuda`` without an index: the current one)."""
    if found.type != device.type:
        return False
    if device.index is None and device.type == "cuda":
        return found.index == torch.cuda.current_device()
    return device.index is None or found.index == device.index


def explain(
    error: RuntimeError, roots: Iterable[nn.Module], device: torch.device, called: nn.Module
) -> ForwardError | DeviceMismatchError | None:
    """A :class:`ForwardError` (:class:`DeviceMismatchError` for devices) naming the layer of ``roots``
    (the nets) that raised ``error``, else None. ``called``: the net the step called (its arguments
    are what "the net received"). Only a plain ``RuntimeError`` is explained: its subclasses (out of
    memory, CUDA errors, not implemented) mean something else."""
    if type(error) is not RuntimeError:
        return None
    names: dict[int, str] = {}
    for root in roots:
        for name, module in root.named_modules():
            names.setdefault(id(module), name)
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__) if id(frame.f_locals.get("self")) in names]
    if not frames:
        return None
    frame = frames[-1]
    module = frame.f_locals["self"]
    name = names[id(module)]
    received = _arguments(frame, module)
    data = [x for x in net_arguments(error, called) if isinstance(x, torch.Tensor)]
    # Which layer failed and what it received; what the net received too, when that was something else.
    shown = ", ".join(f"{argument}: {spec(value)}" for argument, value in received) or "no tensor"
    where = f"layer {name!r} ({_short(module)})" if name else f"the net's own forward ({_short(module)})"
    text = f"the net failed on the first batch in {where}, which received {shown}"
    if data and not any(value is x for _, value in received for x in data):
        text += "; the net received " + ", ".join(spec(x) for x in data)
    devices = _device_problem(module, received, device, str(error))
    if devices:
        return DeviceMismatchError(f"{text}; {devices}. Original error: {error}")
    hint = _size_hint(module, f"layer {name!r}" if name else "the net", received, data)
    if not hint and "type" in str(error).lower():  # torch's dtype errors say "dtype" or "scalar type"
        hint = _dtype_hint(module, received)
    return ForwardError(f"{text}{'; ' + hint if hint else ''}. Original error: {error}")


def _arguments(frame: FrameType, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors among the frame's arguments, except the module's own parameters and buffers."""
    info = inspect.getargvalues(frame)
    values = [(name, info.locals.get(name)) for name in info.args[1:]]
    if info.varargs:
        values += [(f"{info.varargs}[{i}]", v) for i, v in enumerate(info.locals.get(info.varargs, ()))]
    if info.keywords:
        values += list(info.locals.get(info.keywords, {}).items())
    own = {id(t) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))}
    return [(name, v) for name, v in values if isinstance(v, torch.Tensor) and id(v) not in own]


def _short(module: nn.Module) -> str:
    return f"{type(module).__name__}({' '.join(module.extra_repr().split())})"


def _device_problem(
    module: nn.Module, received: list[tuple[str, torch.Tensor]], device: torch.device, message: str
) -> str:
    """What lies on another device than ``device`` and how to fix it; "" when devices are not the problem."""
    own: list[tuple[str, torch.Tensor]] = [(f"parameter {n!r}", t) for n, t in module.named_parameters(recurse=False)]
    own += [(f"buffer {n!r}", t) for n, t in module.named_buffers(recurse=False)]
    stray = [(n, v) for n, v in vars(module).items() if isinstance(v, torch.Tensor)]
    if len({t.device for _, t in (*received, *own, *stray)}) < 2 and "device" not in message:
        return ""
    parts = [
        f"attribute {n!r} is a plain tensor on {t.device}, not a registered buffer, so placing the net on "
        f"{device} left it behind: register it in __init__ with self.register_buffer({n!r}, tensor) "
        "(persistent=False keeps it out of the state_dict)"
        for n, t in stray
        if not same_device(t.device, device)
    ]
    parts += [
        f"its {what} is on {t.device}: the net was moved after the Estimator placed it; move it back "
        f"with estimator.net.to({str(device)!r})"
        for what, t in own
        if not same_device(t.device, device)
    ]
    parts += [
        f"{n} is on {t.device}: move it to state.estimator.device in your BatchProcessor, or create "
        f"it on the device of the layer's input"
        for n, t in received
        if not same_device(t.device, device)
    ]
    if not parts:
        parts = [
            "a tensor made inside forward is on another device: create it on the input's device "
            "(e.g. torch.zeros(..., device=x.device)) or register it as a buffer"
        ]
    return f"its tensors are on different devices, and the estimator's device is {device}: " + "; ".join(parts)


def _size_hint(
    module: nn.Module, layer: str, received: list[tuple[str, torch.Tensor]], inputs: list[torch.Tensor]
) -> str:
    """The fix for a layer whose input size (features, channels) does not match its own; else ""."""
    if not received:
        return ""
    x = received[0][1]
    if isinstance(module, nn.Linear) and x.dim() >= 1:
        want, got, what, argument = module.in_features, x.shape[-1], "features", "in_features"
    elif isinstance(module, _CONVOLUTIONS) and x.dim() in (len(module.kernel_size) + 1, len(module.kernel_size) + 2):
        channel = x.dim() - len(module.kernel_size) - 1  # 1 in a batch, 0 for one unbatched sample
        want, got, what, argument = module.in_channels, x.shape[channel], "channels", "in_channels"
    elif isinstance(module, _BATCH_NORMS) and x.dim() >= 2:
        want, got, what, argument = module.num_features, x.shape[1], "channels", "num_features"
    else:
        return ""
    if want == got:
        return ""
    if any(x is data for data in inputs):
        return f"the data has {got} {what} but {layer} expects {want}: give it {argument}={got}, or check the data"
    return (
        f"{layer} expects {want} {what} but receives {got} from the layers before it: give it "
        f"{argument}={got}, or make the layers before it output {want}"
    )


def _dtype_hint(module: nn.Module, received: list[tuple[str, torch.Tensor]]) -> str:
    """The fix for data of another dtype than the layer's weights; else ""."""
    weights = {t.dtype for t in module.parameters(recurse=False)}
    if len(weights) != 1:
        return ""
    weight = dtype_name(weights.pop())
    other = sorted({dtype_name(t.dtype) for _, t in received} - {weight})
    if not other:
        return ""
    if weight in ("float16", "bfloat16"):
        return (
            f"its weights are {weight} but it received {', '.join(other)}: keep the net in float32 and ask for "
            "mixed precision with Estimator(precision='16-mixed' or 'bf16-mixed') instead of converting the net"
        )
    return (
        f"its weights are {weight} but it received {', '.join(other)}: convert the data, in the Dataset or with "
        f"x.to(torch.{weight})"
    )

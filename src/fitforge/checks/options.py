"""Resolution and checking of the Estimator's and fit's arguments, with errors that teach."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import torch
from torch import nn

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.optim.muon import muon

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], float]] = {
    "adam": (torch.optim.Adam, 1e-3),
    "adamw": (torch.optim.AdamW, 1e-3),
    "sgd": (torch.optim.SGD, 1e-2),
    "rmsprop": (torch.optim.RMSprop, 1e-2),
    "adagrad": (torch.optim.Adagrad, 1e-2),
}
OPTIMIZER_NAMES = (*OPTIMIZERS, "muon")  # muon: Muon and AdamW together (fitforge.optim.muon)


def resolve_device(device: Any) -> torch.device:
    """None picks CUDA when available, else CPU; an invalid or absent device is a clear error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise FitforgeTypeError(
            f"device must be None, a string such as 'cpu' or 'cuda:0', an int GPU index or a torch.device, "
            f"got {describe(device)}"
        )
    if isinstance(device, int):
        if device < 0:
            raise FitforgeValueError(f"device index must be a non-negative int, got {device}")
        device = f"cuda:{device}"
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise FitforgeValueError(
            f"device {device!r} is not a device name; expected 'cpu', 'cuda', 'cuda:<index>' or 'mps'"
        ) from err
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise FitforgeValueError(
                f"device {device!r} was requested but CUDA is not available on this machine; "
                "pass device='cpu', or device=None to pick the best available device"
            )
        if resolved.index is not None and resolved.index >= count:
            raise FitforgeValueError(f"device {device!r} does not exist: this machine has {count} CUDA device(s)")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise FitforgeValueError(f"device {device!r} was requested but MPS is not available; pass device='cpu'")
    return resolved


def _optimized_parameters(net: nn.Module) -> list[nn.Parameter]:
    """Every parameter of ``net``, frozen ones included (an optimizer skips a parameter without a
    gradient, so one unfrozen later trains with no new optimizer); an error when none trains."""
    params = list(net.parameters())
    if not any(p.requires_grad for p in params):
        raise FitforgeValueError(
            "net has no trainable parameters (none with requires_grad=True), so no optimizer can train it"
        )
    return params


def resolve_optimizers(optimizer: Any, net: nn.Module) -> list[torch.optim.Optimizer]:
    """An optimizer, a list of them, a name ('adam', 'sgd', ...) or None: Adam (lr 1e-3) over the
    net's parameters, or no optimizer for a net with none trainable (for evaluation and prediction)."""
    if optimizer is None:
        params = list(net.parameters())
        return [torch.optim.Adam(params, lr=1e-3)] if any(p.requires_grad for p in params) else []
    if isinstance(optimizer, str):
        if optimizer.lower() == "muon":  # two optimizers: Muon for the hidden matrices, AdamW for the rest
            _optimized_parameters(net)  # raises: nothing to train
            return muon(net)
        if optimizer.lower() not in OPTIMIZERS:
            raise FitforgeValueError(
                f"optimizer {optimizer!r} is not a known name; known: {', '.join(OPTIMIZER_NAMES)}, "
                "or pass a torch.optim.Optimizer instance"
            )
        cls, lr = OPTIMIZERS[optimizer.lower()]
        return [cls(_optimized_parameters(net), lr=lr)]  # type: ignore[call-arg]  # every class listed takes lr
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not items:
        raise FitforgeValueError("optimizer is an empty list; give at least one torch.optim.Optimizer")
    for item in items:
        if not isinstance(item, torch.optim.Optimizer):
            hint = f"; pass an instance: {item.__name__}(net.parameters(), lr=...)" if isinstance(item, type) else ""
            raise FitforgeTypeError(
                f"optimizer must be a torch.optim.Optimizer, a list of them, a name such as 'adam', or None, "
                f"got {describe(item)}{hint}"
            )
    # Several optimizers may train modules outside the net (a GAN's discriminator), but if none holds
    # a parameter of the net, the net never trains: usually an optimizer built for another model.
    own = {id(p) for p in net.parameters()}
    if not any(id(p) in own for item in items for group in item.param_groups for p in group["params"]):
        raise FitforgeValueError(
            "optimizer holds none of net's parameters, so net would never train; build it from this net: "
            "torch.optim.Adam(net.parameters(), ...)"
        )
    return items


def warn_default_optimizer(
    optimizers: list[torch.optim.Optimizer], net: nn.Module, wrapped: bool, entry: str
) -> list[torch.optim.Optimizer]:
    """Before ``entry`` (fit, lr_find) trains with the optimizer chosen for ``optimizer=None``: a
    warning, and the optimizers to train with (a net frozen when the Estimator was built gets its
    Adam now)."""
    if not optimizers:
        params = _optimized_parameters(net)  # raises: nothing to train
        if wrapped:  # the wrapper was made for a frozen net
            raise FitforgeValueError(
                "net was frozen when the Estimator was built with optimizer=None, and it is wrapped for several "
                "processes now: build the Estimator after unfreezing it, or pass optimizer=..."
            )
        optimizers = [torch.optim.Adam(params, lr=1e-3)]
    mantissa, exponent = f"{float(optimizers[0].param_groups[0]['lr']):e}".split("e")  # 1e-3, or set_lr's since
    lr = f"{float(mantissa):g}e{int(exponent)}"
    warnings.warn(
        f"{entry}: no optimizer given: using Adam(lr={lr}); pass Estimator(optimizer=...) to choose one",
        UserWarning,
        stacklevel=4,  # the user's call of fit or lr_find
    )
    return optimizers


def check_net(net: Any, argument: str = "net") -> nn.Module:
    if isinstance(net, type):
        raise FitforgeTypeError(f"{argument} got {describe(net)}; pass an instance: {net.__name__}()")
    if not isinstance(net, nn.Module):
        raise FitforgeTypeError(f"{argument} must be a torch.nn.Module, got {describe(net)}")
    return net


def check_duration(epochs: Any, batches: Any) -> None:
    """Exactly one of ``epochs``/``batches``, a positive int."""
    if (epochs is None) == (batches is None):
        raise FitforgeValueError(
            f"give exactly one of epochs or batches, got epochs={epochs!r} and batches={batches!r}"
        )
    name, value = ("epochs", epochs) if epochs is not None else ("batches", batches)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FitforgeTypeError(f"{name} must be a positive int, got {describe(value)}")
    if value < 1:
        raise FitforgeValueError(f"{name} must be a positive int, got {value}")


PRECISIONS = {None: None, "32": None, "32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def resolve_precision(precision: Any, device: torch.device) -> tuple[torch.dtype | None, Any]:
    """``(autocast dtype or None, GradScaler or None)`` for a precision name: ``"bf16-mixed"`` (no
    scaler: bfloat16 has float32's range), ``"16-mixed"`` (a GradScaler, so small gradients do not
    underflow), or full precision (``None``/``"32"``)."""
    key = precision.lower() if isinstance(precision, str) else precision
    if key is None or (isinstance(key, str) and key in PRECISIONS):
        dtype = PRECISIONS[key]
        return dtype, torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
    names = ", ".join(repr(k) for k in PRECISIONS if k is not None)
    raise FitforgeValueError(f"precision must be None or one of {names}, got {precision!r}")


def compile_net(net: nn.Module, options: Any) -> nn.Module:
    """Compile ``net.forward`` with ``torch.compile(**options)`` (``options`` True or a dict), falling
    back to eager with a warning. Only the instance's ``forward`` is replaced (by a :class:`CompiledForward`),
    so the module and its ``state_dict`` keys (and so checkpoints) stay those of the eager net."""
    if options is False or options is None:
        return net
    if options is not True and not isinstance(options, dict):
        raise FitforgeTypeError(
            f"compile must be True, False or a dict of torch.compile arguments, got {describe(options)}"
        )
    net.forward = CompiledForward(net, {} if options is True else dict(options))
    return net


class CompiledForward:
    """A module's ``forward`` through ``torch.compile``, compiled at its first call. An object holding the
    module, not a closure: a ``deepcopy`` of the net (an average, a teacher) compiles and runs its own copy,
    and the net pickles (without what was compiled)."""

    fitforge_compiled = True  # its first steps compile (core.clock.RunClock)

    def __init__(self, module: nn.Module, options: dict[str, Any]) -> None:
        self.module, self.options = module, options
        self._compiled: Any = None

    def __call__(self, *args: Any, **kw: Any) -> Any:
        eager = partial(type(self.module).forward, self.module)
        if self._compiled is None:
            self._compiled = torch.compile(eager, **self.options)
        try:
            return self._compiled(*args, **kw)
        except torch._dynamo.exc.TorchDynamoException as err:  # compiling failed, not the model
            warnings.warn(
                f"torch.compile could not compile {type(self.module).__name__} ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); running it eagerly",
                UserWarning,
                stacklevel=2,
            )
            del self.module.forward  # the class's own forward again, for every later call
            return eager(*args, **kw)

    def __getstate__(self) -> dict[str, Any]:
        return {"module": self.module, "options": self.options, "_compiled": None}  # a copy compiles its own

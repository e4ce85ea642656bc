"""Muon for a net's hidden matrices, AdamW for the rest: :func:`muon`, what ``Estimator(optimizer="muon")`` builds.

Muon orthogonalises each update of a 2-D weight (Newton-Schulz iterations on its momentum), which suits the
matrices inside a network; embeddings, the output head, norms, biases and convolution kernels keep AdamW (Muon's
authors' advice, and ``torch.optim.Muon`` takes only 2-D parameters).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def muon_routing(net: nn.Module, adamw: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """``(names for Muon, names for AdamW)``: the parameters of ``net`` by name, each once (a tied weight under
    its first name). Muon gets the 2-D weights but those of an embedding, of the output head (the last
    ``nn.Linear`` the net registers) and of the modules or parameters named in ``adamw`` (a name or its
    prefix: ``"lm_head"``, ``"blocks.0.attn"``)."""
    kept = _checked_names(adamw)
    modules = dict(net.named_modules())
    linears = [name for name, module in modules.items() if isinstance(module, nn.Linear)]
    head = linears[-1:]  # the last Linear registered: a classifier's or a language model's head
    outside = {
        id(parameter)
        for name, module in modules.items()
        if isinstance(module, _EMBEDDINGS) or name in head
        for parameter in module.parameters(recurse=False)
    }
    hidden: list[str] = []
    rest: list[str] = []
    for name, parameter in net.named_parameters():  # each parameter once, under its first name
        named = any(name == prefix or name.startswith(prefix + ".") for prefix in kept)
        matrix = parameter.ndim == 2 and id(parameter) not in outside and not named
        (hidden if matrix else rest).append(name)
    unmatched = [prefix for prefix in kept if not any(n == prefix or n.startswith(prefix + ".") for n in hidden + rest)]
    if unmatched:
        raise FitforgeValueError(
            f"muon: adamw names {unmatched}, which match no parameter of the net; give names or prefixes of "
            f"net.named_parameters(), e.g. {next(iter(dict(net.named_parameters())), 'fc.weight')!r}"
        )
    return hidden, rest


def muon(
    net: nn.Module,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    betas: tuple[float, float] = (0.9, 0.95),
    adamw: Iterable[str] = (),
) -> list[torch.optim.Optimizer]:
    """``[Muon over the hidden matrices, AdamW over the rest]`` (:func:`muon_routing`), for
    ``Estimator(optimizer=muon(net, ...))``; ``Estimator(optimizer="muon")`` is ``muon(net)``.

    Both step every batch at the same ``lr``: Muon scales its orthogonalised update to AdamW's size
    (``adjust_lr_fn="match_rms_adamw"``), so one learning rate and one schedule serve both. Needs
    ``torch.optim.Muon`` (torch 2.9 or later).

    Args:
        net: the model; frozen parameters are routed too (an optimizer skips one without a gradient).
        lr: both optimizers' learning rate.
        weight_decay: both optimizers' decoupled weight decay.
        momentum: Muon's momentum (Nesterov).
        betas: AdamW's betas.
        adamw: names or prefixes of parameters that keep AdamW although they are 2-D matrices (a head the
            net does not register last).
    """
    if not hasattr(torch.optim, "Muon"):
        raise ImportError(f"muon needs torch.optim.Muon, added in torch 2.9; this is torch {torch.__version__}")
    if not isinstance(net, nn.Module):
        raise FitforgeTypeError(f"muon: net must be a torch.nn.Module, got {describe(net)}")
    hidden, rest = muon_routing(net, adamw)
    if not hidden:
        raise FitforgeValueError(
            "muon: the net has no hidden 2-D weight for Muon (only embeddings, its head, norms, biases or "
            "kernels): use optimizer='adamw'"
        )
    parameters = dict(net.named_parameters())
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.Muon(
            [parameters[name] for name in hidden],
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            adjust_lr_fn="match_rms_adamw",
        )
    ]
    if rest:
        optimizers.append(
            torch.optim.AdamW([parameters[name] for name in rest], lr=lr, betas=betas, weight_decay=weight_decay)
        )
    return optimizers


def _checked_names(adamw: Iterable[str]) -> list[str]:
    if isinstance(adamw, str):
        return [adamw]
    names = list(adamw)
    if not all(isinstance(name, str) and name for name in names):
        raise FitforgeTypeError(f"muon: adamw must be parameter names or prefixes (str), got {describe(names)}")
    return names

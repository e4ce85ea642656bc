"""Muon for a net's hidden matrices, AdamW for the rest: :func:`muon`, what ``Estimator(optimizer="muon")`` builds.

Muon orthogonalises each update of a 2-D weight (Newton-Schulz iterations on its momentum), which suits the
matrices inside a network; embeddings, the output head, norms, biases and convolution kernels keep AdamW (Muon's
authors' advice, and ``torch.optim.Muon`` takes only 2-D parameters).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe

log = logging.getLogger("fitforge")
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def muon_routing(net: nn.Module, adamw: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """``(names for Muon, names for AdamW)``: the parameters of ``net`` by name, each once (a tied weight under
    its first name). Muon gets the weights of the linear layers (``nn.Linear``, and ``transformers``' GPT-2
    ``Conv1D``) but the output head's (the last linear layer the net registers) and those of the modules or
    parameters named in ``adamw`` (a name or its prefix: ``"lm_head"``, ``"blocks.0.attn"``); AdamW the rest:
    embeddings, other 2-D parameters (a position table), norms, biases, kernels."""
    kept = _checked_names(adamw)
    modules = dict(net.named_modules())
    linears = [name for name, module in modules.items() if _linear(module)]
    head = linears[-1:]  # the last linear layer registered: a classifier's or a language model's head
    embedded = {id(p) for m in modules.values() if isinstance(m, _EMBEDDINGS) for p in m.parameters(recurse=False)}
    matrices = {
        id(module.weight)
        for name, module in modules.items()
        if name in linears and name not in head and id(module.weight) not in embedded  # a weight tied to one
    }
    hidden: list[str] = []
    rest: list[str] = []
    for name, parameter in net.named_parameters():  # each parameter once, under its first name
        matrix = parameter.ndim == 2 and id(parameter) in matrices and not _named(name, kept)
        (hidden if matrix else rest).append(name)
    unmatched = [prefix for prefix in kept if not any(_named(n, [prefix]) for n in hidden + rest)]
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
            "muon: the net has no hidden linear layer for Muon (only embeddings, its head, norms, biases or "
            "kernels): use optimizer='adamw'"
        )
    parameters = dict(net.named_parameters())
    log.info(
        "muon: Muon for %d matrices (%s), AdamW for %d other parameters (%s)",
        len(hidden),
        _listed(hidden),
        len(rest),
        _listed(rest),
    )
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.Muon(
            [parameters[name] for name in hidden],
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            adjust_lr_fn="match_rms_adamw",
        )
    ]
    if rest:  # norms' and biases' (fewer than 2 dimensions) without weight decay, as nanoGPT and HF's Trainer do
        decayed = [parameters[name] for name in rest if parameters[name].ndim >= 2]
        kept_whole = [parameters[name] for name in rest if parameters[name].ndim < 2]
        groups: list[dict[str, Any]] = [{"params": decayed}, {"params": kept_whole, "weight_decay": 0.0}]
        optimizers.append(
            torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, weight_decay=weight_decay)
        )
    return optimizers


def _linear(module: nn.Module) -> bool:
    """A linear layer: ``nn.Linear``, or ``transformers``' ``Conv1D`` (GPT-2's, a Linear with its weight
    transposed)."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def _named(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _listed(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names) - most} more)" if len(names) > most else "")


def _checked_names(adamw: Iterable[str]) -> list[str]:
    if isinstance(adamw, str):
        return [adamw]
    names = list(adamw)
    if not all(isinstance(name, str) and name for name in names):
        raise FitforgeTypeError(f"muon: adamw must be parameter names or prefixes (str), got {describe(names)}")
    return names

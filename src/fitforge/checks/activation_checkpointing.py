"""``Estimator(activation_checkpointing=Block)``: each ``Block`` of the net keeps none of its activations for the
backward, which runs its forward again (``torch.utils.checkpoint``, non-reentrant): memory for time.

Only the instances' ``forward`` is replaced (as ``compile`` does), so the modules, their ``state_dict`` keys
and checkpoints are those of the plain net, and an engine wraps or shards the blocks as it would (FSDP2 unshards
a block's parameters before its backward, which is when the forward runs again). The random state is replayed
(dropout draws the same masks), so the loss and the gradients are those of the plain net, bitwise on the CPU.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe


def checkpoint_activations(net: nn.Module, blocks: Any) -> nn.Module:
    """Make each module of ``net`` of the classes ``blocks`` (a class or a tuple of them; None: none)
    recompute its forward in the backward. A clear error when ``net`` has no such module."""
    if blocks is None:
        return net
    classes = blocks if isinstance(blocks, tuple) else (blocks,)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise FitforgeTypeError(
            "activation_checkpointing must be a module class (e.g. the transformer block's) or a tuple of them, "
            f"got {describe(blocks)}"
        )
    found = [module for module in net.modules() if isinstance(module, classes) and module is not net]
    if not found:
        present = sorted({type(m).__name__ for m in net.modules()})
        raise FitforgeValueError(
            f"activation_checkpointing: the net holds no {' or '.join(c.__name__ for c in classes)} below its root; "
            f"its module classes: {', '.join(present)}"
        )
    for module in found:
        if not isinstance(vars(module).get("forward"), Recomputed):
            module.forward = Recomputed(module)
    return net


class Recomputed:
    """A module's ``forward`` that keeps no activation for the backward. An object holding the module, not a
    closure: a ``deepcopy`` of the net (an average, a teacher) gets one that runs the copy, and the net pickles."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = partial(type(self.module).forward, self.module)
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

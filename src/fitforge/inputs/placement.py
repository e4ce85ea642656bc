"""One order of an epoch's samples for every number of ranks, so that a run can go on from any sample.

The order of epoch ``e`` is a permutation ``P`` of the dataset's ``N`` indices: ``0, 1, ..., N - 1``
unshuffled, else ``torch.randperm(N)`` from a generator seeded with ``order_seed + e``, as a
``RandomSampler`` given it draws in one process and a ``DistributedSampler`` of seed ``order_seed``
on every rank (fitforge seeds both so, see :mod:`fitforge.inputs.order`).

On ``W`` ranks with ``b`` samples per rank's batch, step ``t`` of an epoch trains the samples
``P[t W b : (t + 1) W b]``; rank ``r`` takes those at positions ``r, r + W, r + 2 W, ...`` of that
slice (``DistributedSampler``'s split). After ``S`` samples, on any number of ranks ``M`` and with any
batch size, the rest of the epoch is ``R = P[S:]`` split the same way: rank ``r`` takes
``R[r], R[r + M], ...``, in batches of its batch size, where ``R`` is first padded to a multiple of
``M`` with the epoch's first samples, as ``DistributedSampler`` pads (so when ``N - S`` is not a
multiple of ``M``, up to ``M - 1`` samples are trained twice, as in any epoch on ``M`` ranks). From
``S = 0`` this is the epoch itself, on every number of ranks.
"""

from __future__ import annotations

import math

import torch


def epoch_permutation(size: int, shuffled: bool, order_seed: int, epoch: int) -> list[int]:
    """The order ``P`` of epoch ``epoch`` over ``size`` samples (module docstring)."""
    if not shuffled:
        return list(range(size))
    generator = torch.Generator()
    generator.manual_seed(order_seed + epoch)
    return torch.randperm(size, generator=generator).tolist()


def rank_remainder(permutation: list[int], start: int, world: int, rank: int) -> list[int]:
    """Rank ``rank`` of ``world``'s samples of the epoch after its first ``start`` (module docstring)."""
    rest = permutation[start:]
    padding = -len(rest) % world
    if rest and padding:
        rest += (permutation * math.ceil(padding / len(permutation)))[:padding]
    return rest[rank::world]

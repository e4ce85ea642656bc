"""One order of an epoch's samples for every number of ranks, so that a run can go on from any sample
(the rules: docs/distributed.md, "One order for every number of ranks").

The order ``P`` of epoch ``e`` is ``0, 1, ..., N - 1`` unshuffled, else ``torch.randperm(N)`` from a
generator seeded with ``order_seed + e``, as a ``RandomSampler`` and a ``DistributedSampler`` of seed
``order_seed`` draw it (:mod:`fitforge.inputs.order` seeds both so). After ``S`` samples, on ``M``
ranks, rank ``r`` takes ``R[r], R[r + M], ...`` of ``R = P[S:]``, padded to a multiple of ``M`` with
the epoch's first samples as ``DistributedSampler`` pads; from ``S = 0`` this is the epoch itself.
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

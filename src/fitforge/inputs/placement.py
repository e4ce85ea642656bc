"""One order of an epoch's samples for every number of ranks, so that a run can go on from any sample
(docs/distributed.md, "One order for every number of ranks")."""

from __future__ import annotations

import math

import torch


def epoch_permutation(size: int, shuffled: bool, order_seed: int, epoch: int) -> list[int]:
    """The order of epoch ``epoch`` over ``size`` samples, as a seeded ``RandomSampler`` draws it."""
    if not shuffled:
        return list(range(size))
    generator = torch.Generator()
    generator.manual_seed(order_seed + epoch)
    return torch.randperm(size, generator=generator).tolist()


def rank_remainder(permutation: list[int], start: int, world: int, rank: int) -> list[int]:
    """Rank ``rank`` of ``world``'s samples after the first ``start``, padded as ``DistributedSampler`` pads."""
    rest = permutation[start:]
    padding = -len(rest) % world
    if rest and padding:
        rest += (permutation * math.ceil(padding / len(permutation)))[:padding]
    return rest[rank::world]

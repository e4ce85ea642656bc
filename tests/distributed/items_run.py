"""Run under torchrun: each rank accumulates its own 2 of 4 tagged batches of different padded
lengths (GradientUpdateHandler(accumulate=2): one step for the 4), and writes OUT/result-rank<r>.json
with the final weights. Also importable: the net and the batches, for the one-process reference."""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

PAD, VOCAB, CLASSES = -100, 11, 5
LENGTHS = [(3, 1), (9, 4), (5, 5), (7, 2)]  # per batch of 2 sequences: padded length, real tokens of the 2nd


class Tagger(nn.Module):
    """One class per token, each from its own token alone: padding changes no other position."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(VOCAB, 8), nn.Linear(8, CLASSES)

    def forward(self, tokens):
        return self.out(self.embed(tokens)).permute(0, 2, 1)  # (N, C, L), as CrossEntropyLoss takes it


def tagged_batches():
    generator = torch.Generator().manual_seed(1)
    batches = []
    for length, real in LENGTHS:
        tokens = torch.randint(0, VOCAB, (2, length), generator=generator)
        tags = torch.randint(0, CLASSES, (2, length), generator=generator)
        tags[1, real:] = PAD
        batches.append((tokens, tags))
    return batches


def estimator_of(net):
    from fitforge import Estimator

    loss = nn.CrossEntropyLoss(ignore_index=PAD)
    return Estimator(net, loss, device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.5))


def main() -> None:
    import logging

    from fitforge.handlers import GradientUpdateHandler

    logging.getLogger("fitforge").setLevel(logging.ERROR)  # each rank's share of a list: not split, by design
    out, rank, world = Path(sys.argv[1]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    net = Tagger()
    mine = tagged_batches()[rank::world]  # the process group starts with the fit: torchrun's variables say who is who
    estimator_of(net).fit(mine, epochs=1, event_handlers=[GradientUpdateHandler(accumulate=2)], default_handlers=False)
    weights = {name: value.tolist() for name, value in net.state_dict().items()}
    (out / f"result-rank{rank}.json").write_text(json.dumps(weights))


if __name__ == "__main__":
    main()

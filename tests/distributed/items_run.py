"""Run under torchrun: each rank accumulates its own 2 of 4 tagged batches of different padded
lengths (GradientUpdateHandler(accumulate=2): one step for the 4), and writes OUT/result-rank<r>.json
with the final weights. Also importable: the estimator, for the one-process reference."""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for its helpers when run by torchrun
from helpers import PAD, Tagger, tagged_batches


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

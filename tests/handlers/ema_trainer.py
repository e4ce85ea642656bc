"""A tiny run with an EMAHandler for tests/handlers/test_ema.py, in its own process:

    python ema_trainer.py FOLDER OUT [KILL_AT]

It resumes from FOLDER's newest checkpoint (saved every 4 batches), SIGKILLs itself at the end of
global step KILL_AT (after that batch's save, if any), and writes the averaged and the raw weights
to OUT."""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.handlers import CheckpointHandler, EMAHandler
from helpers import KillAt


def main(folder, out, kill_at=None):
    torch.manual_seed(0)
    X = torch.randn(80, 6)
    y = (X[:, 0] > 0).long()
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer, device="cpu")
    data = DataLoader(TensorDataset(X, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    ema = EMAHandler(decay=0.9)
    handlers = [ema, CheckpointHandler(folder, batch_period=4, resume_from_checkpoint=True)]
    if kill_at is not None:
        handlers.append(KillAt(kill_at))
    estimator.fit(data, epochs=3, event_handlers=handlers)  # 10 batches an epoch
    torch.save({"averaged": ema.averaged_state_dict(), "raw": net.state_dict(), "updates": ema.updates}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)

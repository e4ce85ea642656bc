"""A fit whose DataLoader workers each get SIGTERM, SIGUSR1 and SIGINT from another process (``kill``)
at their first sample, then the interpreter's exit: prints "trained" and "exits", and must end by
itself (a shielded worker left alive at exit would hang multiprocessing's join).

Usage: worker_shield_run.py START_METHOD PERSISTENT(0|1) [preload]"""

import multiprocessing
import subprocess
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info

from fitforge import Estimator

X, Y = torch.randn(32, 6, generator=torch.Generator().manual_seed(0)), torch.randint(0, 3, (32,))


class SignalledInWorkers(Dataset):
    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, i: int):
        worker = get_worker_info()
        if worker is not None and not getattr(worker.dataset, "signalled", False):
            worker.dataset.signalled = True
            import os

            for name in ("TERM", "USR1", "INT"):
                subprocess.run(["kill", "-s", name, str(os.getpid())], check=True)
        return X[i], Y[i]


if __name__ == "__main__":
    method, persistent = sys.argv[1], sys.argv[2] == "1"
    context = multiprocessing.get_context(method)
    if "preload" in sys.argv[3:]:
        context.set_forkserver_preload(["torch", "fitforge"])
    train = DataLoader(
        SignalledInWorkers(),
        batch_size=8,
        num_workers=2,
        multiprocessing_context=context,
        persistent_workers=persistent,
    )
    estimator = Estimator(nn.Linear(6, 3), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    history = estimator.fit(train, epochs=2, default_handlers=False)
    print("trained", len(history["epoch_time"]), flush=True)
    print("exits", flush=True)

"""A fit tracked by MLflow (SQLite), TensorBoard and W&B (offline) at once, resuming from the newest
checkpoint in DIR, for tests/reliability/test_tracker_kill9.py; run in its own process.

    python tracker_trainer.py DIR --epochs N [--hang-after K] [--flush-secs S]

Every line it prints is JSON, flushed: ``{"wrote": owner, "records": n}`` for each write of a
tracker's background thread (their DEBUG lines), ``{"epoch": e, "mlflow": id, "wandb": id}`` at each
epoch end, after the trackers'. With ``--hang-after K`` it blocks at the end of epoch K (after the
checkpoint) until it is killed, while the trackers' threads go on."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path

import torch

from fitforge.handlers import CheckpointHandler, LambdaHandler, MLflowHandler, TensorBoardHandler, WandbHandler
from fitforge.testing import linear_problem

_SAYING = threading.Lock()  # lines come from the training thread and the trackers' threads


def say(**values) -> None:
    with _SAYING:
        sys.stdout.write(json.dumps(values) + "\n")
        sys.stdout.flush()


class Writes(logging.Handler):
    """The trackers' ``<owner>: wrote <n> record(s)`` lines, as JSON on stdout."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "%s: wrote %d record(s)":
            owner, records = record.args
            say(wrote=owner, records=records)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir", type=Path)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--hang-after", type=int, default=0)
    parser.add_argument("--flush-secs", type=float, default=0.2)
    args = parser.parse_args()
    fitforge_log = logging.getLogger("fitforge")
    fitforge_log.addHandler(Writes())
    fitforge_log.setLevel(logging.DEBUG)
    folder, flush = args.dir, args.flush_secs
    trackers = [
        MLflowHandler(f"sqlite:///{folder}/mlflow.db", experiment_name="kill9", flush_secs=flush),
        TensorBoardHandler(folder / "tb", flush_secs=flush),
        WandbHandler(project="kill9", dir=str(folder), flush_secs=flush),
    ]

    def epoch_end(state) -> None:
        epoch = state.history.epochs
        say(epoch=epoch, mlflow=trackers[0].run_id, wandb=trackers[2].run_id)
        if epoch == args.hang_after:
            threading.Event().wait()  # until killed; the trackers' threads write meanwhile

    torch.manual_seed(0)
    estimator, train, _ = linear_problem()
    saver = CheckpointHandler(folder / "ckpt", resume_from_checkpoint=True)
    hang = LambdaHandler(epoch_end=epoch_end, priority=2000)  # after the trackers (Stage.REPORT)
    estimator.fit(train, epochs=args.epochs, event_handlers=[saver, *trackers, hang])
    sys.exit(0)


if __name__ == "__main__":
    main()

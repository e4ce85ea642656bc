"""A tiny deterministic training run for the fault-injection tests, run in its own process.

    python trainer.py --dir DIR --journal LOG [--out OUT] [--epochs 4] [--workers 0] [--async-save] [--fault SPEC]
                      [--val SECONDS] [--val-workers N] [--fault-rank R] [--augment]

It always resumes from the newest loadable checkpoint in DIR (a folder, or an object-store URL such
as ``s3://bucket/run``), as a re-run of a crashed job would.
LOG gets one JSON line per event, each written with a single unbuffered ``os.write`` so that a
SIGKILL loses none: ``start`` (what train_begin found), ``step`` (each completed batch's loss as
``float.hex``), ``fault`` (written right before the fault is injected, with its time), ``committed``
(a checkpoint file committed: its name and time) and ``end``; with ``--val``, ``val`` (each
validation that completed: the batches completed before it and its loss). OUT gets the final
weights (``torch.save(net.state_dict())``). ``--val SECONDS`` adds a validation whose batches take
SECONDS each (see validating.py). Under torchrun each rank writes LOG.rank<r> (and OUT.rank<r>),
and ``--fault-rank R`` injects the fault on rank R only. ``--augment`` reads the samples through a
map-style dataset that adds random noise (torch's generator, and Python's ``random`` seeded from it, as
docs/data-at-scale.md shows) in ``__getitem__``.

Faults are scheduled by training progress, never by time. SPEC is one of:
    kill@begin:S  kill@end:S      SIGKILL at batch_begin / batch_end of global step S (0-based)
    term@begin:S  term@end:S      SIGTERM there (fit stops cleanly at the batch boundary, exit 143)
    term@epoch_end:S              SIGTERM at the epoch end reached after S batches, after the
                                  CheckpointHandler's epoch_end
    term@train_begin              SIGTERM in train_begin, after CheckpointHandler's (its checkpoint is
                                  loaded, and fit resumes from it before stopping)
    term@val:S  usr1@val:S        SIGTERM / SIGUSR1 in the second batch of the validation after S
                                  completed batches (with --val; with --val-workers, in worker 0's)
    termpg@... usr1pg@...         as term@... and usr1@..., sent to the whole process group (DataLoader
                                  workers included) by another process, as a scheduler sends it
    term@check                    SIGTERM in the check before training, as it reads the first validation
                                  sample (with --val)
    term@epoch_hook:S             SIGTERM in an epoch_end hook at the user's priority (after validation,
                                  before the CheckpointHandler's), at the epoch end after S batches
    tear:N                        the N-th checkpoint write stops half way (flushed, fsynced), SIGKILL
    enospc:N                      the N-th checkpoint write fails half way with ENOSPC
    upload-kill:N                 the N-th upload to an object store puts the whole object under its
                                  name, then SIGKILL before its commit marker
    upload-tear:N                 the same, with only the first half of the object's bytes uploaded
    save-kill:B:P                 in the write of the checkpoint after B batches (in the background
                                  with --async-save), SIGKILL once P per mille of its bytes are in
                                  its temporary file (flushed)
    save-kill:B:committed         SIGKILL right after that checkpoint is committed, before the rotation
    train-kill:S:P                the write of the checkpoint after S batches stops after P per mille
                                  of its bytes and stays in flight; the training thread SIGKILLs at
                                  batch_begin of step S (a kill while a background save is in flight)
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import logging
import os
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from validating import rank_suffix, validation

from fitforge import Estimator
from fitforge.checkpoint.folder import CheckpointFolder
from fitforge.events import BatchBegin, BatchEnd, EpochEnd, TrainBegin
from fitforge.handlers import CheckpointHandler, LambdaHandler

SAMPLES, BATCH_SIZE = 64, 8  # 8 batches an epoch
BATCH_PERIOD, EPOCH_PERIOD, MAX_CHECKPOINTS = 3, 1, 3  # saves after 3, 6, [8], 9, 12, 15, [16], 18... batches
real_save = torch.save  # the outputs are written with it even when a fault replaces torch.save
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "usr1": signal.SIGUSR1}
GROUP = "pg"  # termpg@..., usr1pg@...: the signal goes to the whole process group, from another process


class Augmented(Dataset):
    """The samples with a random shift drawn in ``__getitem__``, in whatever process reads them."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.5 * torch.randn(10) + random.Random(torch.initial_seed()).random(), self.y[index]


class Journal:
    """LOG, appended one whole line per write(2): a SIGKILL right after still leaves it on disk."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, **entry) -> None:
        os.write(self.fd, (json.dumps(entry) + "\n").encode())


MANIFEST = "manifest.json"  # the run's, beside its checkpoints


def checkpoint_names(folder: str) -> list[str]:
    """The names in a folder, or in an object-store folder (listed afresh: fsspec caches listings), the run's
    manifest aside."""
    if "://" not in folder:
        return sorted(p.name for p in Path(folder).iterdir() if p.name != MANIFEST) if Path(folder).exists() else []
    from fsspec.core import url_to_fs

    fs, key = url_to_fs(folder)
    fs.invalidate_cache()
    names = [entry.rsplit("/", 1)[-1] for entry in fs.ls(key, detail=False)] if fs.exists(key) else []
    return sorted(name for name in names if name != MANIFEST)


class Recorder(TrainBegin, BatchBegin, BatchEnd, EpochEnd):
    """Logs every completed batch's loss and injects a kill or a SIGTERM at its step.

    Priority 950: after CheckpointHandler (900), so at batch_end and epoch_end the checkpoint of
    this step, if any, is already on disk when the fault comes."""

    priority = 950

    def __init__(self, journal: Journal, folder: str, fault: str, here: bool = True) -> None:
        self.journal, self.folder, self.fault = journal, folder, fault
        self.signal = self.where = self.at = None
        if fault.startswith("train-kill:") and here:  # batch_begin of step S, once that save is in flight
            self.signal, self.where, self.at = signal.SIGKILL, "begin", int(fault.split(":")[1])
        self.group = False
        if fault.startswith(("kill@", "term@", "usr1@", "termpg@", "usr1pg@")) and here:  # here: the fault's rank
            action, place = fault.split("@")
            self.group = action.endswith(GROUP)
            self.signal = SIGNALS[action.removesuffix(GROUP)]
            self.where, _, at = place.partition(":")
            self.at = int(at) if at else None

    def inject(self, completed: int) -> None:
        # The marker: proof that the fault fired, with the folder as it is at that instant.
        files = checkpoint_names(self.folder)
        self.journal.write(event="fault", spec=self.fault, completed=completed, files=files, t=time.time())
        if self.group:  # as a scheduler does: DataLoader workers included, sent by a process not their parent
            subprocess.run(["kill", "-s", self.signal.name[3:], "--", f"-{os.getpgid(0)}"], start_new_session=True)
        else:
            os.kill(os.getpid(), self.signal)

    def train_begin(self, state) -> None:
        # After CheckpointHandler's train_begin: the leftovers are cleaned and the checkpoint chosen.
        saver = next(h for h in state.services.checkpoints if isinstance(h, CheckpointHandler))
        resumed = saver.resumed_from  # named <prefix>-epoch<E>batch<B>.pt: B batches completed
        self.journal.write(
            event="start",
            files=checkpoint_names(self.folder),
            resume_step=None if resumed is None else int(re.search(r"batch(\d+)", resumed.name)[1]),
        )
        if self.where == "train_begin":
            self.inject(0)

    def batch_begin(self, state) -> None:
        if self.where == "begin" and state.global_step == self.at:
            if self.fault.startswith("train-kill:"):  # the save before this batch is written in part, and held
                assert IN_FLIGHT.wait(timeout=60), "the save to kill during never started"
            self.inject(state.global_step)  # a kill loses this batch; a SIGTERM lets it finish

    def batch_end(self, state) -> None:
        self.journal.write(step=state.global_step, loss=state.output.loss.item().hex())
        if self.where == "end" and state.global_step == self.at:
            self.inject(state.global_step + 1)

    def epoch_end(self, state) -> None:
        if self.where == "epoch_end" and state.global_step == self.at:
            self.inject(state.global_step)

    def in_epoch_hook(self, state) -> None:
        if self.where == "epoch_hook" and state.global_step == self.at:
            self.inject(state.global_step)
            time.sleep(0.5)  # the hook goes on a while after the signal came


def journal_commits(journal: Journal) -> None:
    """A ``committed`` line, timed, once each checkpoint file is committed (renamed into place)."""
    commit = CheckpointFolder.commit

    def committed(self, checkpoint, path, *args, **kwargs):
        commit(self, checkpoint, path, *args, **kwargs)
        journal.write(event="committed", name=path.name, t=time.time())

    CheckpointFolder.commit = committed


def break_checkpoint_writes(spec: str, journal: Journal) -> None:
    """Replace torch.save as fitforge.checkpoint.files calls it: the N-th call writes half of its
    bytes to the temporary file, then the process is killed (tear) or the write fails (enospc)."""
    kind, number = spec.split(":")
    calls = {"n": 0}

    def save(obj, file, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] < int(number):
            return real_save(obj, file, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        file.write(data[: len(data) // 2])
        file.flush()
        os.fsync(file.fileno())
        temp = os.readlink(f"/proc/self/fd/{file.fileno()}")
        journal.write(event="fault", spec=spec, temp=temp, written=len(data) // 2, size=len(data))
        if kind == "tear":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    torch.save = save  # fitforge.checkpoint.files.torch is this torch module


IN_FLIGHT = threading.Event()  # train-kill: the held save has written its part


def kill_during_saves(spec: str, journal: Journal) -> None:
    """Replace torch.save as fitforge.checkpoint.files calls it (and the commit as storage calls
    it), so that the write of the checkpoint after B batches is killed part way, or right after its
    commit, or held part way for the training thread to kill (see the module docstring)."""
    from fitforge.checkpoint import storage

    kind, step, stage = spec.split(":")
    target = int(step)

    def save(obj, file, *args, **kwargs):
        if obj.get("global_step") != target or stage == "committed":
            return real_save(obj, file, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        written = len(data) * int(stage) // 1000
        file.write(data[:written])
        file.flush()
        # train-kill: the fault is the training thread's kill, which the Recorder journals; this is its setup
        journal.write(
            event="held" if kind == "train-kill" else "fault",
            spec=spec,
            thread=threading.current_thread().name,
            written=written,
            size=len(data),
        )
        if kind == "train-kill":
            IN_FLIGHT.set()
            threading.Event().wait()  # in flight until the training thread kills the process
        os.kill(os.getpid(), signal.SIGKILL)

    real_commit = storage.save_checkpoint

    def commit(checkpoint, path):
        real_commit(checkpoint, path)
        if checkpoint["global_step"] == target:
            journal.write(event="fault", spec=spec, thread=threading.current_thread().name, committed=Path(path).name)
            os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save  # fitforge.checkpoint.files.torch is this torch module
    if stage == "committed":
        storage.save_checkpoint = commit


def break_uploads(spec: str, journal: Journal) -> None:
    """Replace the object upload as fitforge.checkpoint.objects calls it: the N-th upload puts the
    whole object (upload-kill) or its first half (upload-tear) under its final name, then the
    process is killed, after the data and before the commit marker."""
    from fitforge.checkpoint import objects

    kind, number = spec.split(":")
    real_upload, calls = objects.upload, {"n": 0}

    def upload(fs, key: str, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] < int(number):
            return real_upload(fs, key, data)
        written = data if kind == "upload-kill" else data[: len(data) // 2]
        real_upload(fs, key, written)
        completed = int(re.search(r"batch(\d+)", key)[1])
        journal.write(event="fault", spec=spec, key=key, completed=completed, written=len(written), size=len(data))
        os.kill(os.getpid(), signal.SIGKILL)

    objects.upload = upload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--out")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--fault", default="")
    parser.add_argument("--val", type=float, default=None)
    parser.add_argument("--val-workers", type=int, default=0)
    parser.add_argument("--fault-rank", type=int, default=None)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--augment", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)  # fitforge's warnings (skipped checkpoints) reach stderr
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every run, resumed or not, starts as a re-run of the same script would

    generator = torch.Generator().manual_seed(1234)
    x, y = torch.randn(SAMPLES, 10, generator=generator), torch.randint(0, 4, (SAMPLES,), generator=generator)
    dataset = Augmented(x, y) if args.augment else TensorDataset(x, y)
    data = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=args.workers)
    net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01), device="cpu"
    )
    journal = Journal(args.journal + rank_suffix())
    journal_commits(journal)
    if args.fault.startswith(("tear:", "enospc:")):
        break_checkpoint_writes(args.fault, journal)
    if args.fault.startswith("upload-"):
        break_uploads(args.fault, journal)
    if args.fault.startswith(("save-kill:", "train-kill:")):
        kill_during_saves(args.fault, journal)
    saver = CheckpointHandler(
        args.dir,
        batch_period=BATCH_PERIOD,
        epoch_period=EPOCH_PERIOD,
        max_checkpoints=MAX_CHECKPOINTS,
        resume_from_checkpoint=True,
        async_save=args.async_save,
    )
    here = args.fault_rank is None or args.fault_rank == int(os.environ.get("RANK", "0"))
    recorder = Recorder(journal, args.dir, args.fault, here)
    handlers = [saver, recorder, LambdaHandler(epoch_end=recorder.in_epoch_hook)]
    if args.val is not None:
        where, at = recorder.where, recorder.at
        fault_at = 0 if where == "check" else at if where == "val" else None
        handlers += validation(args.val, fault_at, recorder.inject, journal.write, args.val_workers)
    try:
        estimator.fit(data, epochs=args.epochs, event_handlers=handlers)
    except SystemExit as exit_:  # a signal's exit status, timed (a launcher may kill a rank once another exited)
        journal.write(event="exit", code=exit_.code, t=time.time())
        raise
    if args.out:
        real_save(net.state_dict(), args.out + rank_suffix())
    journal.write(event="end")


if __name__ == "__main__":
    main()

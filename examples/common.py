"""What every example script shares: its command line and its checkpoint folder.

The training code itself (model, Estimator, fit and its handlers) stays in each script, in full.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SMOKE_SAMPLES = 64  # --smoke trains one epoch on this many samples: seconds, for tests


def example_parser(doc: str, *, epochs: int, batch_size: int, lr: float) -> argparse.ArgumentParser:
    """The options every example takes, with its own defaults."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--epochs", type=int, default=epochs, help=f"most epochs to train (default {epochs})")
    parser.add_argument("--batch-size", type=int, default=batch_size, help=f"default {batch_size}")
    parser.add_argument("--lr", type=float, default=lr, help=f"learning rate (default {lr})")
    parser.add_argument("--limit", type=int, default=None, help="train on at most this many samples")
    parser.add_argument("--patience", type=int, default=3, help="early-stopping patience in epochs")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help=f"one epoch on {SMOKE_SAMPLES} samples, in seconds (for tests)"
    )
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``--smoke`` means one epoch on a small subset."""
    args = parser.parse_args(argv)
    if args.smoke:
        args.epochs = 1
        args.limit = min(args.limit or SMOKE_SAMPLES, SMOKE_SAMPLES)
    return args


@contextmanager
def checkpoint_dir(args: argparse.Namespace) -> Iterator[Path]:
    """The folder given by ``--checkpoint-dir`` (kept), else a temporary one (removed after)."""
    if args.checkpoint_dir is not None:
        path = Path(args.checkpoint_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="fitforge-") as folder:
        yield Path(folder)

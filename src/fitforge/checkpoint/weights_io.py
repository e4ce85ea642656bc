"""The Estimator's weights in and out of files: ``export`` (safetensors, a Hugging Face folder), ``load_weights``
(safetensors) and ``load_checkpoint`` (a :class:`~fitforge.handlers.CheckpointHandler` file)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, cast

from torch import nn

from fitforge.checkpoint.export import export_weights
from fitforge.checkpoint.files import restore_weights
from fitforge.checkpoint.load_weights import load_weights, refuse_meta
from fitforge.core.events import EventHandler, handler_name
from fitforge.core.state import EstimatorLike

log = logging.getLogger("fitforge")


class WeightsInOut:
    """The part of :class:`~fitforge.Estimator` that writes and reads its net's weights."""

    net: nn.Module
    strategy: Any
    weight_average: Any

    def export(self, path: str | os.PathLike, format: str = "safetensors") -> Path:
        """Write the net's weights for inference: ``"safetensors"``, one file that
        ``safetensors.torch.load_file`` reads (``net.load_state_dict(load_file(path))``); ``"hf"``, a Hugging
        Face model's ``save_pretrained`` folder that ``from_pretrained`` loads. The weights evaluation uses (an
        ``EMAHandler``'s average, a schedule-free optimizer's), whole under any engine; under torch.distributed
        call it on every rank: rank 0 writes. Returns ``path``.

        Raises:
            FitforgeValueError: an unknown ``format``; ``"hf"`` for a net without ``save_pretrained``; a folder
                given for one file.
        """
        refuse_meta(self.net, "net")
        return export_weights(self, path, format)

    def load_weights(self, path: str | os.PathLike, strict: bool = True) -> None:
        """Load weights from safetensors: one file, or a folder (a Hugging Face model's, its weights whole or
        sharded). Under FSDP each rank reads only its own shards, so a net built on the meta device (``with
        torch.device("meta"): net = Net()``) is never whole on one rank. Call it on every rank.

        Raises:
            FitforgeValueError: shapes differ, or (``strict``) a name is missing from the file or the net.
        """
        load_weights(self, path, strict)
        if isinstance(self.weight_average, EventHandler):  # evaluation would run with the last fit's average
            log.info("load_weights: evaluate, predict and export use the loaded weights, not the last fit's average")
            self.weight_average = None

    def load_checkpoint(self, path: str | os.PathLike, optimizers: bool = True) -> dict:
        """Load the net's weights, and the optimizers' states unless ``optimizers=False``, from a file
        written by :class:`~fitforge.handlers.CheckpointHandler` (a path, or the fsspec URL of a
        committed checkpoint in an object store, e.g. ``s3://bucket/run/model-best.pt``, with the
        environment's credentials); return the checkpoint's dict
        (``epochs_completed``, ``global_step``, ``history``...). Loads with ``weights_only=True``.

        Raises:
            FileNotFoundError: no file at ``path``.
            fitforge.checkpoint.files.CheckpointError: an unreadable file, or one of another architecture
                (the message lists the missing and unexpected keys) or optimizer setup.
        """
        refuse_meta(self.net, "net")
        checkpoint = restore_weights(cast(EstimatorLike, self), path, optimizers)  # self is an Estimator
        average = self.weight_average
        if isinstance(average, EventHandler):  # evaluation runs with the average: the checkpoint's, not the last fit's
            saved = checkpoint.get("handlers", {}).get(handler_name(average))
            if saved is None:
                log.info(
                    "load_checkpoint: %s holds no average of the weights: evaluate and predict use its weights",
                    Path(str(path)).name,
                )
                self.weight_average = None
            else:
                average.load_state_dict(saved)
        return checkpoint

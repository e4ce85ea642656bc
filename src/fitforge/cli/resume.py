"""``fitforge fit --from_checkpoint PATH``: the run recorded in PATH (its config applied by
:class:`~fitforge.cli.recorded.RecordedConfig`), continued as ``CheckpointHandler(resume_from_checkpoint=True)``
continues a run: from the newest checkpoint that loads in ``model_dir``, to the same ``fit.epochs``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from jsonargparse import Namespace

from fitforge.cli.suggest import parameters
from fitforge.exceptions import ConfigError

log = logging.getLogger("fitforge")
_RESUME = "resume_from_checkpoint"


def resume_from(config: Namespace, checkpoint: str) -> None:
    """Turn on ``resume_from_checkpoint`` in ``config``'s handlers that take it; one of them must
    save where ``checkpoint`` is, or the run would start again from scratch."""
    folder = Path(checkpoint).resolve().parent
    resuming = [spec for spec in config.handlers if _RESUME in parameters(spec.class_path)]
    if not resuming:
        raise ConfigError(
            f"--from_checkpoint {checkpoint}: the config has no handler that resumes (one taking {_RESUME}, "
            "a CheckpointHandler); add the run's CheckpointHandler to its handlers"
        )
    folders = [Path(spec.init_args.get("model_dir", ".")).resolve() for spec in resuming]
    if folder not in folders:
        raise ConfigError(
            f"--from_checkpoint {checkpoint}: the run's checkpoints go to {', '.join(map(str, folders))}, not to "
            f"{folder}; start the resume from the folder the run was started in (a relative model_dir is "
            "relative to it)"
        )
    for spec in resuming:
        spec.init_args[_RESUME] = True
    log.info("fitforge fit: resuming the run of %s from the newest checkpoint in %s", checkpoint, folder)

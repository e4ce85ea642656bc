"""The config a run recorded in its checkpoints, read back: to resume the run from it alone."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from jsonargparse import ActionConfigFile

from fitforge.checkpoint.files import load_checkpoint
from fitforge.exceptions import ConfigError


def recorded_config(path: str | os.PathLike) -> dict[str, Any]:
    """The resolved config recorded in a checkpoint of a run started from one (ConfigError if none)."""
    config = load_checkpoint(path).get("config")
    if not isinstance(config, dict):
        raise ConfigError(
            f"{path} holds no config: its run was not started from one (fitforge fit --config); "
            "pass the run's config with --config"
        )
    return config


class RecordedConfig(argparse.Action):
    """``--from_checkpoint PATH``: apply the config recorded in PATH where the option stands, as
    ``--config`` applies a file (options after it override it), and keep PATH."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        ActionConfigFile.apply_config(parser, namespace, "config", json.dumps(recorded_config(values)))
        namespace[self.dest] = values

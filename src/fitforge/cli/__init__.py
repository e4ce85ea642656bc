"""Runs from a config and the command line: ``fitforge fit|evaluate|predict`` (docs/cli.md)."""

try:  # an optional extra: say which, rather than "No module named 'jsonargparse'"
    import jsonargparse  # noqa: F401
except ImportError as error:
    raise ImportError('the fitforge command line needs jsonargparse: pip install "fitforge[cli]"') from error

from fitforge.cli.commands import main, run
from fitforge.cli.parser import recorded_config

__all__ = ["main", "recorded_config", "run"]

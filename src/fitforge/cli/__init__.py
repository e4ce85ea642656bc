"""Runs from a config and the command line: ``fitforge fit|evaluate|predict`` (docs/cli.md).

On jsonargparse (the extra ``pip install "fitforge[cli]"``). A YAML or JSON config names the model
(``class_path`` + ``init_args``), the data (an importable function + its arguments), and the
Estimator's, ``fit``'s and the handlers' arguments; the command line sets any value (``--fit.epochs 5``).

Example:
    >>> from fitforge.cli import run
    >>> history = run(["fit", "--config", "run.yaml", "--fit.epochs", "5"])   # doctest: +SKIP
    >>> run(["evaluate", "--config", "run.yaml", "--checkpoint", "runs/model-epoch5batch40.pt"])  # doctest: +SKIP
    {'val_loss': 0.01}
"""

try:  # an optional extra: say which, rather than "No module named 'jsonargparse'"
    import jsonargparse  # noqa: F401
except ImportError as error:
    raise ImportError('the fitforge command line needs jsonargparse: pip install "fitforge[cli]"') from error

from fitforge.cli.commands import main, run
from fitforge.cli.recorded import recorded_config

__all__ = ["main", "recorded_config", "run"]

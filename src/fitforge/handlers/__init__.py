"""Built-in event handlers, one per module."""

from .checkpoint import CheckpointHandler
from .early_stopping import EarlyStoppingHandler
from .gradient_update import GradientUpdateHandler
from .logging import LoggingHandler
from .metric import MetricHandler
from .progress_bar import ProgressBarHandler
from .stopping import StoppingHandler
from .validation import ValidationHandler

__all__ = [
    "StoppingHandler", "GradientUpdateHandler", "MetricHandler", "ValidationHandler",
    "LoggingHandler", "ProgressBarHandler", "CheckpointHandler", "EarlyStoppingHandler",
]

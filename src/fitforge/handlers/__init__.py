"""Built-in event handlers, one per module."""

from .checkpoint import CheckpointHandler
from .csv_logger import CSVLoggerHandler
from .early_stopping import EarlyStoppingHandler
from .gradient_update import GradientUpdateHandler
from .lambda_handler import LambdaHandler
from .logging import LoggingHandler
from .lr_scheduler import LRSchedulerHandler
from .metric import MetricHandler
from .nan_guard import NaNGuardHandler, NonFiniteLossError
from .progress_bar import ProgressBarHandler
from .stopping import StoppingHandler
from .tensorboard import TensorBoardHandler
from .throttle import throttle
from .validation import ValidationHandler

__all__ = [
    "CSVLoggerHandler",
    "CheckpointHandler",
    "EarlyStoppingHandler",
    "GradientUpdateHandler",
    "LRSchedulerHandler",
    "LambdaHandler",
    "LoggingHandler",
    "MetricHandler",
    "NaNGuardHandler",
    "NonFiniteLossError",
    "ProgressBarHandler",
    "StoppingHandler",
    "TensorBoardHandler",
    "ValidationHandler",
    "throttle",
]

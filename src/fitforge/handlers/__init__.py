"""Built-in event handlers, one per module."""

from fitforge.handlers.checkpoint import CheckpointHandler
from fitforge.handlers.csv_logger import CSVLoggerHandler
from fitforge.handlers.early_stopping import EarlyStoppingHandler
from fitforge.handlers.ema import EMAHandler
from fitforge.handlers.fingerprint import FingerprintHandler
from fitforge.handlers.gradient_update import GradientUpdateHandler
from fitforge.handlers.lambda_handler import LambdaHandler
from fitforge.handlers.live_plot import LivePlotHandler
from fitforge.handlers.logging import LoggingHandler
from fitforge.handlers.lr_scheduler import LRSchedulerHandler
from fitforge.handlers.manifest import ManifestHandler
from fitforge.handlers.metric import MetricHandler
from fitforge.handlers.mlflow import MLflowHandler
from fitforge.handlers.nan_guard import NaNGuardHandler, NonFiniteLossError
from fitforge.handlers.optuna import OptunaPruningHandler
from fitforge.handlers.progress_bar import ProgressBarHandler
from fitforge.handlers.ray_train import RayTrainReportHandler
from fitforge.handlers.schedule import ScheduleHandler
from fitforge.handlers.spike_guard import LossSpikeError, SpikeGuardHandler
from fitforge.handlers.stopping import StoppingHandler
from fitforge.handlers.tensorboard import TensorBoardHandler
from fitforge.handlers.throttle import throttle
from fitforge.handlers.throughput import ThroughputHandler
from fitforge.handlers.torch_profiler import ProfilerHandler
from fitforge.handlers.validation import ValidationHandler
from fitforge.handlers.wandb import WandbHandler

__all__ = [
    "CSVLoggerHandler",
    "CheckpointHandler",
    "EMAHandler",
    "EarlyStoppingHandler",
    "FingerprintHandler",
    "GradientUpdateHandler",
    "LRSchedulerHandler",
    "LambdaHandler",
    "LivePlotHandler",
    "LoggingHandler",
    "LossSpikeError",
    "MLflowHandler",
    "ManifestHandler",
    "MetricHandler",
    "NaNGuardHandler",
    "NonFiniteLossError",
    "OptunaPruningHandler",
    "ProfilerHandler",
    "ProgressBarHandler",
    "RayTrainReportHandler",
    "ScheduleHandler",
    "SpikeGuardHandler",
    "StoppingHandler",
    "TensorBoardHandler",
    "ThroughputHandler",
    "ValidationHandler",
    "WandbHandler",
    "throttle",
]

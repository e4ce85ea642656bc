"""How a run is shown: the values and epochs as text, the closing line of a fit, the model's one-line
summary, the run's parameters as the loggers record them, the notebook's output lines. Shared by
the reporting handlers (logging, progress bar, CSV, TensorBoard, MLflow); it defines no handler.
It may import every layer below :mod:`fitforge.handlers`.
"""

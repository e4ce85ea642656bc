"""fitforge: the Fit API for PyTorch.

Example:
    >>> from fitforge import Estimator
    >>> est = Estimator(net, torch.nn.CrossEntropyLoss(), optimizer="adam")   # doctest: +SKIP
    >>> history = est.fit(train_loader, val_data=val_loader, epochs=5)        # doctest: +SKIP
"""

from fitforge.core.history import History
from fitforge.core.processor import BatchProcessor
from fitforge.core.state import BatchOutput, TrainState
from fitforge.estimator import Estimator

__version__ = "0.1.0"
__all__ = ["BatchOutput", "BatchProcessor", "Estimator", "History", "TrainState", "__version__"]

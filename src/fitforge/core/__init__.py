"""The core: events, TrainState, History, dispatch and ordering, the loop, BatchProcessor, losses,
data unpacking and the first-batch checks.

It may import only :mod:`fitforge.exceptions`: it knows no handler, no checkpoint format and no rank.
What it needs of the Estimator is the :class:`~fitforge.core.state.EstimatorLike` protocol.
"""

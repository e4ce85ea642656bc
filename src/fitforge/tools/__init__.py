"""Tools around fit: the learning-rate finder, the handler profiler and the declared-access guard.
They may import every layer below the estimator (:mod:`fitforge.testing` builds Estimators).
"""

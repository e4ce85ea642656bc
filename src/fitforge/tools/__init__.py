"""Tools around fit: the learning-rate finder, the handler profiler and the declared-access guard.
They may import every layer below the estimator (the testing helpers, which build an Estimator,
are the public module :mod:`fitforge.testing`).
"""

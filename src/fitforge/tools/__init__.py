"""Tools around fit: the learning-rate finder, the handler profiler, the declared-access guard and
the testing helpers. They may import every layer below the estimator.
"""

"""Tools around fit: the learning-rate finder, the handler profiler and the declared-access guard."""

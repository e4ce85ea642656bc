"""The core: the loop and its vocabulary, in 15 modules layered by an import-linter contract
(docs/architecture.md says what each holds).

It may import only :mod:`fitforge.exceptions`: it knows no handler and no checkpoint format, other
processes only through interfaces, and the Estimator through :class:`~fitforge.core.state.EstimatorLike`.
"""

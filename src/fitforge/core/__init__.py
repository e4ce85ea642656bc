"""The core: the loop and its vocabulary, in 15 modules layered by an import-linter contract.

- the loop and its run: :mod:`~fitforge.core.loop`, :mod:`~fitforge.core.run`,
  :mod:`~fitforge.core.coordinator` (agreement with other processes), :mod:`~fitforge.core.processes`;
- events and handlers: :mod:`~fitforge.core.events`, :mod:`~fitforge.core.roles`,
  :mod:`~fitforge.core.services`, :mod:`~fitforge.core.dispatch` (order, declared state access);
- what handlers see: :mod:`~fitforge.core.state`, :mod:`~fitforge.core.history`, :mod:`~fitforge.core.logged`;
- the step: :mod:`~fitforge.core.processor`, :mod:`~fitforge.core.batches`, :mod:`~fitforge.core.rng`,
  :mod:`~fitforge.core.modules`.

It may import only :mod:`fitforge.exceptions`: it knows no handler and no checkpoint format, other
processes only through interfaces, and the Estimator through :class:`~fitforge.core.state.EstimatorLike`.
"""

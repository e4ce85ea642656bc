"""The core: the loop and its vocabulary.

- the loop and its run: :mod:`~fitforge.core.loop` (fit, epoch, batch scopes), :mod:`~fitforge.core.run`
  (what one run holds), :mod:`~fitforge.core.coordinator` (agreement with other processes, behind an
  interface), :mod:`~fitforge.core.processes` (what handlers may ask of the other processes,
  ``state.ranks``), :mod:`~fitforge.core.preemption` (SIGTERM/SIGINT during a fit);
- events and handlers: :mod:`~fitforge.core.events` (mixins, stages), :mod:`~fitforge.core.roles`
  (what a handler declares it is), :mod:`~fitforge.core.dispatch` and :mod:`~fitforge.core.access`
  (order, declared state access);
- what handlers see: :mod:`~fitforge.core.state` (TrainState, BatchOutput), :mod:`~fitforge.core.history`,
  :mod:`~fitforge.core.logged` (named values);
- the step: :mod:`~fitforge.core.processor` (BatchProcessor), :mod:`~fitforge.core.batches` (batch
  formats), :mod:`~fitforge.core.loss`, :mod:`~fitforge.core.prediction`;
- small shared parts: arguments, options, modules, rng, finite, learning_rate, monitor (a watched
  key, min/max, the best so far), optimizer_choice (which optimizers a batch steps).

It may import only :mod:`fitforge.exceptions`: it knows no handler and no checkpoint format, other
processes only through interfaces, and the Estimator through :class:`~fitforge.core.state.EstimatorLike`.
"""

"""The core: the loop and its vocabulary.

- the loop and its run: :mod:`~fitforge.core.loop` (fit, epoch, batch scopes), :mod:`~fitforge.core.run`
  (what one run holds), :mod:`~fitforge.core.coordinator` (agreement with other processes, behind an
  interface), :mod:`~fitforge.core.processes` (what handlers may ask of the other processes,
  ``state.run.ranks``);
- events and handlers: :mod:`~fitforge.core.events` (mixins, stages), :mod:`~fitforge.core.roles`
  (what a handler declares it is), :mod:`~fitforge.core.services` (what handlers share),
  :mod:`~fitforge.core.dispatch` (order, declared state access);
- what handlers see: :mod:`~fitforge.core.state` (TrainState, BatchOutput), :mod:`~fitforge.core.history`,
  :mod:`~fitforge.core.logged` (named values);
- the step: :mod:`~fitforge.core.processor` (BatchProcessor), :mod:`~fitforge.core.batches` (batch
  formats), :mod:`~fitforge.core.rng` (RNG states), :mod:`~fitforge.core.modules` (modules' modes).

15 modules, layered (an import-linter contract): the loop over the run, the run over dispatch and the
processor, roles over events and the coordinator, the state over the rest.

It may import only :mod:`fitforge.exceptions`: it knows no handler and no checkpoint format, other
processes only through interfaces, and the Estimator through :class:`~fitforge.core.state.EstimatorLike`.
"""

"""The checks before step 1, which the plans (:mod:`fitforge.plans`) call once, so that a mistake
fails in a second, before any weight changes, naming the argument, the batch and the fix.

- :mod:`~fitforge.checks.model`: the net's placement and the parameters no optimizer holds;
- :mod:`~fitforge.checks.validation`: a first batch of each validation, evaluated before training;
- :mod:`~fitforge.checks.monitors`: monitored keys the run will produce;
- :mod:`~fitforge.checks.first_batch`: the first batch of a run, checked inside its step;
- :mod:`~fitforge.checks.forward_errors`: a failure inside the net, explained.

It may import every layer below the Estimator. Arguments are checked where they are given (the
constructors); what needs the run's data, model and handlers together is checked here.
"""

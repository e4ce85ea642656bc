"""The checks before step 1, which the plans (:mod:`fitforge.plans`) call once, so that a mistake
fails in a second, before any weight changes, naming the argument, the batch and the fix.

Arguments are checked where they are given (the constructors); what needs the run's data, model and
handlers together is checked here. It may import every layer below the Estimator.
"""

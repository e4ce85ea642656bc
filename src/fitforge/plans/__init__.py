"""One plan per call: ``fit``, ``evaluate`` and ``predict`` each check their inputs once, before any
step, and get back an immutable plan of what their run needs (handlers in order, data, step, data
order), then run it.

- :mod:`~fitforge.plans.fit`: :func:`~fitforge.plans.fit.plan_fit` and the :class:`~fitforge.plans.fit.FitPlan`;
- :mod:`~fitforge.plans.passes`: the one-pass runs, :func:`~fitforge.plans.passes.evaluation_of` and
  :func:`~fitforge.plans.passes.plan_predict`.

The checks themselves are functions in :mod:`fitforge.checks`.
"""

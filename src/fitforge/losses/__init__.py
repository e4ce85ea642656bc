"""The Estimator's losses: one or several, weighted, matched to outputs and labels, with the checks of
the first batch (:mod:`loss`), and the hints of a loss that does not fit its output (:mod:`hints`)."""

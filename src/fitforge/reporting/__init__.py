"""How a run is shown (values, a fit's closing line, the model's summary, the run's parameters, notebooks)."""

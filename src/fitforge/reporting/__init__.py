"""How a run is shown (values as text, a fit's closing line, the model's summary, the run's
parameters, the notebook's output lines), for the reporting handlers; it defines no handler."""

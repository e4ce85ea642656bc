"""Signals during a fit: SIGTERM, SIGUSR1 and SIGINT stop it after the current batch, with a checkpoint
(:mod:`preemption`), and DataLoader workers leave them to the main process (:mod:`worker_shield`)."""

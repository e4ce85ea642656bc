"""Signals during a fit: SIGTERM, SIGUSR1 and SIGINT stop it after the current batch (docs/checkpoints.md)."""

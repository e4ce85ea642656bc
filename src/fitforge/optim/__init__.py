"""The optimizer stepping's parts: item counts, the optimizers a batch steps, the learning rate, schedules."""

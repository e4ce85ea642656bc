"""The optimizer stepping's parts: item counts for accumulation, which optimizers a batch steps, the
learning rate, and schedules."""

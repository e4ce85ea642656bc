"""The optimizer stepping's parts: what a batch's items count for accumulation (:mod:`item_counts`),
which optimizers a batch steps (:mod:`optimizer_choice`), setting the learning rate
(:mod:`learning_rate`), and the length of a fit in optimizer steps for schedules (:mod:`schedules`)."""

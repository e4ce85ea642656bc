"""The input side: what fit, evaluate and predict read (arrays, data checks, each epoch's order),
before it reaches a batch, which is :mod:`fitforge.core.batches`'s."""

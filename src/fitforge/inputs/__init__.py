"""The input side: what fit, evaluate and predict read (arrays, data checks, each epoch's order)."""

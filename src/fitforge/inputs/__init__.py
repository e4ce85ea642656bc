"""The input side: what fit, evaluate and predict read, before it reaches a batch.

- :mod:`~fitforge.inputs.arrays`: whole arrays ``(X, y)`` given to fit, batched (and split off for validation);
- :mod:`~fitforge.inputs.sources`: what a data argument must be (re-iterable, not empty), judged before training;
- :mod:`~fitforge.inputs.order`: the data of each epoch: the order of every fit, seeded and resumable
  mid-epoch (:class:`~fitforge.inputs.order.DataOrder`), or one pass (:class:`~fitforge.inputs.order.OnePass`);
- :mod:`~fitforge.inputs.indexed`: a DataLoader over a TensorDataset read by indexing its tensors.

It may import :mod:`fitforge.distributed`, :mod:`fitforge.core` and :mod:`fitforge.exceptions`. A
batch itself (formats, unpacking, device transfer) is :mod:`fitforge.core.batches`'s.
"""

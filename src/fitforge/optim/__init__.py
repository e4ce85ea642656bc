"""The optimizer stepping's parts: item counts, the optimizers a batch steps, the learning rate, schedules; and
:func:`muon`, Muon with AdamW for the parameters it does not suit."""

from fitforge.optim.muon import muon, muon_routing

__all__ = ["muon", "muon_routing"]

"""Fault-tolerant data parallelism on torchft: replica groups that go on when one is lost, and take a
restarted one back from a live peer (docs/distributed.md#fault-tolerance). Needs ``fitforge[ft]``."""

from fitforge.fault_tolerance.batches import QuorumBatches, Share
from fitforge.fault_tolerance.commit import QuorumStepHandler, StepVetoed
from fitforge.fault_tolerance.strategy import FaultTolerantStrategy, NoQuorum, lighthouse

__all__ = [
    "FaultTolerantStrategy",
    "NoQuorum",
    "QuorumBatches",
    "QuorumStepHandler",
    "Share",
    "StepVetoed",
    "lighthouse",
]

"""The step of a fault-tolerant fit: the groups' gradients, weighted by their shares of the step's batch,
summed with their vetoes in one all-reduce, and the optimizers stepping only where every group commits
(docs/distributed.md#fault-tolerance)."""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch

from fitforge.core.clock import history_key
from fitforge.core.events import BatchEnd, EpochEnd, Stage
from fitforge.core.roles import KeyRecording
from fitforge.core.state import TrainState
from fitforge.exceptions import RetryBatch
from fitforge.fault_tolerance.batches import Share

log = logging.getLogger("fitforge")
KEYS = ("ft_groups", "ft_lost", "ft_joined", "ft_failed_steps")  # the History's columns, per epoch


class StepVetoed(RuntimeError):
    """A group vetoed the step's commit (:meth:`FaultTolerantStrategy.veto_step`): no group steps."""


class QuorumStepHandler(BatchEnd, EpochEnd, KeyRecording):
    """Sums the groups' weighted gradients with their vetoes and commits the step, or cancels it on every
    group; records the quorum's changes (the History's ``ft_*`` columns, and :attr:`changes`)."""

    priority = Stage.STEP - 1  # after the backward and a guard's judgement, before the optimizer step
    reads = ("estimator", "global_step", "history")
    writes = ("history",)

    def __init__(self, strategy: Any) -> None:  # a FaultTolerantStrategy (whose module imports this one)
        self.strategy = strategy
        self.changes: list[tuple[int, int]] = []  # (step, groups) at the first step and each change since
        self.lost = self.joined = self.failed = 0  # this epoch's: groups fewer, groups more, failed commits

    def history_keys(self, estimator: Any, phase: str) -> list[str]:
        return [*KEYS, history_key("quorum")] if phase == "train" else []  # and the seconds waiting for the groups

    def batch_end(self, state: TrainState) -> None:
        strategy = self.strategy
        share: Share = strategy.batches.share
        with state.run.clock.timing("quorum"):
            self._commit(state, strategy, share)

    def _commit(self, state: TrainState, strategy: Any, share: Share) -> None:
        manager = strategy.manager
        params = [p for p in state.estimator.net.parameters() if p.requires_grad]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        # torchft's all-reduce averages over the groups: scaled by share * groups, it sums the weighted
        # gradients (the big batch's mean loss's gradient), and the last element sums the vetoes.
        scale = share.weight * share.groups
        dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads], torch.float32)  # bfloat16 sums in fp32
        veto = torch.tensor([float(strategy._veto is not None) * share.groups], dtype=dtype, device=grads[0].device)
        flat = torch.cat([*(g.detach().reshape(-1).to(dtype) * scale for g in grads), veto])
        manager.allreduce(flat).wait()
        vetoed, strategy._veto = strategy._veto, None
        # One host read a step (the commit is a round trip to the lighthouse anyway): the vetoes, and the sum
        # of the summed gradients, not finite where one is not (30x cheaper than isfinite), which every group
        # sees alike: no group steps on a non-finite gradient.
        vetoes, total = torch.stack([flat[-1], flat[:-1].sum()]).tolist()
        infinite = not math.isfinite(total)
        if vetoes > 0.5 or infinite:
            vetoed = "the summed gradients are not finite" if infinite else vetoed or "another replica group vetoed it"
            manager.report_error(StepVetoed(vetoed))
        if share.groups < strategy.min_replicas:
            vetoed = (
                f"the quorum holds {share.groups} group(s), fewer than min_replicas={strategy.min_replicas}: start "
                f"the lighthouse with --min_replicas {strategy.min_replicas}"
            )
        reason = vetoed or "the quorum did not agree: a replica group was lost, or its collective failed"
        try:
            committed = manager.should_commit()
        except RuntimeError as err:  # torchft's max_retries: failed commits in a row
            raise StepVetoed(
                f"FaultTolerantStrategy: step {share.step} failed its commit more than max_retries="
                f"{strategy.max_retries} times in a row, the last time because {reason}"
            ) from err
        strategy.decided = True
        if not committed:
            self.failed += 1
            log.warning("FaultTolerantStrategy: step %d did not commit (%s); it is read again", share.step, reason)
            raise RetryBatch("the replica groups did not commit this step")
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(p).to(p.dtype)
            offset += g.numel()
        last = self.changes[-1][1] if self.changes else share.groups
        if not self.changes or last != share.groups:
            self.changes.append((share.step, share.groups))
            self.lost, self.joined = self.lost + max(last - share.groups, 0), self.joined + max(share.groups - last, 0)

    def epoch_end(self, state: TrainState) -> None:
        groups = self.changes[-1][1] if self.changes else 0
        for key, value in zip(KEYS, (groups, self.lost, self.joined, self.failed)):
            state.history.record(key, value)
        self.lost = self.joined = self.failed = 0

    def state_dict(self) -> dict[str, Any]:
        counts = {"lost": self.lost, "joined": self.joined, "failed": self.failed}
        return {"changes": list(self.changes), **counts, "seed": self.strategy.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.changes = [tuple(change) for change in state["changes"]]
        self.lost, self.joined, self.failed = state["lost"], state["joined"], state["failed"]
        self.strategy.seed = state["seed"]

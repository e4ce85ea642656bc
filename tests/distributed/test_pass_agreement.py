"""How the ranks leave a validation together when a signal comes (StopAgreement.abandons_pass and
end_pass, the SignalNotice in the group's store), on a one-rank gloo group; the two-rank case
under torchrun is tests/reliability/test_prompt_save.py."""

import signal

import pytest
import torch.distributed as dist
from torch import nn

from fitforge import Estimator
from fitforge.core.state import TrainState
from fitforge.distributed.signal_notice import SignalNotice
from fitforge.distributed.stop_agreement import StopAgreement
from fitforge.distributed.strategy import resolve_strategy

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


def fit_state(strategy="auto"):
    estimator = Estimator(nn.Linear(2, 2), nn.MSELoss(), optimizer="sgd", device="cpu")
    estimator.strategy = resolve_strategy(strategy, None)
    return TrainState(estimator, "train")


def test_a_signalled_rank_leaves_the_pass_and_tells_the_others_through_the_store(one_rank_group, monkeypatch):
    monkeypatch.setattr(SignalNotice, "poll_seconds", 0.0)
    state, agreement = fit_state(), StopAgreement(check_replicas=False)
    other = SignalNotice()  # another rank's view of the same fit: the same key
    other.key = agreement._notice.key
    assert not agreement.abandons_pass(state) and not other.seen()
    agreement.signal_received(state, signal.SIGTERM)
    assert state.run.preempted is None  # only at the pass's end, agreed
    assert agreement.abandons_pass(state) and other.seen()
    assert agreement.end_pass(state, abandoned=True)
    assert state.run.preempted == signal.SIGTERM and state.run.stop_requested and state.run.stop_every_rank


def test_a_pass_every_rank_finished_is_kept_though_a_signal_came_after_its_last_batch(one_rank_group):
    state, agreement = fit_state(), StopAgreement(check_replicas=False)
    assert not agreement.end_pass(state, abandoned=False) and state.run.preempted is None
    agreement.signal_received(state, signal.SIGUSR1)
    assert not agreement.end_pass(state, abandoned=False)  # the values stand; the fit stops at this batch
    assert state.run.preempted == signal.SIGUSR1 and state.run.stop_every_rank


def test_once_agreed_every_rank_leaves_at_its_first_look_without_a_collective(one_rank_group, monkeypatch):
    state, agreement = fit_state(), StopAgreement(check_replicas=False)
    state.run.preempted = signal.SIGTERM
    monkeypatch.setattr("fitforge.distributed.stop_agreement.reduce_ints", lambda *args: pytest.fail("a collective"))
    assert agreement.abandons_pass(state) and agreement.end_pass(state, abandoned=True)


def test_under_fsdp_the_ranks_reduce_the_signal_after_every_batch(one_rank_group, monkeypatch):
    state, agreement, reduced = fit_state("fsdp"), StopAgreement(check_replicas=False), []
    monkeypatch.setattr(
        "fitforge.distributed.stop_agreement.reduce_ints", lambda flags, op: reduced.append(list(flags)) or flags
    )
    assert not agreement.abandons_pass(state)
    agreement.signal_received(state, signal.SIGTERM)
    assert agreement.abandons_pass(state) and reduced == [[0], [signal.SIGTERM]]


def test_the_store_is_looked_at_no_more_than_every_poll_seconds(one_rank_group, monkeypatch):
    notice, looks = SignalNotice(), []
    store = notice._store
    monkeypatch.setattr(
        notice, "_store", type("Store", (), {"check": lambda self, keys: looks.append(keys) or False})()
    )
    monkeypatch.setattr(SignalNotice, "poll_seconds", 3600.0)
    assert not notice.seen() and not notice.seen() and len(looks) == 1
    assert store is not None  # the one-rank group has a store

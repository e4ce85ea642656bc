"""DiLoCoStrategy: each rank trains alone with its own AdamW, and every sync_every optimizer steps an
outer Nesterov SGD steps the anchor with the mean of the ranks' deltas. Two gloo ranks under torchrun
(diloco_run.py) give the weights of a hand-written simulation of both ranks in one process, and a
run SIGKILLed mid-round resumes to the same weights bit for bit; in one process the outer step is
applied to itself, and the arguments are checked."""

import copy
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import diloco_run as script  # the net, the data and the inner optimizer the runs train
import pytest
import torch
from test_data_parallel import launch, max_difference, ok, results
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.core.coordinator import Alone
from fitforge.core.state import TrainState
from fitforge.distributed import diloco
from fitforge.distributed.diloco import DiLoCoHandler, DiLoCoStrategy
from fitforge.distributed.stop_agreement import StopAgreement
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler


def nesterov(anchor):
    return torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)  # the paper's outer optimizer


def reference(initial: dict, world: int, steps: int, sync_every: int, outer=nesterov) -> dict:
    """Plain torch, one process: ``world`` copies of the net, each with its own AdamW and the
    samples its rank reads (step t: P[t W b:(t + 1) W b] of the unshuffled order, rank r every W-th
    from r), the outer step every ``sync_every`` steps and for a round still open at the end."""
    x, y = script.data()
    nets = [script.build_net() for _ in range(world)]
    for net in nets:
        net.load_state_dict({name: torch.tensor(value) for name, value in initial.items()})
    inners = [script.inner_optimizer(net) for net in nets]
    anchor = [p.detach().clone() for p in nets[0].parameters()]
    outer_optimizer = outer(anchor)

    @torch.no_grad()
    def outer_step():
        locals_ = [list(net.parameters()) for net in nets]
        for i, a in enumerate(anchor):
            a.grad = sum(a - params[i] for params in locals_) / world
        outer_optimizer.step()
        outer_optimizer.zero_grad()
        for params in locals_:
            for p, a in zip(params, anchor):
                p.copy_(a)

    step_size = world * script.RANK_BATCH
    for t in range(steps):
        start = t % (script.SAMPLES // step_size) * step_size
        samples = list(range(start, start + step_size))
        for r, (net, inner) in enumerate(zip(nets, inners)):
            inner.zero_grad()
            nn.functional.mse_loss(net(x[samples[r::world]]), y[samples[r::world]]).backward()
            inner.step()
        if (t + 1) % sync_every == 0:
            outer_step()
    if steps % sync_every:
        outer_step()
    return {name: value.tolist() for name, value in nets[0].state_dict().items()}


# -- two gloo ranks under torchrun -------------------------------------------------------------------


def run(out: Path, config: dict) -> subprocess.CompletedProcess:
    return launch(out, config, 2, script=script.__file__)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """An uninterrupted run, and one whose rank 1 is SIGKILLed before step 6 (its newest checkpoint:
    after step 4, one step into the second round) then resumed to the end."""
    root = tmp_path_factory.mktemp("diloco")
    with ThreadPoolExecutor(max_workers=2) as pool:
        killed = pool.submit(run, root / "killed", {"model_dir": str(root / "killed_ckpt"), "kill_at": 5})
        ok(pool.submit(run, root / "whole", {"model_dir": str(root / "whole_ckpt")}).result())
    ok(run(root / "resumed", {"model_dir": str(root / "killed_ckpt"), "resume": True}))
    return {"killed": killed.result(), **{name: results(root / name, 2) for name in ("whole", "resumed")}}


@pytest.mark.integration
def test_two_ranks_train_like_a_hand_written_diloco(runs):
    ranks = runs["whole"]
    assert [rank["trained"] for rank in ranks] == [list(range(script.BATCHES))] * 2
    expected = reference(ranks[0]["initial"], 2, script.BATCHES, script.SYNC_EVERY)
    for rank in ranks:
        assert rank["final"] == ranks[0]["final"]  # 9 steps: 3 whole rounds, every rank on the anchor
        assert max_difference(rank["final"], expected) <= 1e-6


@pytest.mark.integration
def test_a_run_killed_mid_round_resumes_to_the_same_weights_bit_for_bit(runs):
    assert runs["killed"].returncode != 0 and "Signal 9 (SIGKILL)" in runs["killed"].stderr
    for whole, resumed in zip(runs["whole"], runs["resumed"]):
        assert resumed["trained"] == list(range(4, script.BATCHES))  # from the checkpoint after step 4
        for name, value in whole["final"].items():
            assert torch.equal(torch.tensor(resumed["final"][name]), torch.tensor(value)), name


# -- one process ---------------------------------------------------------------------------------------


def fit_one_process(batches: int, strategy: DiLoCoStrategy, model_dir=None, resume=False) -> tuple[dict, nn.Module]:
    net = script.build_net()
    initial = {name: value.tolist() for name, value in net.state_dict().items()}
    estimator = Estimator(net, nn.MSELoss(), optimizer=script.inner_optimizer(net), device="cpu", strategy=strategy)
    loader = DataLoader(TensorDataset(*script.data()), batch_size=script.RANK_BATCH, shuffle=False)
    handlers = (
        [] if model_dir is None else [CheckpointHandler(model_dir, batch_period=2, resume_from_checkpoint=resume)]
    )
    estimator.fit(loader, batches=batches, event_handlers=handlers, default_handlers=False)
    return initial, net


def test_the_engine_trains_the_net_itself_with_no_gradient_averaging():
    strategy = DiLoCoStrategy(sync_every=3)
    net = nn.Linear(2, 1)
    estimator = Estimator(net, nn.MSELoss(), optimizer="sgd", device="cpu", strategy=strategy)
    assert strategy.name == "diloco" and estimator.train_net is net and not estimator.splits_data
    assert strategy.averages_gradients(estimator) is False and strategy.gradient_sync(estimator) is None
    assert isinstance(strategy.coordinator(estimator), Alone)
    assert [type(h) for h in strategy.fit_handlers()] == [DiLoCoHandler]
    assert repr(strategy).startswith("DiLoCoStrategy(sync_every=3, outer_lr=0.7")


def test_several_ranks_agree_on_stops_without_comparing_replicas(monkeypatch):
    monkeypatch.setattr(diloco, "world_size", lambda: 2)
    coordinator = DiLoCoStrategy(sync_every=3).coordinator(None)  # type: ignore[arg-type]
    assert isinstance(coordinator, StopAgreement) and coordinator._check_replicas is False


def test_one_process_applies_the_outer_step_to_itself():
    # 8 steps: two rounds and an open one of 2 steps, which the end of fit closes.
    initial, net = fit_one_process(8, DiLoCoStrategy(sync_every=3))
    final = {name: value.tolist() for name, value in net.state_dict().items()}
    assert max_difference(final, reference(initial, 1, 8, 3)) <= 1e-6


def test_an_outer_sgd_of_rate_1_without_momentum_is_plain_training():
    plain = fit_one_process(8, DiLoCoStrategy(sync_every=3, outer_lr=1.0, outer_momentum=0.0, nesterov=False))
    factory = fit_one_process(8, DiLoCoStrategy(sync_every=3, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0)))
    expected = reference(plain[0], 1, 8, 1, outer=lambda anchor: torch.optim.SGD(anchor, lr=1.0))
    for _, net in (plain, factory):
        assert max_difference({k: v.tolist() for k, v in net.state_dict().items()}, expected) <= 1e-6


def test_one_process_resumes_mid_round_exactly(tmp_path):
    _, whole = fit_one_process(9, DiLoCoStrategy(sync_every=3))
    fit_one_process(4, DiLoCoStrategy(sync_every=3), tmp_path)  # its newest checkpoint: 1 step into round 2
    _, resumed = fit_one_process(9, DiLoCoStrategy(sync_every=3), tmp_path, resume=True)
    for (name, value), other in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(value, other), name


def test_a_mid_round_checkpoint_of_another_number_of_ranks_is_refused():
    net = nn.Linear(2, 1)
    estimator = Estimator(net, nn.MSELoss(), optimizer="sgd", device="cpu", strategy=DiLoCoStrategy(sync_every=3))
    handler = DiLoCoHandler(estimator.strategy)
    handler.train_begin(TrainState(estimator=estimator))
    saved = handler.state_dict()
    with pytest.raises(FitforgeValueError, match=r"1 optimizer step\(s\) into a DiLoCo round on 2 rank\(s\)"):
        handler.load_state_dict({**saved, "world": 2, "steps": 1})
    handler.load_state_dict({**copy.deepcopy(saved), "world": 2, "steps": 0})  # a round's end: from the anchor
    with pytest.raises(FitforgeValueError, match="anchor holds the parameters"):
        handler.load_state_dict({**saved, "anchor": {"other": torch.zeros(1)}})


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"sync_every": 0}, FitforgeValueError, "sync_every must be a positive int .optimizer steps., got 0"),
        ({"sync_every": 2.0}, FitforgeTypeError, "sync_every must be a positive int .*got float 2.0"),
        ({"sync_every": True}, FitforgeTypeError, "sync_every must be a positive int .*got bool True"),
        ({"outer_lr": "0.7"}, FitforgeTypeError, "outer_lr must be a float, got str '0.7'"),
        ({"outer_lr": 0}, FitforgeValueError, "outer_lr must be a positive finite float, got 0"),
        ({"outer_lr": float("inf")}, FitforgeValueError, "outer_lr must be a positive finite float, got inf"),
        ({"outer_momentum": 1.0}, FitforgeValueError, r"outer_momentum must be a float in \[0, 1\), got 1.0"),
        ({"outer_momentum": 0}, FitforgeValueError, "nesterov=True needs outer_momentum > 0"),
        ({"nesterov": "yes"}, FitforgeTypeError, "nesterov must be True or False, got str 'yes'"),
        ({"outer_optimizer": "sgd"}, FitforgeTypeError, "outer_optimizer must be a callable .*got str 'sgd'"),
    ],
)
def test_bad_arguments_are_named_with_what_was_received(options, error, message):
    with pytest.raises(error, match=message):
        DiLoCoStrategy(**{"sync_every": 3, **options})


def test_an_outer_optimizer_factory_must_return_an_optimizer():
    with pytest.raises(FitforgeTypeError, match="outer_optimizer must return a torch optimizer, got list"):
        fit_one_process(2, DiLoCoStrategy(sync_every=3, outer_optimizer=lambda params: params))


def test_a_distributed_data_parallel_net_is_refused(one_rank_group):
    net = DistributedDataParallel(nn.Linear(2, 1))
    with pytest.raises(FitforgeValueError, match="not a DistributedDataParallel"):
        Estimator(net, nn.MSELoss(), optimizer="sgd", device="cpu", strategy=DiLoCoStrategy(sync_every=3))


def test_a_resume_from_a_checkpoint_without_a_round_starts_one_at_the_resumed_weights(tmp_path):
    from fitforge.handlers import LambdaHandler

    _, plain = fit_one_process(4, "none", tmp_path)  # its newest checkpoint: after 4 steps, no DiLoCo state
    anchors: list = []

    def first_anchor(state):
        if not anchors:
            anchors.extend(a.clone() for h in state._loop.handlers if isinstance(h, DiLoCoHandler) for a in h.anchor)

    net = script.build_net()
    estimator = Estimator(
        net, nn.MSELoss(), optimizer=script.inner_optimizer(net), device="cpu", strategy=DiLoCoStrategy(sync_every=3)
    )
    loader = DataLoader(TensorDataset(*script.data()), batch_size=script.RANK_BATCH, shuffle=False)
    handlers = [
        CheckpointHandler(tmp_path, batch_period=2, resume_from_checkpoint=True),
        LambdaHandler(batch_begin=first_anchor),
    ]
    estimator.fit(loader, batches=6, event_handlers=handlers, default_handlers=False)
    assert anchors and all(torch.equal(a, p) for a, p in zip(anchors, plain.parameters()))

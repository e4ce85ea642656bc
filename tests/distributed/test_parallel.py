"""In-process checks of the pieces of distributed training: strategy arguments and their errors,
the rank's device, data splitting (with a pretended world of 2), the predict interleave, metric
sums merged from several ranks, agreed preemption, and FSDP with its DCP checkpoints on a
one-process gloo group. The multi-process behaviour itself is tested under torchrun in
test_data_parallel.py beside this file."""

import logging
import os
import shutil
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
)

from fitforge import Estimator
from fitforge.checkpoint.files import (
    CheckpointError,
    check_fits,
    load_checkpoint,
    save_checkpoint,
)
from fitforge.core.coordinator import Alone
from fitforge.core.processes import OneProcess
from fitforge.core.state import TrainState
from fitforge.distributed import data_split as sharding
from fitforge.distributed import fsdp
from fitforge.distributed.ranks import broadcast_from_main, gather_to_main, run_on_main_and_share
from fitforge.distributed.stop_agreement import StopAgreement, _check_replicas
from fitforge.distributed.strategy import resolve_strategy
from fitforge.events import BatchEnd
from fitforge.exceptions import (
    CancelBatch,
    CancelFit,
    FitforgeTypeError,
    FitforgeValueError,
)
from fitforge.handlers import (
    CheckpointHandler,
    CSVLoggerHandler,
    LambdaHandler,
    MetricHandler,
    NaNGuardHandler,
    throttle,
)
from fitforge.metrics.base import merge_metric_state
from fitforge.metrics.builtin import Accuracy
from fitforge.signals.preemption import Preemption, preemptible
from helpers import checkpoint_files, make_estimator, regression_batches

GLOO = dist.is_available() and dist.is_gloo_available()


@pytest.fixture
def two_ranks(monkeypatch):
    """Pretend to be rank 1 of 2 for the data splitting (no collective is involved there)."""
    monkeypatch.setattr(sharding, "world_size", lambda: 2)
    monkeypatch.setattr(sharding, "rank", lambda: 1)


def dataset(n=10):
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.zeros(n, 1))


# -- strategy arguments ----------------------------------------------------------------------------
def test_an_unknown_strategy_names_the_known_ones():
    with pytest.raises(FitforgeValueError, match="strategy must be one of 'auto', 'ddp', 'fsdp', 'none'"):
        make_estimator(strategy="deepspeed")
    with pytest.raises(FitforgeTypeError, match="strategy_options must be a dict"):
        make_estimator(strategy="ddp", strategy_options=["find_unused_parameters"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_asking_for_several_processes_without_a_launcher_says_how_to_launch(strategy):
    with pytest.raises(FitforgeValueError, match="torchrun --nproc_per_node=N"):
        make_estimator(strategy=strategy)


@pytest.mark.parametrize("strategy", ["auto", None, "none"])
def test_one_process_trains_the_net_itself(strategy):
    estimator = make_estimator(strategy=strategy)
    assert estimator.train_net is estimator.net and not estimator.splits_data
    assert estimator.strategy.name == ("none" if strategy is None else strategy)


def test_under_a_launcher_each_rank_takes_its_local_device(monkeypatch):
    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
        "LOCAL_RANK": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_strategy("auto", None).device(None) == "cuda:1"
    assert resolve_strategy("ddp", None).device("cuda") == "cuda:1"
    assert resolve_strategy("auto", None).device(torch.device("cuda")) == "cuda:1"
    with pytest.warns(UserWarning, match="every rank of this machine uses that one GPU"):
        assert resolve_strategy("auto", None).device("cuda:0") == "cuda:0"  # an explicit index is the user's choice
    assert resolve_strategy("none", None).device(None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_strategy("auto", None).device(None) == "cpu"
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc_per_node=1 still names the rank's device
    assert resolve_strategy("auto", None).device(None) == "cpu"
    monkeypatch.delenv("RANK")  # not launched: the device as given
    assert resolve_strategy("auto", None).device(None) is None


# -- data splitting --------------------------------------------------------------------------------
def test_training_data_is_split_by_a_distributed_sampler_that_keeps_the_loader(two_ranks):
    loader = DataLoader(dataset(), batch_size=3, shuffle=True, drop_last=True, num_workers=0)
    split = sharding.shard_train(loader)
    sampler = split.batch_sampler.sampler
    assert type(sampler) is DistributedSampler and sampler.shuffle and sampler.rank == 1
    assert sampler.num_replicas == 2 and sampler.fitforge_seeded
    assert split.batch_size == 3 and split.drop_last and len(split) == 1  # 5 samples on this rank
    unshuffled = sharding.shard_train(DataLoader(dataset(), batch_size=3))
    assert not unshuffled.batch_sampler.sampler.shuffle
    assert list(unshuffled.batch_sampler.sampler) == [1, 3, 5, 7, 9]
    single = sharding.shard_train(DataLoader(dataset(), batch_size=None))
    assert type(single.sampler) is DistributedSampler and single.batch_sampler is None


def test_data_that_cannot_be_split_is_left_whole_with_a_warning(two_ranks, caplog):
    class Stream(IterableDataset):
        def __iter__(self):
            return iter([])

    own = DataLoader(dataset(), sampler=DistributedSampler(dataset(), num_replicas=2, rank=1))
    assert sharding.shard_train(own) is own  # the user's own split
    batches = regression_batches()
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        assert sharding.shard_train(batches) is batches
        stream = DataLoader(Stream())
        assert sharding.shard_train(stream) is stream
    assert "train_data is not split across the 2 ranks (it is a list, not a DataLoader)" in caplog.text
    assert "IterableDataset" in caplog.text
    assert sharding.shard_eval(batches, padded=False) == (batches, False)
    assert sharding.shard_eval(own, padded=False) == (own, False)


def test_evaluation_shares_are_strided_and_unpadded_or_padded_for_fsdp(two_ranks):
    loader = DataLoader(dataset(7), batch_size=2, shuffle=True)
    split, sharded = sharding.shard_eval(loader, padded=False)
    assert sharded and list(split.batch_sampler.sampler) == [1, 3, 5]  # dataset order, no repeat
    assert sharding.shard_eval(loader, padded=False)[0] is split  # made once per loader
    padded, _ = sharding.shard_eval(loader, padded=True)
    assert list(padded.batch_sampler.sampler) == [1, 3, 5, 0]  # as many as rank 0's 4: one repeated


def test_predictions_are_interleaved_back_into_dataset_order():
    rank0, rank1 = torch.tensor([[0.0], [2.0], [4.0]]), torch.tensor([[1.0], [3.0]])
    assert sharding._interleave([rank0, rank1], 5).flatten().tolist() == [0, 1, 2, 3, 4]
    padded1 = torch.tensor([[1.0], [3.0], [0.0]])  # DistributedSampler padding repeats sample 0
    assert sharding._interleave([rank0, padded1], 5).flatten().tolist() == [0, 1, 2, 3, 4]
    assert sharding.gather_predictions((rank0, rank0 * 2), 3)[1].flatten().tolist() == [0, 4, 8]
    named = sharding.gather_predictions({"cls": rank0, "reg": rank0 * 2}, 3)  # a net's named outputs
    assert list(named) == ["cls", "reg"] and named["reg"].flatten().tolist() == [0, 4, 8]


def test_one_process_helpers_need_no_process_group():
    assert run_on_main_and_share(lambda: 5) == 5 and gather_to_main("x") == ["x"] and broadcast_from_main(3) == 3


# -- metric sums of several ranks ------------------------------------------------------------------
def test_running_sums_of_several_ranks_merge_on_fewer():
    first, second = Accuracy(), Accuracy()
    first.update(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]))
    second.update(torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    merge_metric_state(first, second.state_dict())
    assert float(first.compute()) == pytest.approx(2 / 3)
    torchmetrics = pytest.importorskip("torchmetrics")
    a, b = torchmetrics.MeanMetric(), torchmetrics.MeanMetric()
    a.update(torch.tensor([1.0, 2.0]))
    b.update(torch.tensor([6.0]))
    merge_metric_state(a, {"states": b.metric_state, "updates": 1})
    assert float(a.compute()) == pytest.approx(3.0) and a._update_count == 2


def test_a_checkpoint_of_two_ranks_resumes_their_summed_running_sums_in_one_process():
    estimator = make_estimator()
    handler = MetricHandler()
    estimator.fit(regression_batches(2), epochs=1, event_handlers=[handler], default_handlers=False)
    saved = handler.state_dict()
    resumed = MetricHandler()
    resumed.load_state_dict({"ranks": [saved, saved]})
    state = TrainState(estimator, "train", batch_idx=0)  # at epoch_begin: a resume continues the epoch
    resumed.epoch_begin(state)
    assert resumed._loss._count == 2 * saved["loss"]["count"]
    assert resumed.compute()["train_loss"] == pytest.approx(handler.compute()["train_loss"])


# -- preemption agreed across ranks ----------------------------------------------------------------
class Remember(Alone):
    """A coordinator that only records the signals it receives (as StopAgreement does until it agrees)."""

    def __init__(self):
        self.signals = []

    def signal_received(self, state, signum):
        self.signals.append(signum)


def test_with_several_ranks_a_signal_waits_for_the_agreement():
    state, agreement, preemption = TrainState(make_estimator()), Remember(), Preemption()
    preemption.attach(state, agreement)
    with preemptible(preemption):
        os.kill(os.getpid(), signal.SIGTERM)
        assert agreement.signals == [signal.SIGTERM] and state.run.preempted is None and not state.run.stop_requested
        with pytest.raises(SystemExit) as exit_info:
            os.kill(os.getpid(), signal.SIGTERM)  # a second one acts at once
    assert exit_info.value.code == 143


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_the_agreement_turns_a_signal_into_a_stop_at_the_batch_end(one_rank_group):
    state, agreement = TrainState(make_estimator()), StopAgreement(check_replicas=False)
    assert not agreement.after_batch(state)  # the first interval is one batch: agreed, nothing asked
    assert state.run.preempted is None and not state.run.stop_requested
    agreement._interval = 1
    agreement.signal_received(state, signal.SIGTERM)
    assert state.run.preempted is None  # only at the agreement
    assert agreement.after_batch(state)
    assert state.run.preempted == signal.SIGTERM and "preempted by SIGTERM" in state.run.stop_reason


def agreeing_every(interval, monkeypatch):
    """A StopAgreement on a one-rank group whose reductions are recorded, with a fixed interval."""
    monkeypatch.setattr(StopAgreement, "max_interval", interval)
    monkeypatch.setattr(StopAgreement, "_propose", lambda self, batch_seconds: interval)
    agreement, reduced = StopAgreement(check_replicas=False), []
    monkeypatch.setattr(
        "fitforge.distributed.stop_agreement.reduce_ints", lambda flags, op: reduced.append(list(flags)) or flags
    )
    agreement._proposal = interval
    agreement.agree_on_stop(TrainState(make_estimator()))  # as after train_begin: the interval is agreed
    reduced.clear()
    return agreement, reduced


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_a_stop_one_rank_requests_waits_for_the_next_agreement(one_rank_group, monkeypatch):
    agreement, reduced = agreeing_every(4, monkeypatch)
    state = TrainState(make_estimator())
    assert not agreement.after_batch(state)
    state.run.stop("this rank's own reason")  # in batch 2: the others learn it at batch 4
    assert not agreement.after_batch(state) and not agreement.after_batch(state) and reduced == []
    assert agreement.after_batch(state)
    assert reduced == [[0, 1, 0, -4]] and state.run.stop_reason == "this rank's own reason"


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_a_stop_every_rank_requests_is_agreed_at_once(one_rank_group, monkeypatch):
    agreement, reduced = agreeing_every(4, monkeypatch)
    state = TrainState(make_estimator())
    assert not agreement.after_batch(state)
    state.run.stop("this rank's own reason")
    state.run.stop("reached batches=2", every_rank=True)  # counts even after another request
    assert agreement.after_batch(state) and len(reduced) == 1
    assert state.run.stop_reason == "this rank's own reason"


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_a_cancel_fit_is_held_until_the_agreement(one_rank_group, monkeypatch):
    agreement, reduced = agreeing_every(3, monkeypatch)
    state, cancel = TrainState(make_estimator()), CancelFit("rank 1 alone")
    assert not agreement.after_batch(state, cancel)
    assert not agreement.after_batch(state, CancelFit("again"))  # the first one is kept
    with pytest.raises(CancelFit) as raised:
        agreement.after_batch(state)
    assert raised.value is cancel and reduced == [[0, 0, 1, -3]]


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_a_cancel_fit_at_a_batch_end_is_held_with_its_batch_finished_and_counted(one_rank_group, monkeypatch):
    monkeypatch.setattr(StopAgreement, "_propose", lambda self, batch_seconds: 4)
    monkeypatch.setattr("fitforge.distributed.stop_agreement._check_replicas", lambda state: None)
    monkeypatch.setattr("fitforge.distributed.strategy.world_size", lambda: 2)  # as if another rank ran this fit too
    net = nn.Linear(1, 1)
    estimator = Estimator(
        DistributedDataParallel(net), nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu"
    )

    def cancel(state):
        if state.global_step == 1:
            raise CancelFit("this rank alone")

    seen = []
    handlers = [LambdaHandler(batch_end=cancel), LambdaHandler(batch_end=lambda state: seen.append(state.global_step))]
    history = estimator.fit(regression_batches(8), epochs=1, event_handlers=handlers)
    # Agreed after batch 1, then every 4: raised in batch 2, held through batch 5, where it ends the fit.
    # The handler after the raiser still ran at batch 2, and batch 2 counted like the others.
    assert seen == [0, 1, 2, 3, 4] and "this rank alone" in history.stop_reason


def test_the_interval_holds_a_quarter_second_of_batches_within_its_bounds():
    agreement = StopAgreement.__new__(StopAgreement)
    assert agreement._propose(0.0025) == 64  # a tiny model: at most max_interval
    assert agreement._propose(0.01) == 25
    assert agreement._propose(0.1) == 2
    assert agreement._propose(0.3) == 1 and agreement._propose(0.0) == 64


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_a_fit_on_a_group_agrees_at_its_points_and_checks_the_replicas_once(one_rank_group, monkeypatch):
    calls = []
    monkeypatch.setattr(StopAgreement, "max_interval", 2)
    monkeypatch.setattr(StopAgreement, "_propose", lambda self, batch_seconds: 2)
    real = StopAgreement.agree_on_stop
    monkeypatch.setattr(
        StopAgreement, "agree_on_stop", lambda self, state: calls.append(state.global_step) or real(self, state)
    )
    checks = []
    monkeypatch.setattr(
        "fitforge.distributed.stop_agreement._check_replicas", lambda state: checks.append(state.optimizer_steps)
    )
    monkeypatch.setattr("fitforge.distributed.strategy.world_size", lambda: 2)  # as if another rank ran this fit too
    net = nn.Linear(1, 1)
    wrapper = DistributedDataParallel(net)
    estimator = Estimator(wrapper, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    estimator.fit(regression_batches(3), epochs=2)
    # train_begin, epoch_begin, batch 1 (the first interval is 1), batch 3 (then every 2), the epoch end;
    # epoch_begin, batch 5, the epoch end (batch 6 is agreed on there: its stop holds for every rank).
    assert calls == [0, 0, 1, 3, 3, 3, 5, 6]
    assert checks == [1]
    _check_replicas(TrainState(estimator))  # the real one (imported before the patch): one rank equals itself


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_a_users_own_ddp_wrapper_is_kept_and_the_net_is_its_module(one_rank_group, tmp_path):
    net = nn.Linear(1, 1)
    wrapper = DistributedDataParallel(net)
    estimator = Estimator(wrapper, nn.MSELoss(), optimizer=torch.optim.SGD(wrapper.parameters(), lr=0.1), device="cpu")
    assert estimator.net is net and estimator.train_net is wrapper
    estimator.fit(regression_batches(), epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    saved = torch.load(tmp_path / "model-epoch1batch3.pt", weights_only=True)
    assert set(saved["model"]) == {"weight", "bias"}  # no "module." prefix


# -- FSDP on one rank ------------------------------------------------------------------------------
needs_fsdp = pytest.mark.skipif(not (GLOO and fsdp.supported()), reason="needs gloo and FSDP2 (fully_shard)")


def fsdp_estimator(**kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1))
    return Estimator(
        net,
        nn.MSELoss(),
        optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
        device="cpu",
        strategy="fsdp",
        **kwargs,
    )


@needs_fsdp
def test_fsdp_points_the_optimizer_at_the_sharded_parameters_and_trains(one_rank_group):
    estimator = fsdp_estimator()
    params = {id(p) for p in estimator.net.parameters()}
    assert all(id(p) in params for p in estimator.optimizer.param_groups[0]["params"])
    history = estimator.fit(regression_batches(4), epochs=3, default_handlers=False, event_handlers=[MetricHandler()])
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert estimator.evaluate(regression_batches(2))["val_loss"] > 0
    assert estimator.predict(regression_batches(2)).shape == (8, 1)


@needs_fsdp
def test_fsdp_refuses_an_optimizer_that_already_stepped_and_a_unit_that_is_no_module(one_rank_group):
    net = nn.Sequential(nn.Linear(1, 1))
    optimizer = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 1)).sum().backward()
    optimizer.step()
    with pytest.raises(FitforgeValueError, match="must not have stepped yet"):
        Estimator(net, nn.MSELoss(), optimizer=optimizer, device="cpu", strategy="fsdp")
    with pytest.raises(FitforgeTypeError, match="must be nn.Module classes"):
        fsdp_estimator(strategy_options={"shard": ("Linear",)})


@needs_fsdp
def test_async_saves_of_sharded_state_write_what_synchronous_saves_write(one_rank_group, tmp_path, monkeypatch):
    from fitforge.distributed import shard_writer

    backgrounds = []  # DCP's futures: async_save ran, and each save's shards were written by its end
    real = shard_writer.save_sharded_async

    def counted(*args):
        backgrounds.append(real(*args))
        return backgrounds[-1]

    monkeypatch.setattr(shard_writer, "save_sharded_async", counted)
    folders = {}
    for mode in ("sync", "async"):
        folders[mode] = tmp_path / mode
        saver = CheckpointHandler(
            folders[mode], batch_period=3, monitor="train_loss", save_best=True, async_save=mode == "async"
        )
        fsdp_estimator(strategy_options={"shard": (nn.Linear,)}).fit(
            regression_batches(4), epochs=2, event_handlers=[saver]
        )
    names = checkpoint_files(folders["sync"])
    assert names == checkpoint_files(folders["async"]) and "model-epoch2batch8pos0.dcp" in names
    assert len(backgrounds) >= 4 and all(future.done() and future.exception() is None for future in backgrounds)
    for name in (n for n in names if n.endswith(".pt")):
        loaded = []
        for mode in ("sync", "async"):
            plain = make_estimator(net=nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)))
            plain.optimizers = [torch.optim.Adam(plain.net.parameters(), lr=0.05)]
            checkpoint = plain.load_checkpoint(folders[mode] / name)  # one process reads the shards
            loaded.append((checkpoint["global_step"], plain.net.state_dict(), plain.optimizer.state_dict()["state"]))
        (step, weights, optimizer), (async_step, async_weights, async_optimizer) = loaded
        assert step == async_step and all(torch.equal(weights[k], async_weights[k]) for k in weights)
        assert all(torch.equal(optimizer[0][k], async_optimizer[0][k]) for k in ("exp_avg", "exp_avg_sq"))
    # The saves' own gloo group is gone with the fit; the resumed run continues from the async one.
    resumed = fsdp_estimator(strategy_options={"shard": (nn.Linear,)})
    saver = CheckpointHandler(folders["async"], resume_from_checkpoint=True, async_save=True)
    resumed.fit(regression_batches(4), epochs=3, event_handlers=[saver])
    assert (
        saver.resumed_from.name == "model-epoch2batch8.pt" and (folders["async"] / "model-epoch3batch12.pt").is_file()
    )


@needs_fsdp
@pytest.mark.parametrize("async_save", [False, True])
def test_sharded_checkpoints_go_to_an_fsspec_url_and_resume_from_it(one_rank_group, async_save):
    import fsspec

    url = f"memory:///fsdp-{async_save}"
    memory = fsspec.filesystem("memory")

    def fit(epochs, resume=False):
        torch.manual_seed(0)
        estimator = fsdp_estimator(strategy_options={"shard": (nn.Linear,)})
        saver = CheckpointHandler(
            url, batch_period=3, max_checkpoints=2, resume_from_checkpoint=resume, async_save=async_save
        )
        estimator.fit(regression_batches(4), epochs=epochs, event_handlers=[saver])
        return {k: v.full_tensor() for k, v in estimator.net.state_dict().items()}, saver

    try:
        whole, _ = fit(3)
        memory.rm(url, recursive=True)
        fit(2)
        names = sorted(entry.rsplit("/", 1)[-1] for entry in memory.ls(url, detail=False))
        names.remove("manifest.json")
        assert names == [
            "model-epoch1batch6.pt",
            "model-epoch1batch6.pt.commit",
            "model-epoch1batch6pos2.dcp",
            "model-epoch2batch8.pt",
            "model-epoch2batch8.pt.commit",
            "model-epoch2batch8pos0.dcp",
        ]  # rotated: the shards of the checkpoints deleted went with them
        plain = make_estimator(net=nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)))
        plain.optimizers = [torch.optim.Adam(plain.net.parameters(), lr=0.05)]
        assert plain.load_checkpoint(f"{url}/model-epoch2batch8.pt")["global_step"] == 8  # one process reads them
        resumed, saver = fit(3, resume=True)
        assert saver.resumed_from.name == "model-epoch2batch8.pt"
        assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    finally:
        if memory.exists(url):
            memory.rm(url, recursive=True)


@needs_fsdp
def test_shards_that_cannot_be_written_are_a_checkpoint_error_naming_them(one_rank_group, tmp_path):
    from fitforge.checkpoint import LocalCheckpointIO

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    io = LocalCheckpointIO(tmp_path / "run")
    io.folder_path = lambda name: blocked / name  # under a file: no folder can be made there
    with pytest.raises(CheckpointError, match=r"cannot write the shards model-epoch1batch4pos0.dcp: .*intact"):
        fsdp_estimator().fit(regression_batches(4), epochs=1, event_handlers=[CheckpointHandler(io=io)])
    assert io.names() == ["manifest.json"]  # no checkpoint names shards that are not there


@needs_fsdp
def test_a_preemption_save_of_sharded_state_waits_for_the_async_one_in_flight(one_rank_group, tmp_path):
    class Term(BatchEnd):
        def batch_end(self, state):
            if state.global_step == 4:  # right after the async save of 3 batches started
                os.kill(os.getpid(), signal.SIGTERM)

    saver = CheckpointHandler(tmp_path, batch_period=3, async_save=True)
    with pytest.raises(SystemExit) as exit_:
        fsdp_estimator().fit(regression_batches(4), epochs=3, event_handlers=[saver, Term()])
    assert exit_.value.code == 143
    assert checkpoint_files(tmp_path)[-2:] == ["model-epoch1batch5.pt", "model-epoch1batch5pos1.dcp"]
    resumed = fsdp_estimator()
    saver = CheckpointHandler(tmp_path, resume_from_checkpoint=True, async_save=True)
    resumed.fit(regression_batches(4), epochs=3, event_handlers=[saver])
    assert saver.resumed_from.name == "model-epoch1batch5.pt" and resumed.history.epochs == 3


@needs_fsdp
def test_a_failed_async_save_of_sharded_state_raises_a_checkpoint_error(one_rank_group, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    real, writes = FileSystemWriter.write_data, []

    def failing(self, plan, planner):
        writes.append(self.path)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", failing)
    saver = CheckpointHandler(tmp_path, batch_period=3, epoch_period=None, async_save=True)
    with pytest.raises(
        CheckpointError,
        match=r"cannot write the shards model-epoch1batch6pos2\.dcp: rank 0: OSError: \[Errno 28\] No space left",
    ):
        fsdp_estimator().fit(regression_batches(4), epochs=3, event_handlers=[saver])
    assert load_checkpoint(tmp_path / "model-epoch0batch3.pt")["global_step"] == 3  # the one before, intact
    assert not (tmp_path / "model-epoch1batch6.pt").exists()


@needs_fsdp
def test_fsdp_checkpoints_round_trip_through_dcp_folders(one_rank_group, tmp_path):
    estimator = fsdp_estimator(strategy_options={"shard": (nn.Linear,)})
    saver = CheckpointHandler(tmp_path, monitor="train_loss", save_best=True, max_checkpoints=1)
    estimator.fit(regression_batches(4), epochs=2, event_handlers=[saver])
    names = set(checkpoint_files(tmp_path))
    assert names == {
        "model-epoch2batch8.pt",
        "model-epoch2batch8pos0.dcp",
        "model-best.pt",
        "model-best-epoch2batch8pos0.dcp",
    }
    full = {k: v.full_tensor() for k, v in estimator.net.state_dict().items()}
    plain = make_estimator(net=nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)))
    plain.optimizers = [torch.optim.Adam(plain.net.parameters(), lr=0.05)]
    checkpoint = plain.load_checkpoint(tmp_path / "model-epoch2batch8.pt")  # one process reads the shards
    assert checkpoint["global_step"] == 8
    assert all(torch.equal(plain.net.state_dict()[k], v) for k, v in full.items())
    assert plain.optimizer.state_dict()["state"][0]["step"] == 8
    weights_only = make_estimator(net=nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)))
    weights_only.load_checkpoint(tmp_path / "model-best.pt", optimizers=False)
    assert all(torch.equal(weights_only.net.state_dict()[k], v) for k, v in full.items())
    (tmp_path / "model-epoch2batch8pos0.dcp" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="does not fit this net or its optimizers: CheckpointException"):
        plain.load_checkpoint(tmp_path / "model-epoch2batch8.pt")
    shutil.rmtree(tmp_path / "model-epoch2batch8pos0.dcp")
    with pytest.raises(CheckpointError, match="sharded weights of this checkpoint are missing"):
        plain.load_checkpoint(tmp_path / "model-epoch2batch8.pt")


class Rows(BatchEnd):
    """The first feature of every sample trained, by epoch (the data below holds its index there)."""

    def __init__(self):
        self.seen, self.steps = {}, []

    def batch_end(self, state):
        self.seen.setdefault(state.epoch, []).extend(int(v) for v in state.batch[0][:, 0])
        self.steps.append(state.global_step)


def fit_rows(folder, loader, resume=False, steps=None, **target):
    torch.manual_seed(0)  # the fit's seed, and so its order
    rows = Rows()
    saver = CheckpointHandler(folder, batch_period=4, epoch_period=None, resume_from_checkpoint=resume)
    make_estimator().fit(loader, event_handlers=[rows, saver], default_handlers=False, **target)
    if steps is not None:
        steps.extend(rows.steps)
    return rows.seen


def as_if_two_ranks_wrote(path):
    checkpoint = load_checkpoint(path)
    checkpoint["data_order"].update(world=2, split=2)  # with batches of 4: 16 samples into epoch 2
    save_checkpoint(checkpoint, path)


def test_a_mid_epoch_checkpoint_of_another_number_of_ranks_goes_on_at_its_sample(tmp_path, caplog):
    data = TensorDataset(torch.arange(24.0).unsqueeze(1), torch.rand(24, 1))
    whole = fit_rows(tmp_path / "whole", DataLoader(data, batch_size=4, shuffle=True), epochs=2)
    fit_rows(tmp_path / "run", DataLoader(data, batch_size=4, shuffle=True), batches=8)  # 2 batches into epoch 2
    as_if_two_ranks_wrote(tmp_path / "run" / "model-epoch1batch8.pt")
    steps: list = []
    with caplog.at_level(logging.INFO, logger="fitforge"):
        resumed = fit_rows(
            tmp_path / "run", DataLoader(data, batch_size=4, shuffle=True), resume=True, steps=steps, epochs=2
        )
    # One order for every number of ranks: the one process's epoch goes on after the 16 samples the two ranks read.
    assert resumed == {1: whole[1][16:]}
    assert "written 16 sample(s) into epoch 2 by 2 rank(s) in batches of 4; epoch 2 goes on" in caplog.text
    assert steps == [8, 9]  # the run's step count goes on: it counts steps trained, whatever their size


class OwnOrder(torch.utils.data.Sampler):
    def __init__(self, size):
        self.size = size

    def __iter__(self):
        return iter(reversed(range(self.size)))

    def __len__(self):
        return self.size


def test_a_mid_epoch_checkpoint_of_another_number_of_ranks_with_a_users_sampler_is_refused(tmp_path):
    data = TensorDataset(torch.arange(24.0).unsqueeze(1), torch.rand(24, 1))
    fit_rows(tmp_path, DataLoader(data, batch_size=4, sampler=OwnOrder(24)), batches=8)
    as_if_two_ranks_wrote(tmp_path / "model-epoch1batch8.pt")
    files = {name: (tmp_path / name).read_bytes() for name in checkpoint_files(tmp_path)}
    message = (
        r"written 16 sample\(s\) into epoch 2 by 2 rank\(s\), and this fit runs on 1, where the rest of that epoch "
        r"cannot be found: train_data's order is not one for every number of ranks: its sampler OwnOrder is your "
        r"own. Resume on 2 rank\(s\) to finish the epoch, or from a checkpoint written at an epoch's end"
    )
    with pytest.raises(FitforgeValueError, match=message):
        fit_rows(tmp_path, DataLoader(data, batch_size=4, sampler=OwnOrder(24)), resume=True, epochs=2)
    assert {name: (tmp_path / name).read_bytes() for name in checkpoint_files(tmp_path)} == files  # nothing over


def test_a_mid_epoch_checkpoint_of_another_number_of_ranks_over_single_samples_is_refused(tmp_path):
    data = TensorDataset(torch.arange(6.0).unsqueeze(1), torch.rand(6, 1))
    saver = CheckpointHandler(tmp_path, batch_period=4, epoch_period=None)
    make_estimator().fit(DataLoader(data, batch_size=None), batches=8, event_handlers=[saver], default_handlers=False)
    as_if_two_ranks_wrote(tmp_path / "model-epoch1batch8.pt")
    resumer = CheckpointHandler(tmp_path, batch_period=4, epoch_period=None, resume_from_checkpoint=True)
    with pytest.raises(FitforgeValueError, match=r"2 batch\(es\) into epoch 2 by 2 rank\(s\).*it has no batch size"):
        make_estimator().fit(DataLoader(data, batch_size=None), epochs=2, event_handlers=[resumer])


@needs_fsdp
def test_fsdp_starts_from_the_weights_of_an_unsharded_checkpoint(one_rank_group, tmp_path):
    plain = make_estimator(net=nn.Sequential(nn.Linear(1, 4), nn.Tanh(), nn.Linear(4, 1)))
    plain.fit(regression_batches(2), epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    sharded = fsdp_estimator()
    with pytest.raises(
        CheckpointError, match=r"load its weights only \(estimator.load_checkpoint\(path, optimizers=False\)"
    ):
        sharded.load_checkpoint(tmp_path / "model-epoch1batch2.pt")
    sharded.load_checkpoint(tmp_path / "model-epoch1batch2.pt", optimizers=False)
    assert all(torch.equal(v.full_tensor(), plain.net.state_dict()[k]) for k, v in sharded.net.state_dict().items())


def test_whether_a_checkpoint_fits_is_judged_without_loading_it(tmp_path):
    estimator = make_estimator()
    estimator.fit(regression_batches(2), epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    checkpoint = load_checkpoint(tmp_path / "model-epoch1batch2.pt")
    check_fits(estimator, checkpoint, tmp_path)
    with pytest.raises(CheckpointError, match="do not fit this net: shape mismatches"):
        check_fits(make_estimator(net=nn.Linear(1, 2), loss=nn.MSELoss()), checkpoint, tmp_path)
    with pytest.raises(CheckpointError, match=r"holds 0 optimizer state\(s\) but the estimator has 1"):
        check_fits(estimator, {**checkpoint, "optimizers": []}, tmp_path)
    with pytest.raises(CheckpointError, match="no folder model-x.dcp with DCP metadata"):
        check_fits(estimator, {**checkpoint, "sharded": "model-x.dcp"}, tmp_path)


@needs_fsdp
def test_shard_folders_no_checkpoint_names_are_removed_at_fit_start(one_rank_group, tmp_path):
    for name in ("model-epoch1batch4pos0.dcp", "model-best-epoch1batch4pos0.dcp"):
        (tmp_path / name).mkdir()
    fsdp_estimator().fit(regression_batches(4), epochs=1, event_handlers=[CheckpointHandler(tmp_path)])
    assert set(checkpoint_files(tmp_path)) == {"model-epoch1batch4.pt", "model-epoch1batch4pos0.dcp"}
    assert (tmp_path / "model-epoch1batch4pos0.dcp" / ".metadata").is_file()  # the new one, not the stale


def test_samplers_without_a_distributed_counterpart_are_named(two_ranks, caplog):
    drawn = DataLoader(dataset(), sampler=torch.utils.data.RandomSampler(dataset(), replacement=True))
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        assert sharding.shard_train(drawn) is drawn
    assert "draws with replacement" in caplog.text


def test_an_explicit_gpu_under_torchrun_warns_that_every_rank_shares_it(monkeypatch):
    for name, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
        "LOCAL_RANK": "1",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.warns(UserWarning, match="every rank of this machine uses that one GPU"):
        assert resolve_strategy("auto", None).device("cuda:0") == "cuda:0"


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_a_wrong_ddp_option_is_named(one_rank_group, monkeypatch):
    monkeypatch.setattr("fitforge.distributed.strategy.several_processes", lambda: True)
    monkeypatch.setattr("fitforge.distributed.strategy.world_size", lambda: 2)  # as if several ranks: DDP wraps
    with pytest.raises(FitforgeTypeError, match="not all arguments of DistributedDataParallel"):
        make_estimator(strategy_options={"find_unused": True})


class OtherRanks(OneProcess):
    """As if other ranks ran the fit beside this one: their answers to state.run.ranks scripted."""

    several = True

    def __init__(self, any_answer=None, min_answer=None):
        self.asked, self.any_answer, self.min_answer = [], any_answer, min_answer

    def any(self, flag):
        self.asked.append(flag)
        return flag if self.any_answer is None else self.any_answer

    def min_int(self, value):
        return value if self.min_answer is None else self.min_answer


def on_ranks(state, ranks):
    state.run.ranks = ranks
    return state


def test_nan_guard_and_time_throttles_follow_the_other_ranks():
    # another rank's loss was not finite
    guard, state = NaNGuardHandler(policy="skip"), on_ranks(TrainState(make_estimator()), OtherRanks(any_answer=True))
    guard.train_begin(state)
    state.output = type("Out", (), {"loss": torch.tensor(1.0)})()
    with pytest.raises(CancelBatch):
        guard.backward_end(state)  # this rank's loss is finite, yet every rank skips the batch
    on_ranks(state, OtherRanks(min_answer=0))  # another rank's batch 0 was bad
    stopper = NaNGuardHandler()
    stopper.train_begin(state)
    stopper.epoch_end(state)
    assert "loss of another rank at epoch 1" in state.run.stop_reason
    ranks = OtherRanks(any_answer=True)
    clock = iter([0.0, 1.0, 2.0, 3.0])
    saver = throttle(LambdaHandler(batch_end=lambda s: None), seconds=10, clock=lambda: next(clock))
    assert saver._batch.open(0, ranks) and saver._batch.open(1, ranks)  # not due at 1 s here, due on another rank
    assert ranks.asked == [True, False]
    reporter = throttle(CSVLoggerHandler("x.csv"), seconds=10, clock=lambda: next(clock))
    assert reporter._batch.open(0, ranks) and not reporter._batch.open(1, ranks)  # a rank-0 reporter decides alone
    assert ranks.asked == [True, False]


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_ranks_out_of_step_and_nan_weights_are_told_apart(one_rank_group):
    state = TrainState(make_estimator())
    agreement = StopAgreement(check_replicas=False)
    with pytest.raises(FitforgeValueError, match="the ranks got out of step"):
        agreement._apply(state, [4624210174201036800, 0, 0, -1])  # a float's bits read as a signal
    with pytest.raises(FitforgeValueError, match="the ranks got out of step"):
        agreement._apply(state, [0, 0, 0, 1])  # no interval
    with pytest.raises(CancelFit, match="CancelFit raised on another rank"):
        agreement._apply(state, [0, 1, 1, -1])
    estimator = make_estimator()
    with torch.no_grad():
        estimator.net.weight.fill_(float("nan"))
    _check_replicas(TrainState(estimator))  # nan weights: a NaN guard's business, not a bypass


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_a_fused_guard_reduces_its_flag_over_the_ranks_and_checkpoints_agree(one_rank_group, monkeypatch, tmp_path):
    # As if several ranks: the guard's device flag goes through an all-reduce (so every rank skips a
    # step any rank found bad), and the checkpoint's non-finite verdict through state.run.ranks.any.
    reduced = []
    monkeypatch.setattr(Alone, "several", True)
    monkeypatch.setattr(Alone, "max_", lambda self, t: reduced.append(t) or dist.all_reduce(t, op=dist.ReduceOp.MAX))
    estimator = make_estimator()
    estimator.optimizers = [torch.optim.Adam(estimator.net.parameters(), lr=0.1, fused=True)]
    saver = CheckpointHandler(tmp_path, batch_period=1)
    history = estimator.fit(regression_batches(), epochs=1, event_handlers=[NaNGuardHandler(), saver])
    # one per batch, and ThroughputHandler's at the epoch's end (the slowest rank's time)
    assert len(reduced) == len(regression_batches()) + 1 and history.stop_reason == "reached epochs=1"
    assert len(saver.saved) == min(len(regression_batches()), saver.max_checkpoints)  # finite: every save written

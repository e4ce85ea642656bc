"""Several optimizers stepped by turns (``BatchOutput.step``): which parameters move on which batch,
discarded leaked gradients, accumulation and clipping per optimizer, the fp16 scaler, per-optimizer
batch schedulers, exact resume, and the errors of a bad choice."""

import contextlib

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as S
from torch.utils.data import DataLoader, TensorDataset

from fitforge import BatchOutput, BatchProcessor, Estimator, TrainState
from fitforge.checkpoint.files import load_checkpoint, save_checkpoint
from fitforge.core.events import Stage
from fitforge.events import BatchBegin, BatchEnd
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, GradientUpdateHandler, LRSchedulerHandler
from helpers import Crash, Losses

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(24, 3, generator=g), torch.randn(24, 1, generator=g)
BATCHES = [(X[i : i + 4], Y[i : i + 4]) for i in range(0, 24, 4)]  # 6 batches of 4


class Pair(nn.Module):
    """A 'generator' then a 'discriminator': either one's loss reaches both parts' parameters."""

    def __init__(self):
        super().__init__()
        self.gen, self.disc = nn.Linear(3, 2), nn.Linear(2, 1)

    def forward(self, x):
        return self.disc(self.gen(x))


class ByTurns(BatchProcessor):
    """Steps the optimizers ``pattern`` names, batch by batch (the global step picks the entry).

    ``form``: "index" ([0]), "object" ([estimator.optimizers[0]]) or a fixed choice for every batch.
    ``own_only``: keep each loss's backward on the parameters of the optimizer it steps."""

    def __init__(self, pattern=(0, 1), form="index", own_only=False):
        super().__init__()
        self.pattern, self.form, self.own_only = pattern, form, own_only

    def fit_batch(self, state, batch):
        x, y = batch
        net, chosen = state.estimator.net, self.pattern[state.global_step % len(self.pattern)]
        frozen = net.gen if chosen == 0 else net.disc
        if self.own_only:
            frozen.requires_grad_(False)
        with self.autocast(state):
            pred = net(x)
            loss = nn.functional.mse_loss(pred.float(), y)
        scaler = state.estimator.scaler
        (loss if scaler is None else scaler.scale(loss)).backward()
        frozen.requires_grad_(True)
        if self.form == "index":
            step = [chosen]
        elif self.form == "object":
            step = (state.estimator.optimizers[chosen],)
        else:
            step = self.form
        return BatchOutput((x,), y, pred, loss, (loss,), len(x), step)


def make(pattern=(0, 1), form="index", own_only=False, optimizer=torch.optim.SGD, **kwargs):
    torch.manual_seed(0)
    net = Pair()
    optimizers = [optimizer(net.disc.parameters(), lr=0.1), optimizer(net.gen.parameters(), lr=0.1)]
    return Estimator(
        net,
        nn.MSELoss(),
        optimizer=optimizers,
        device="cpu",
        batch_processor=ByTurns(pattern, form, own_only),
        **kwargs,
    )


def flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


class Watch(BatchBegin, BatchEnd):
    """Each batch's parameters before and after the step, and the gradients left after it."""

    priority = Stage.STEP + 1

    def __init__(self):
        self.moved, self.grads_left = [], []

    def batch_begin(self, state):
        net = state.estimator.net
        self.before = flat(net.disc), flat(net.gen)

    def batch_end(self, state):
        net = state.estimator.net
        after = flat(net.disc), flat(net.gen)
        self.moved.append(tuple(not torch.equal(a, b) for a, b in zip(self.before, after)))
        self.grads_left.append(
            tuple(any(p.grad is not None for p in part.parameters()) for part in (net.disc, net.gen))
        )


def hand_trained(pattern, accumulate=1, epochs=1, batches=BATCHES, clip_norm=None):
    """The same training written out: each optimizer averages its own batches' gradients (each loss
    reaches its own part only) and steps every ``accumulate`` of them, a partial group at epoch end."""
    torch.manual_seed(0)
    net = Pair()
    parts = [net.disc, net.gen]
    optimizers = [torch.optim.SGD(part.parameters(), lr=0.1) for part in parts]
    step = 0
    for _ in range(epochs):
        counts = [0, 0]
        for x, y in batches:
            chosen = pattern[step % len(pattern)]
            parts[1 - chosen].requires_grad_(False)
            nn.functional.mse_loss(net(x), y).backward()
            parts[1 - chosen].requires_grad_(True)
            counts[chosen] += 1
            if counts[chosen] == accumulate:
                _hand_step(parts, optimizers, [chosen], counts, clip_norm)
            step += 1
        _hand_step(parts, optimizers, [i for i, count in enumerate(counts) if count], counts, clip_norm)
    return net


def _hand_step(parts, optimizers, due, counts, clip_norm):
    """The optimizers ``due`` step together (the trailing groups at epoch end): one clipping for all."""
    for i in due:
        for p in parts[i].parameters():
            p.grad /= counts[i]
        counts[i] = 0
    if clip_norm is not None and due:
        torch.nn.utils.clip_grad_norm_([p for i in due for p in parts[i].parameters()], clip_norm)
    for i in due:
        optimizers[i].step()
        optimizers[i].zero_grad()


def assert_same_weights(a, b):
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# -- which parameters move ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["index", "object"])
def test_each_batch_steps_only_the_optimizer_it_names_and_drops_what_leaked_to_the_other(form):
    estimator, watch = make(form=form), Watch()
    estimator.fit(BATCHES, epochs=1, event_handlers=[watch])
    assert watch.moved == [(True, False), (False, True)] * 3  # disc on even batches, gen on odd ones
    assert watch.grads_left == [(False, False)] * 6  # the other part's leaked gradients are gone
    # Discarding the leak makes each step the one of a loop that zeroes every gradient per batch.
    assert_same_weights(estimator.net, hand_trained((0, 1)))


def test_discarding_the_leak_equals_a_loss_that_never_reaches_the_other_part():
    leaky, tight = make(), make(own_only=True)
    leaky.fit(BATCHES, epochs=1)
    tight.fit(BATCHES, epochs=1)
    assert_same_weights(leaky.net, tight.net)


def test_step_none_steps_every_optimizer_as_before():
    estimator, watch = make(form=None), Watch()
    estimator.fit(BATCHES, epochs=1, event_handlers=[watch])
    assert watch.moved == [(True, True)] * 6


def test_a_repeated_or_unordered_choice_steps_each_named_optimizer_once():
    estimator, watch = make(form=[1, 0, 1]), Watch()
    steps = []
    estimator.fit(BATCHES, epochs=1, event_handlers=[watch, Record(steps)])
    assert watch.moved == [(True, True)] * 6 and steps[-1] == (6, 0, [6, 6])


class Record(BatchEnd):
    """(optimizer_steps, accumulated_batches, steps per optimizer) after each batch's step."""

    priority = Stage.STEP + 1

    def __init__(self, seen):
        self.seen = seen

    def batch_end(self, state):
        updater = state.services.steps
        self.seen.append((state.optimizer_steps, state.accumulated_batches, updater.steps_per_optimizer(state)))


# -- accumulation and clipping per optimizer ----------------------------------------------------------

PATTERN = (0, 1, 1, 0, 1, 0, 0)  # disc: batches 0 3 5 6; gen: 1 2 4 (and 7 8 ... in a second epoch)


def test_accumulation_counts_each_optimizers_own_batches():
    estimator, watch, seen = make(PATTERN, own_only=True), Watch(), []
    updater = GradientUpdateHandler(accumulate=2)
    estimator.fit(BATCHES + BATCHES[:1], epochs=1, event_handlers=[updater, watch, Record(seen)], check_access=True)
    # gen's group {1, 2} steps at batch 2, disc's {0, 3} at 3 and {5, 6} at 6, gen's {4} at epoch end.
    assert watch.moved == [(False, False), (False, False), (False, True), (True, False)] + [(False, False)] * 2 + [
        (True, False)
    ]
    assert [(steps, open_) for steps, open_, _ in seen] == [(0, 1), (0, 1), (1, 1), (2, 0), (2, 1), (2, 1), (3, 1)]
    assert updater.steps_per_optimizer(TrainState(estimator, optimizer_steps=4)) == [
        2,
        2,
    ]  # 4 steps: the trailing one is gen's
    assert_same_weights(estimator.net, hand_trained(PATTERN, accumulate=2, batches=BATCHES + BATCHES[:1]))


def test_accumulation_per_optimizer_over_two_epochs_matches_the_hand_loop():
    estimator = make(PATTERN, own_only=True)
    estimator.fit(BATCHES, epochs=2, event_handlers=[GradientUpdateHandler(accumulate=2)])
    assert_same_weights(estimator.net, hand_trained(PATTERN, accumulate=2, epochs=2))


def test_clipping_covers_the_parameters_of_the_optimizers_that_step():
    # gen steps at batch 2 while disc's group (batch 0) holds large gradients: they must not count in
    # gen's norm, and disc's are clipped on their own at its step.
    big = [(x, y * 100) for x, y in BATCHES]
    estimator = make(PATTERN, own_only=True)
    estimator.fit(big, epochs=1, event_handlers=[GradientUpdateHandler(accumulate=2, clip_norm=0.01)])
    assert_same_weights(estimator.net, hand_trained(PATTERN, accumulate=2, batches=big, clip_norm=0.01))


def test_clipping_by_norm_bounds_each_stepped_optimizers_update():
    estimator, updates = make(own_only=True), []

    class Update(BatchBegin, BatchEnd):
        priority = Stage.STEP + 1

        def batch_begin(self, state):
            self.before = flat(state.estimator.net)

        def batch_end(self, state):
            updates.append((flat(state.estimator.net) - self.before) / 0.1)

    estimator.fit(
        [(x, y * 100) for x, y in BATCHES], epochs=1, event_handlers=[GradientUpdateHandler(clip_norm=0.01), Update()]
    )
    assert [u.norm().item() for u in updates] == pytest.approx([0.01] * 6, rel=1e-4)


# -- fp16 -----------------------------------------------------------------------------------------------


def fp16(pattern, **kwargs):
    estimator = make(pattern, own_only=True, precision="16-mixed", **kwargs)
    estimator.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # no overflow at the start
    return estimator


@pytest.mark.parametrize("accumulate, stepping_batches", [(1, 6), (2, 3)])
def test_fp16_steps_the_chosen_and_updates_the_scaler_once_per_batch_that_stepped(accumulate, stepping_batches):
    estimator, watch = fp16((0, 0, 1, 1)), Watch()
    estimator.fit(BATCHES, epochs=1, event_handlers=[GradientUpdateHandler(accumulate=accumulate), watch])
    if accumulate == 1:
        assert watch.moved == [(True, False), (True, False), (False, True), (False, True)] * 1 + [(True, False)] * 2
    else:  # disc {0, 1} at 1, gen {2, 3} at 3, disc {4, 5} at 5
        assert watch.moved == [
            (False, False),
            (True, False),
            (False, False),
            (False, True),
            (False, False),
            (True, False),
        ]
    assert int(estimator.scaler._growth_tracker) == stepping_batches  # one update per batch that stepped
    assert estimator.scaler.get_scale() == 256.0


class InfOnGen(BatchEnd):
    """An inf gradient on gen at batch 2 (gen's step), recording disc's open group around the step."""

    priority = Stage.STEP - 1

    def __init__(self):
        self.disc_grads = []

    def batch_end(self, state):
        if state.global_step == 2:
            state.estimator.net.gen.weight.grad.fill_(float("inf"))
            self.disc_grads.append(state.estimator.net.disc.weight.grad.clone())


class After(BatchEnd):
    priority = Stage.STEP + 1

    def __init__(self, seen):
        self.seen = seen

    def batch_end(self, state):
        if state.global_step == 2:
            self.seen.append(state.estimator.net.disc.weight.grad.clone())


@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_fp16_an_overflow_skips_that_step_and_rescales_the_other_optimizers_open_group(clip_norm):
    # Pattern (0, 1, 1, 0): disc's group {0, 3} is open while gen steps at batch 2 with an inf gradient.
    estimator, inf, watch = fp16((0, 1, 1, 0)), InfOnGen(), Watch()
    handlers = [GradientUpdateHandler(accumulate=2, clip_norm=clip_norm), inf, After(inf.disc_grads), watch]
    estimator.fit(BATCHES[:4], epochs=1, event_handlers=handlers)
    assert watch.moved == [(False, False), (False, False), (False, False), (True, False)]  # gen's step skipped
    assert estimator.scaler.get_scale() == 128.0  # backed off once
    before, after = inf.disc_grads
    torch.testing.assert_close(after, before / 2)  # disc's group keeps one scale: the current one
    assert torch.isfinite(estimator.net.disc.weight).all()


# -- schedulers ------------------------------------------------------------------------------------------


class LRs(BatchEnd):
    priority = Stage.PERSIST + 1

    def __init__(self):
        self.seen = []

    def batch_end(self, state):
        self.seen.append(tuple(o.param_groups[0]["lr"] for o in state.estimator.optimizers))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_batch_scheduler_steps_only_with_its_own_optimizer(accumulate):
    estimator, lrs = make(own_only=True), LRs()
    gen_schedule = LRSchedulerHandler(S.ExponentialLR(estimator.optimizers[1], 0.5), interval="batch")
    handlers = [GradientUpdateHandler(accumulate=accumulate), gen_schedule, lrs]
    history = estimator.fit(BATCHES, epochs=2, event_handlers=handlers, check_access=True)  # declarations hold
    if accumulate == 1:  # gen steps on odd batches: 3 steps per epoch
        assert [gen for _, gen in lrs.seen[:6]] == [0.1, 0.05, 0.05, 0.025, 0.025, 0.0125]
    else:  # gen's groups {1, 3} and {5, 7}...: a step every 4 batches, and its trailing one at epoch end
        assert [gen for _, gen in lrs.seen[:6]] == [0.1, 0.1, 0.1, 0.05, 0.05, 0.05]
    assert {disc for disc, _ in lrs.seen} == {0.1}
    assert gen_schedule.scheduler.last_epoch == (6 if accumulate == 1 else 4)
    assert history["lr_1"][-1] == pytest.approx(0.1 * 0.5 ** (6 if accumulate == 1 else 4))


# -- exact resume ---------------------------------------------------------------------------------------


def train(folder, seed=0, resume=False, crash=None, epochs=2):
    """Two Adams stepped by turns with accumulate=2 (gradients leak into disc's open group), a batch
    scheduler on gen, a checkpoint after every batch. (weights, losses by step, history or None)."""
    torch.manual_seed(seed)
    estimator = make((0, 1, 1), optimizer=torch.optim.Adam)
    torch.manual_seed(seed)
    losses = Losses()
    handlers = [
        losses,
        GradientUpdateHandler(accumulate=2),
        LRSchedulerHandler(S.LambdaLR(estimator.optimizers[1], lambda step: 1 / (1 + step)), interval="batch"),
        CheckpointHandler(folder, epoch_period=None, batch_period=1, max_checkpoints=2, resume_from_checkpoint=resume),
        *([Crash(crash)] if crash else []),
    ]
    data = DataLoader(TensorDataset(X, Y), batch_size=4, shuffle=True)
    try:
        history = estimator.fit(data, epochs=epochs, event_handlers=handlers)
    except RuntimeError as error:
        assert str(error) == "crash"
        history = None
    return {k: v.clone() for k, v in estimator.net.state_dict().items()}, losses.seen, history


_whole = {}


def uninterrupted(tmp_path_factory):
    if not _whole:
        _whole["run"] = train(tmp_path_factory.mktemp("whole"))
    return _whole["run"]


def assert_resumes_exactly(folder, whole, crash):
    weights, after, history = train(folder, seed=123, resume=True)
    assert min(after) == crash
    assert all(torch.equal(weights[k], whole[0][k]) for k in whole[0])
    assert history["lr_1"] == whole[2]["lr_1"] and history["train_loss"] == whole[2]["train_loss"]


# 2: disc's group open, gen's open; 4: gen's group open across disc's step; 6: the last batch of
# epoch 1 (its trailing groups step at epoch end); 8: mid-epoch 2.
@pytest.mark.parametrize("crash", [2, 4, 6, 8])
def test_a_crash_mid_group_with_two_optimizers_resumes_exactly(tmp_path, tmp_path_factory, crash):
    whole = uninterrupted(tmp_path_factory)
    train(tmp_path, crash=crash)
    saved = load_checkpoint(next(tmp_path.glob(f"*batch{crash}.pt")))
    assert set(saved["handlers"]["GradientUpdateHandler"]) == {"accumulated", "skipped_steps"}
    assert_resumes_exactly(tmp_path, whole, crash)


def test_a_checkpoint_without_per_optimizer_state_resumes_with_one_shared_group(tmp_path):
    # Written before per-optimizer groups: step=None with accumulate=2, two batches into a group of
    # both optimizers; its GradientUpdateHandler state is empty.
    def run(folder, resume=False, crash=None):
        estimator, losses = make(form=None), Losses()
        handlers = [
            losses,
            GradientUpdateHandler(accumulate=4),
            CheckpointHandler(folder, epoch_period=None, batch_period=1, resume_from_checkpoint=resume),
            *([Crash(crash)] if crash else []),
        ]
        with contextlib.suppress(RuntimeError):
            estimator.fit(BATCHES, epochs=1, event_handlers=handlers)
        return estimator.net

    whole = run(tmp_path / "whole")
    run(tmp_path / "cut", crash=2)
    path = next((tmp_path / "cut").glob("*batch2.pt"))
    old = load_checkpoint(path)
    old.pop("checksum", None)
    assert old["accumulated_batches"] == 2
    old["handlers"]["GradientUpdateHandler"] = {}
    save_checkpoint(old, path)
    assert_same_weights(run(tmp_path / "cut", resume=True), whole)


# -- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step, error, message",
    [
        (
            [2],
            FitforgeValueError,
            r"BatchOutput.step of batch 0 \(epoch 0\) names optimizer 2, but the estimator "
            r"has 2 optimizer\(s\): use an index from 0 to 1",
        ),
        ([-1], FitforgeValueError, "names optimizer -1"),
        (["0"], FitforgeTypeError, r"holds str '0'; name optimizers by their index into estimator.optimizers"),
        ([True], FitforgeTypeError, "holds bool True"),
        (
            [torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)],
            FitforgeValueError,
            r"holds SGD .* which is not one of the estimator's 2 optimizer\(s\): give it to the Estimator",
        ),
        ([], FitforgeValueError, r"is empty: name at least one optimizer \(step=\[0\]\), or step=None"),
        (0, FitforgeTypeError, r"must be a list or tuple .* got int 0; write step=\[0\]"),
    ],
)
def test_a_bad_choice_fails_at_the_first_batch_before_any_step(step, error, message):
    estimator = make(form=step)
    before = flat(estimator.net)
    with pytest.raises(error, match=message):
        estimator.fit(BATCHES, epochs=1)
    assert torch.equal(flat(estimator.net), before)


def test_a_bad_choice_at_a_later_batch_names_it_before_its_step():
    estimator, watch = make(pattern=(0, 1, 0, 5)), Watch()
    with pytest.raises(FitforgeValueError, match=r"batch 3 \(epoch 0\) names optimizer 5"):
        estimator.fit(BATCHES, epochs=1, event_handlers=[watch])
    assert len(watch.moved) == 3


def test_a_shared_parameter_is_kept_while_one_of_its_optimizers_steps():
    torch.manual_seed(0)
    net = Pair()
    weight, bias = net.gen.weight.detach().clone(), net.gen.bias.detach().clone()
    optimizers = [  # gen's bias is in both
        torch.optim.SGD([*net.disc.parameters(), net.gen.bias], lr=0.1),
        torch.optim.SGD(net.gen.parameters(), lr=0.1),
    ]
    estimator = Estimator(net, nn.MSELoss(), optimizer=optimizers, device="cpu", batch_processor=ByTurns((0,)))
    watch = Watch()
    estimator.fit(BATCHES[:1], epochs=1, event_handlers=[watch])
    assert torch.equal(net.gen.weight, weight)  # only in gen's optimizer, not stepped: its gradient dropped
    assert not torch.equal(net.gen.bias, bias)  # stepped by disc's optimizer
    assert watch.grads_left == [(False, False)]

"""ThroughputHandler: samples and tokens per second of each training epoch by default; FLOP/s and
MFU when asked for; nothing read to the host per batch."""

import logging
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.events import BatchEnd
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import ThroughputHandler
from fitforge.handlers import throughput as module
from fitforge.testing import HostReadCounter

torch.manual_seed(0)
X, Y = torch.randn(40, 6), torch.randint(0, 3, (40,))


class Clock:
    """A perf_counter that moves only when told (the handler's only clock)."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Tick(BatchEnd):
    """Each batch takes ``seconds`` on the clock."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds = clock, seconds

    def batch_end(self, state):
        self.clock.now += self.seconds


@pytest.fixture()
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(module.time, "perf_counter", fake)
    return fake


def classifier():
    net = nn.Linear(6, 3)
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")


def test_a_default_fit_records_samples_per_second(clock):
    history = classifier().fit(
        DataLoader(TensorDataset(X, Y), batch_size=8), val_data=[(X, Y)], epochs=2, event_handlers=[Tick(clock, 0.5)]
    )
    assert history["train_samples_per_s"] == [40 / 2.5, 40 / 2.5]  # 5 batches of 0.5 s; validation not timed
    assert "train_tokens_per_s" not in history and "train_flops_per_s" not in history


def test_the_figure_is_in_the_epoch_line(caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        classifier().fit([(X, Y)], epochs=1)
    assert re.search(r"\[Epoch 1/1\] train_loss=\S+ train_accuracy=\S+ train_samples_per_s=\d", caplog.text)


class TinyLM(nn.Module):
    """Takes input_ids and an attention mask; computes its loss from labels (a dict batch)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 20)

    def forward(self, input_ids, attention_mask, labels):
        logits = self.head(self.embed(input_ids) * attention_mask.unsqueeze(-1))
        return {"loss": nn.functional.cross_entropy(logits.transpose(1, 2), labels), "logits": logits}


def token_batches(count, padded=True):
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        ids = torch.randint(1, 20, (4, 12), generator=generator)
        lengths = torch.randint(3, 13, (4,), generator=generator) if padded else torch.full((4,), 12)
        mask = (torch.arange(12) < lengths.unsqueeze(1)).long()
        batches.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids})
    return batches


def test_tokens_are_the_non_padding_ones_of_the_attention_mask(clock):
    batches = token_batches(6)
    estimator = Estimator(TinyLM(), None, optimizer="adam", device="cpu")
    history = estimator.fit(batches, epochs=1, event_handlers=[Tick(clock, 0.25)])
    tokens = sum(int(batch["attention_mask"].sum()) for batch in batches)
    assert tokens < 6 * 4 * 12  # padding is left out
    assert history["train_tokens_per_s"] == [tokens / 1.5] and history["train_samples_per_s"] == [24 / 1.5]


def test_tokens_per_second_match_the_count_over_the_training_time_within_5_percent():
    batches = token_batches(200)
    estimator = Estimator(TinyLM(), None, optimizer="adam", device="cpu")
    history = estimator.fit(batches, epochs=1)
    tokens = sum(int(batch["attention_mask"].sum()) for batch in batches)
    assert history["train_tokens_per_s"][0] == pytest.approx(tokens / history["epoch_time"][0], rel=0.05)


def test_input_ids_without_a_mask_count_every_token(clock):
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(20, 3)

        def forward(self, input_ids):
            return self.embed(input_ids).mean(1)

    batches = [{"input_ids": torch.randint(0, 20, (4, 12)), "labels": torch.randint(0, 3, (4,))}] * 3
    estimator = Estimator(Plain(), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    history = estimator.fit(batches, epochs=1, event_handlers=[Tick(clock, 1.0)])
    assert history["train_tokens_per_s"] == [3 * 4 * 12 / 3.0]


def test_flops_are_counted_once_and_give_mfu_over_the_peak(clock):
    handler = ThroughputHandler(peak_flops=1e9)
    history = classifier().fit(
        DataLoader(TensorDataset(X, Y), batch_size=8), epochs=2, event_handlers=[handler, Tick(clock, 0.5)]
    )
    # Linear(6, 3) on 8 samples: 2 * 8 * 6 * 3 FLOPs forward, as many for the weight's gradient (the data needs none)
    assert handler.step_flops == 2 * (2 * 8 * 6 * 3)
    flops_per_s = handler.step_flops * 5 / 2.5
    assert history["train_flops_per_s"] == [flops_per_s] * 2
    assert history["train_mfu"] == [flops_per_s / 1e9] * 2
    assert handler.history_keys(classifier(), "train") == ["train_samples_per_s", "train_flops_per_s", "train_mfu"]
    assert "train_samples_per_s" in classifier().history_keys()  # the default handler's key, known before training


def test_without_a_known_peak_mfu_is_left_out_with_one_info_line(caplog):
    with caplog.at_level(logging.INFO, logger="fitforge"):
        history = classifier().fit([(X, Y)], epochs=2, event_handlers=[ThroughputHandler()])
    assert "train_flops_per_s" in history and "train_mfu" not in history
    lines = [r.getMessage() for r in caplog.records if "ThroughputHandler" in r.getMessage()]
    assert len(lines) == 1 and "peak FLOP/s of cpu in fp32 is not known" in lines[0] and "peak_flops=" in lines[0]


def test_no_host_read_per_batch():
    def reads(count):
        estimator = Estimator(TinyLM(), None, optimizer="sgd", device="cpu")
        with HostReadCounter() as counter:
            estimator.fit(token_batches(count), epochs=1, event_handlers=[ThroughputHandler()])
        return counter.count

    assert reads(3) == reads(24)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"flops": 1}, FitforgeTypeError, "flops must be True or False, got int 1"),
        ({"peak_flops": 0}, FitforgeValueError, "peak_flops is a device's peak in FLOP/s (e.g. 989e12), got int 0"),
        ({"peak_flops": "989e12"}, FitforgeValueError, "got str '989e12'"),
        ({"flops": False, "peak_flops": 1e12}, FitforgeValueError, "peak_flops gives MFU, which needs flops=True"),
    ],
)
def test_argument_errors(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        ThroughputHandler(**kwargs)


def test_the_peak_table_knows_common_gpus_by_name(monkeypatch):
    from fitforge.reporting import peak_flops as peaks

    monkeypatch.setattr(peaks.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(peaks.torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert peaks.peak_flops(cuda, torch.bfloat16) == 989e12
    assert peaks.peak_flops(cuda, None) == 67e12  # float32 maths without TF32 (torch's default)
    monkeypatch.setattr(peaks.torch.cuda, "get_device_name", lambda device: "NVIDIA H100 PCIe")
    assert peaks.peak_flops(cuda, torch.float16) == 756e12
    monkeypatch.setattr(peaks.torch.cuda, "get_device_name", lambda device: "NVIDIA H100 NVL")
    assert peaks.peak_flops(cuda, torch.bfloat16) == 835e12
    monkeypatch.setattr(peaks.torch.cuda, "get_device_name", lambda device: "NVIDIA L40")
    assert peaks.peak_flops(cuda, torch.bfloat16) == 181e12  # not the L4's
    monkeypatch.setattr(peaks.torch.cuda, "get_device_name", lambda device: "Tesla T4")
    assert peaks.peak_flops(cuda, torch.bfloat16) is None  # no bf16 on a T4
    monkeypatch.setattr(peaks.torch.cuda, "get_device_name", lambda device: "Some Future GPU")
    assert peaks.peak_flops(cuda, torch.bfloat16) is None
    assert peaks.peak_flops(torch.device("cpu"), None) is None


def test_a_cancelled_first_batch_is_not_counted_into_the_step(clock):
    from fitforge.events import BatchBegin
    from fitforge.exceptions import CancelBatch

    class CancelFirst(BatchBegin):
        priority = 10  # after the handler's counter started

        def batch_begin(self, state):
            if state.global_step == 0 and state.batch_idx == 0:
                state.estimator.net(X[:8])  # some forward work, then the batch is cancelled
                raise CancelBatch

    handler = ThroughputHandler()
    classifier().fit(DataLoader(TensorDataset(X, Y), batch_size=8), epochs=1, event_handlers=[handler, CancelFirst()])
    assert handler.step_flops == 2 * (2 * 8 * 6 * 3)  # the next batch's step alone


def test_a_loss_only_output_with_a_metric_names_the_missing_logits():
    class LossOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(6, 6)

        def forward(self, x):
            return {"loss": nn.functional.mse_loss(self.linear(x), x)}

    estimator = Estimator(LossOnly(), None, optimizer="sgd", device="cpu", train_metrics="mae")
    with pytest.raises(FitforgeValueError, match="returned its loss without 'logits', the item metrics read"):
        estimator.fit(X, batch_size=8, epochs=1)
    history = Estimator(LossOnly(), None, optimizer="sgd", device="cpu").fit(X, batch_size=8, epochs=2)
    assert history["train_loss"][1] < history["train_loss"][0]  # without metrics it trains


def test_a_tally_never_adds_into_the_callers_tensor():
    from fitforge.metrics.base import Tally

    tally, first = Tally(), torch.tensor(3)
    tally.add(4, first)
    tally.add(4, torch.tensor(5))
    tally.add(4, 2)
    assert int(first) == 3 and tally.total() == 10 and tally.count == 12

"""GradientUpdateHandler(accumulate=k) over batches of different numbers of counted items (tokens
that are not padding) steps as one batch of them all: each batch's loss is weighed by its items."""

import contextlib
import logging

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.exceptions import FitforgeTypeError
from fitforge.handlers import GradientUpdateHandler
from fitforge.optim.item_counts import item_counter
from fitforge.testing import HostReadCounter
from helpers import LENGTHS, PAD, VOCAB, Tagger, padded_together, tagged_batches


def weights_after(net, loss, batches, handler):
    estimator = Estimator(net, loss, device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.5))
    estimator.fit(batches, epochs=1, event_handlers=[handler], default_handlers=False)
    return {name: value.detach().clone() for name, value in net.state_dict().items()}


def assert_close(a, b, rel=1e-6):
    for name in b:
        assert torch.allclose(a[name], b[name], rtol=rel, atol=1e-7), name


@pytest.mark.parametrize("weight", [None, torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5])])
def test_four_batches_of_different_padded_lengths_step_as_their_concatenation(weight):
    batches = tagged_batches()
    loss = nn.CrossEntropyLoss(ignore_index=PAD, weight=weight)
    accumulated = weights_after(Tagger(), loss, batches, GradientUpdateHandler(accumulate=4))
    one_step = weights_after(Tagger(), loss, [padded_together(batches)], GradientUpdateHandler())
    assert_close(accumulated, one_step)
    unweighted = weights_after(Tagger(), loss, batches, GradientUpdateHandler(accumulate=4, items=None))
    assert not torch.allclose(unweighted["out.weight"], one_step["out.weight"], rtol=1e-3)  # the flaw it mends


def test_a_count_of_your_own_weighs_the_batches(caplog):
    batches = tagged_batches()

    def masked_loss(pred, tags):  # a mean over the tags that are not padding, written by hand
        kept = tags != PAD
        return nn.functional.cross_entropy(pred.permute(0, 2, 1)[kept], tags[kept])

    def tags_of(inputs, label):
        return (label != PAD).sum()

    with caplog.at_level(logging.INFO, logger="fitforge"):
        counted = weights_after(Tagger(), masked_loss, batches, GradientUpdateHandler(accumulate=4, items=tags_of))
    assert "averages its 4 batches' losses alike" not in caplog.text
    one_step = weights_after(Tagger(), masked_loss, [padded_together(batches)], GradientUpdateHandler())
    assert_close(counted, one_step)


def test_a_loss_it_cannot_count_keeps_equal_weights_and_says_how_to_count_once(caplog, monkeypatch):
    from fitforge.optim import item_counts

    monkeypatch.setattr(item_counts, "_SAID", set())
    net = nn.Linear(3, 1)
    batches = [(torch.randn(n, 3), torch.randn(n, 1)) for n in (2, 4)]
    with caplog.at_level(logging.INFO, logger="fitforge"):
        for _ in range(2):  # a second fit (a run fitting in turns, a study's trials) is not told again
            weights_after(net, nn.MSELoss(), batches, GradientUpdateHandler(accumulate=2))
    assert caplog.text.count("averages its 2 batches' losses alike") == 1
    assert (
        "GradientUpdateHandler: accumulate=2 averages its 2 batches' losses alike, not weighted by their items: its "
        "loss MSELoss is not a mean over items fitforge can count. To weigh them (one step then equals one on the "
        "concatenated batches), pass GradientUpdateHandler(items=lambda inputs, label: <the batch's item count, "
        "a tensor>)"
    ) in caplog.text


class OwnLoss(nn.Module):
    """A net computing its own mean loss (its forward takes no num_items_in_batch): not counted."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(3, 1)

    def forward(self, x, y, attention_mask=None):
        return {"loss": nn.functional.mse_loss(self.out(x), y)}


@pytest.mark.parametrize(
    ("batches", "told"),
    [
        ([{"x": torch.randn(4, 3), "y": torch.randn(4, 1)} for _ in range(4)], False),  # fixed-length blocks
        ([{"x": torch.randn(n, 3), "y": torch.randn(n, 1)} for n in (4, 4, 2, 4)], True),  # shapes differ
        ([{"x": torch.randn(4, 3), "y": torch.randn(4, 1), "attention_mask": torch.ones(4)}] * 4, True),  # padded
    ],
)
def test_the_line_is_said_only_when_the_first_groups_batches_may_count_differently(batches, told, caplog, monkeypatch):
    from fitforge.optim import item_counts

    monkeypatch.setattr(item_counts, "_SAID", set())
    net = OwnLoss()
    estimator = Estimator(net, None, device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with caplog.at_level(logging.INFO, logger="fitforge"):
        estimator.fit(batches, epochs=1, event_handlers=[GradientUpdateHandler(accumulate=4)], default_handlers=False)
    assert ("averages its 4 batches' losses alike" in caplog.text) is told


def test_counting_reads_nothing_to_the_host():
    def reads(groups):
        net = Tagger()
        loss = nn.CrossEntropyLoss(ignore_index=PAD)
        estimator = Estimator(net, loss, device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        handlers = [GradientUpdateHandler(accumulate=4)]
        with HostReadCounter() as counter:
            estimator.fit(tagged_batches() * groups, epochs=1, event_handlers=handlers, default_handlers=False)
        return counter.count

    assert reads(1) == reads(3)  # reads of the fit's start and end, none per batch or per step


def test_items_must_be_auto_none_or_a_function():
    with pytest.raises(FitforgeTypeError, match="GradientUpdateHandler: items must be 'auto', None or a function"):
        GradientUpdateHandler(accumulate=2, items=3)


def test_the_counts_of_the_losses_it_knows():
    label = torch.tensor([[1, 2, PAD], [0, PAD, PAD]])
    counter, _ = item_counter(nn.CrossEntropyLoss(ignore_index=PAD), nn.Linear(1, 1))
    assert counter.count(None, label) == 3
    weighted, _ = item_counter(nn.NLLLoss(weight=torch.tensor([2.0, 1.0, 0.5]), ignore_index=PAD), nn.Linear(1, 1))
    assert weighted.count(None, label) == 1.0 + 0.5 + 2.0  # torch's denominator: the weights of classes 1, 2, 0
    soft, _ = item_counter(nn.CrossEntropyLoss(), nn.Linear(1, 1))
    assert soft.count(None, torch.rand(4, 3, 5)) == 20  # probabilities: every sample and position
    summed, why = item_counter(nn.CrossEntropyLoss(reduction="sum"), nn.Linear(1, 1))
    assert summed is None and why == "its CrossEntropyLoss has reduction='sum', not a mean"
    own, why = item_counter(None, nn.Linear(1, 1))
    assert own is None and "computes its loss, and its forward takes no num_items_in_batch" in why


def tiny_causal_lm():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()  # the tiny vocabulary's eos id warning
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return transformers.GPT2LMHeadModel(config)


def text_batches():
    """Dicts of 2 right-padded sequences of different lengths: labels are the tokens, -100 on padding."""
    generator = torch.Generator().manual_seed(2)
    batches = []
    for length, real in LENGTHS:
        tokens = torch.randint(0, VOCAB, (2, length), generator=generator)
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, real:] = 0
        batches.append({"input_ids": tokens, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, PAD)})
    return batches


def test_a_causal_lms_own_loss_weighs_its_batches_by_their_predicted_tokens():
    batches = text_batches()
    width = max(batch["input_ids"].shape[1] for batch in batches)
    together = {
        key: torch.cat(
            [
                nn.functional.pad(b[key], (0, width - b[key].shape[1]), value=PAD if key == "labels" else 0)
                for b in batches
            ]
        )
        for key in batches[0]
    }
    accumulated = weights_after(tiny_causal_lm(), None, batches, GradientUpdateHandler(accumulate=4))
    one_step = weights_after(tiny_causal_lm(), None, [together], GradientUpdateHandler())
    assert_close(accumulated, one_step)
    unweighted = weights_after(tiny_causal_lm(), None, batches, GradientUpdateHandler(accumulate=4, items=None))
    assert any(not torch.allclose(unweighted[k], one_step[k], rtol=1e-4) for k in one_step)


def test_a_window_of_padding_alone_leaves_the_weights_finite():
    batches = [(tokens, torch.full_like(tags, PAD)) for tokens, tags in tagged_batches()[:2]]
    weights = weights_after(Tagger(), nn.CrossEntropyLoss(ignore_index=PAD), batches, GradientUpdateHandler(2))
    assert all(torch.isfinite(value).all() for value in weights.values())


def test_class_weights_with_an_ignore_index_past_the_classes_count():
    counter, _ = item_counter(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0]), ignore_index=255), nn.Linear(1, 1))
    assert counter.count(None, torch.tensor([[0, 255], [1, 1]])) == 5.0


def test_a_module_with_a_module_attribute_is_not_taken_for_a_wrapper():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.module = tiny_causal_lm()

        def forward(self, **batch):
            return self.module(**batch)

    counter, why = item_counter(None, Holder())
    assert counter is None and "Holder computes its loss" in why


@pytest.mark.parametrize(
    ("loss_type", "shifted"),
    [("ForCausalLM", True), ("ForConditionalGeneration", True), ("ForMaskedLM", False), ("ForCTC", None)],
)
def test_a_hugging_face_models_count_follows_its_loss_type(loss_type, shifted):
    model = tiny_causal_lm()
    model.loss_type = loss_type
    counter, why = item_counter(None, model)
    label = torch.tensor([[5, 6, PAD], [7, PAD, PAD]])
    if shifted is None:
        assert counter is None and "(ForCTC) does not divide by num_items_in_batch" in why
    else:
        assert counter.to_model and counter.count(None, label) == (1 if shifted else 3)  # shifted: 6 alone
    assert tiny_causal_lm().loss_type is None  # GPT-2: none, so Hugging Face's causal default


def test_a_batch_without_a_label_tensor_is_not_counted():
    counter, _ = item_counter(None, tiny_causal_lm())
    assert counter.count(None, None) is None and counter.count(None, torch.tensor([1, 2])) is None  # 1-D: no shift


def test_a_fit_batch_of_your_own_that_counts_steps_on_the_mean_at_accumulate_1():
    from fitforge import BatchProcessor

    class Counting(BatchProcessor):
        def fit_batch(self, state, batch):
            inputs, label = self.to_device(state, batch)
            pred = state.estimator.train_net(*inputs)
            loss = state.estimator.compute_loss(pred, label)[0]
            items = (label != PAD).sum()
            self.backward(loss * items)
            return BatchOutput(inputs, label, pred, loss, (loss,), label.shape[0], items=items)

    from fitforge.core.state import BatchOutput

    batches = tagged_batches()[:1]
    loss = nn.CrossEntropyLoss(ignore_index=PAD)
    plain = weights_after(Tagger(), loss, batches, GradientUpdateHandler())
    net = Tagger()
    estimator = Estimator(net, loss, device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.5))
    estimator.batch_processor = Counting()
    estimator.fit(batches, epochs=1, event_handlers=[GradientUpdateHandler()], default_handlers=False)
    assert_close(dict(net.state_dict()), plain)


def test_a_group_resumed_from_a_run_that_did_not_count_ends_uncounted(tmp_path):
    from fitforge.handlers import CheckpointHandler
    from helpers import Crash

    batches, loss = tagged_batches(), nn.CrossEntropyLoss(ignore_index=PAD)

    def fit(items, resume, crash=None):
        net = Tagger()
        estimator = Estimator(net, loss, device="cpu", optimizer=torch.optim.SGD(net.parameters(), lr=0.5))
        saver = CheckpointHandler(tmp_path, batch_period=1, resume_from_checkpoint=resume)
        handlers = [GradientUpdateHandler(2, items=items), saver, *([crash] if crash else [])]
        with contextlib.suppress(RuntimeError):  # the crash
            estimator.fit(batches, epochs=1, event_handlers=handlers, default_handlers=False)
        return dict(net.state_dict())

    fit(None, False, Crash(at=1))  # a group of 2 open after batch 1, its gradient a batch mean
    resumed = fit("auto", True)
    net = Tagger()  # by hand: the first group's batch means averaged, the second weighed by tokens
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    sum(loss(net(t), y) for t, y in batches[:2]).div(2).backward()
    optimizer.step()
    optimizer.zero_grad()
    summed = nn.CrossEntropyLoss(ignore_index=PAD, reduction="sum")
    tokens = sum(int((y != PAD).sum()) for _, y in batches[2:])
    sum(summed(net(t), y) for t, y in batches[2:]).div(tokens).backward()
    optimizer.step()
    assert_close(resumed, dict(net.state_dict()))

"""Packed documents under their mask are the documents alone: the same per-document loss and gradients,
no attention across documents, with the boolean SDPA mask and the flex block mask; and a Hugging Face
Llama given the packed rows' position_ids keeps them apart too."""

import pytest
import torch
from packed_lm import VOCAB, TinyCausalLM, alone, documents, tiny_llama
from torch import nn

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.inputs.document_masks import attend, document_mask
from fitforge.inputs.packing import PackedDocuments

LENGTH = 16


def packed_batch(docs, **options):
    rows = list(PackedDocuments(docs, LENGTH, **options))
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def token_losses(net, batch):
    logits = net(batch["input_ids"], batch["position_ids"], batch["document_ids"])
    return nn.functional.cross_entropy(logits, batch["labels"], reduction="none")  # 0 where the label is -100


def gradients(net, loss):
    net.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in net.named_parameters()}


@pytest.mark.parametrize("split", [False, True])
def test_packed_rows_give_each_documents_loss_and_gradients_as_alone(split):
    docs = documents(count=10, longest=11 if split else 9)
    net = TinyCausalLM()
    batch = packed_batch(docs, split=split)
    assert batch["input_ids"].shape[0] < len(docs)  # several documents share rows
    losses = token_losses(net, batch)
    for index, doc in enumerate(docs):
        own = batch["document_ids"] == index
        alone_loss = token_losses(net, alone(doc)).sum()
        if not split or own.any(dim=1).sum() == 1:  # a split document's pieces see their own row only
            torch.testing.assert_close(losses[own].sum(), alone_loss, rtol=0, atol=1e-10)
    if split:
        return
    packed_grads = gradients(net, losses.sum())
    alone_grads = gradients(net, sum(token_losses(net, alone(doc)).sum() for doc in docs))
    for name in alone_grads:
        torch.testing.assert_close(packed_grads[name], alone_grads[name], rtol=0, atol=1e-10)


def test_unmasked_packing_would_differ():  # the comparison above can fail: without the mask, documents mix
    docs = documents(count=10)
    batch = packed_batch(docs)
    one_document = torch.zeros_like(batch["document_ids"])
    net = TinyCausalLM()
    masked = token_losses(net, batch).sum()
    mixed = nn.functional.cross_entropy(
        net(batch["input_ids"], batch["position_ids"], one_document), batch["labels"], reduction="sum"
    )
    assert (masked - mixed).abs() > 1e-3


def test_no_attention_crosses_documents():
    docs = documents(count=10)
    batch = packed_batch(docs)
    weights = TinyCausalLM().attention_weights(batch["input_ids"], batch["position_ids"], batch["document_ids"])
    ids = batch["document_ids"]
    across = (ids.unsqueeze(-1) != ids.unsqueeze(-2)).unsqueeze(1).expand_as(weights)
    assert across.any() and (weights[across] == 0).all()
    assert (weights[~across & (weights > 0)].numel()) > 0  # tokens do attend inside their documents


FLEX_ON_CPU = "ignore:flex_attention called without torch.compile"  # the CPU runs its unfused form


@pytest.mark.filterwarnings(FLEX_ON_CPU)
@pytest.mark.parametrize("kind", ["sdpa", "flex"])
def test_changing_one_document_changes_no_other_documents_outputs(kind):
    """A probe through the attention itself (SDPA or flex): another document's tokens and positions,
    changed, leave a document's outputs bit for bit."""
    docs = documents(count=10)
    batch = packed_batch(docs)
    changed = {key: value.clone() for key, value in batch.items()}
    row, first = 0, batch["document_ids"][0, 0]
    other = batch["document_ids"][row] == first
    changed["input_ids"][row, other] = (changed["input_ids"][row, other] + 1) % VOCAB
    net = TinyCausalLM(mask_kind=kind).float() if kind == "flex" else TinyCausalLM()
    with torch.no_grad():  # flex attention has no backward on the CPU
        before = net(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        after = net(changed["input_ids"], changed["position_ids"], changed["document_ids"])
    rest = batch["document_ids"][row] != first
    assert torch.equal(before[row][:, rest], after[row][:, rest])
    assert not torch.equal(before[row][:, other], after[row][:, other])
    assert torch.equal(before[1:], after[1:])


@pytest.mark.filterwarnings(FLEX_ON_CPU)
def test_the_flex_block_mask_attends_as_the_boolean_mask():
    ids = packed_batch(documents(count=10))["document_ids"]
    block = document_mask(ids, "flex")
    dense = document_mask(ids, "sdpa")
    assert type(block).__name__ == "BlockMask" and dense.dtype is torch.bool and dense.shape == (len(ids), 1, 16, 16)
    q, k, v = torch.randn(3, len(ids), 2, LENGTH, 4).unbind(0)
    with torch.no_grad():
        torch.testing.assert_close(attend(q, k, v, block), attend(q, k, v, dense), rtol=1e-5, atol=1e-6)
    assert document_mask(ids).dtype is torch.bool  # "auto" on the CPU: the boolean mask (flex has no CPU backward)


def test_padding_attends_only_padding_so_nothing_is_nan():
    batch = packed_batch([[1, 2, 3]])  # one short document: the rest of the row is padding
    net = TinyCausalLM()
    losses = token_losses(net, batch)
    grads = gradients(net, losses.sum())
    assert all(torch.isfinite(g).all() for g in grads.values())
    mask = document_mask(batch["document_ids"])
    assert mask.any(dim=-1).all()  # every query attends to something


def test_bad_arguments_are_named():
    with pytest.raises(FitforgeTypeError, match="document_mask: document_ids must be an integer tensor of shape"):
        document_mask(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(FitforgeTypeError, match="document_ids must be an integer tensor"):
        document_mask(torch.zeros(2, 3))
    with pytest.raises(FitforgeValueError, match=r"document_mask: kind must be one of \('auto', 'flex', 'sdpa'\)"):
        document_mask(torch.zeros(2, 3, dtype=torch.long), kind="dense")
    with pytest.raises(FitforgeTypeError, match="document_ids must be an integer tensor"):
        document_mask(torch.zeros(2, 3, dtype=torch.bool))  # a mask, not ids
    q = torch.zeros(1, 1, 3, 2)
    with pytest.raises(FitforgeTypeError, match="attend: mask must be what document_mask returns .* got a torch.int64"):
        attend(q, q, q, torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_hugging_face_llama_on_packed_rows_gives_each_documents_loss_and_gradients(attention):
    """Rows with labels="tokens", position_ids and no attention mask: the model shifts the labels and, from
    the restarting positions, masks each document off (transformers' packed-sequence detection)."""
    docs = documents(count=10)
    batch = packed_batch(docs, labels="tokens", document_ids=False)
    ids = packed_batch(docs)["document_ids"]
    net = tiny_llama(attention)
    tolerance = 1e-10 if attention == "sdpa" else 1e-6  # eager attention takes its softmax in float32
    logits = net(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    shifted = nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # what the model's loss predicts
    losses = nn.functional.cross_entropy(logits.permute(0, 2, 1), shifted, reduction="none")
    total = 0
    for index, doc in enumerate(docs):
        own_logits = net(input_ids=torch.tensor([doc])).logits[0]
        torch.testing.assert_close(logits[ids == index], own_logits, rtol=0, atol=tolerance)
        alone_loss = nn.functional.cross_entropy(
            own_logits[:-1], torch.tensor(doc[1:], dtype=torch.long), reduction="sum"
        )
        torch.testing.assert_close(losses[ids == index].sum(), alone_loss, rtol=0, atol=tolerance)
        total = total + alone_loss
    packed_grads = gradients(net, losses.sum())
    alone_grads = gradients(net, total)
    for name in alone_grads:
        torch.testing.assert_close(packed_grads[name], alone_grads[name], rtol=0, atol=tolerance)
    # the model's own mean loss is the same per-token mean (its denominator: the labels it predicts; its loss
    # function computes in float32)
    own = net(**batch).loss
    torch.testing.assert_close(own.double(), total / sum(len(doc) - 1 for doc in docs), rtol=1e-6, atol=0)

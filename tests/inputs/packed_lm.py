"""A tiny causal LM for the packing tests: embedding (tokens and positions), one attention layer under a
document mask, a linear head; float64, so that packed and unpacked runs compare to 1e-10."""

import pytest
import torch
from torch import nn

from fitforge.inputs.document_masks import attend, document_mask

VOCAB, WIDTH, HEADS = 13, 8, 2


class TinyCausalLM(nn.Module):
    def __init__(self, mask_kind="sdpa", seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(32, WIDTH)
        self.qkv, self.mix, self.head = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB)
        self.mask_kind = mask_kind
        self.double()

    def embed(self, input_ids, position_ids):
        return self.tokens(input_ids) + self.positions(position_ids)

    def forward(self, input_ids, position_ids, document_ids, hidden=None):
        """(N, VOCAB, L) logits, the layout nn.CrossEntropyLoss takes with (N, L) labels."""
        x = self.embed(input_ids, position_ids) if hidden is None else hidden
        q, k, v = self.heads(x)
        mixed = attend(q, k, v, document_mask(document_ids, self.mask_kind))
        x = x + self.mix(mixed.transpose(1, 2).reshape(x.shape))
        return self.head(x).permute(0, 2, 1)

    def heads(self, x):
        n, length, _ = x.shape
        return self.qkv(x).view(n, length, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)

    def attention_weights(self, input_ids, position_ids, document_ids):
        """The layer's attention weights (N, heads, L, L), computed as SDPA does under the boolean mask."""
        q, k, _ = self.heads(self.embed(input_ids, position_ids))
        scores = q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)
        return scores.masked_fill(~document_mask(document_ids, "sdpa"), float("-inf")).softmax(-1)


def tiny_llama(attention="sdpa", layers=2, double=True):
    """A Hugging Face Llama of random weights (never downloaded), seeded."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation=attention,
        use_cache=False,  # with a cache (the default, even in training) transformers skips its packed-sequence mask
    )
    net = transformers.LlamaForCausalLM(config)
    return net.double() if double else net


def documents(seed=0, count=12, shortest=1, longest=9):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def alone(document):
    """One document as a batch of one row of its own: what packing must not change."""
    tokens = torch.tensor([document])
    labels = torch.cat([tokens[:, 1:], torch.tensor([[-100]])], dim=1)
    return {
        "input_ids": tokens,
        "position_ids": torch.arange(len(document)).unsqueeze(0),
        "document_ids": torch.zeros_like(tokens),
        "labels": labels,
    }

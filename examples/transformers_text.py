"""Fine-tune a Hugging Face ``transformers`` model with fitforge: dict batches and the model's own loss.

A small ``BertForSequenceClassification``, built from a config with random weights (nothing is
downloaded), learns a generated review task: a review is positive when it holds more positive words ("great",
"fun"...) than negative ones ("dull"...), among neutral filler words. The pipeline is the
Hugging Face one: a ``tokenizers`` word-level tokenizer wrapped in ``PreTrainedTokenizerFast``,
``DataCollatorWithPadding`` for padded dict batches ``{input_ids, attention_mask, labels}``, and the
model computing its own loss. fitforge needs ``Estimator(model, loss=None)`` and nothing else: the
model gets the batch as keyword arguments, its ``loss`` is trained on, metrics read its ``logits``.

Reaches 1.0 validation accuracy (target >= 0.95; chance is 0.5) at its second epoch and stops
early after the fifth: about 16 seconds on a 2-core CPU, of which 4 import ``transformers``.

    pip install "fitforge[hf]"
    python examples/transformers_text.py            # full run
    python examples/transformers_text.py --smoke    # one short epoch, for tests
"""

from __future__ import annotations

import random

import common
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils.data import DataLoader
from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding, PreTrainedTokenizerFast

from fitforge import Estimator, History
from fitforge.handlers import EarlyStoppingHandler, LRSchedulerHandler

TARGET = 0.95
POSITIVE = ["great", "fun", "moving", "clever", "superb", "warm", "gripping", "lovely"]
NEGATIVE = ["dull", "awful", "boring", "weak", "messy", "flat", "tedious", "bland"]
NEUTRAL = ["the", "film", "plot", "was", "and", "a", "cast", "story", "but", "with", "scenes", "music"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def review(rng: random.Random) -> tuple[str, int]:
    """A review of 6 to 20 words and its label: 1 when it has more positive words than negative ones
    (by a margin of one or two: 2 against 1, 2 against 3...)."""
    positive, negative = rng.choice([(1, 0), (2, 1), (3, 1), (3, 2), (0, 1), (1, 2), (1, 3), (2, 3)])
    words = [rng.choice(POSITIVE) for _ in range(positive)] + [rng.choice(NEGATIVE) for _ in range(negative)]
    words += [rng.choice(NEUTRAL) for _ in range(rng.randint(6, 20) - len(words))]
    rng.shuffle(words)
    return " ".join(words), int(positive > negative)


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the task's words, built here rather than downloaded."""
    vocab = {word: i for i, word in enumerate(SPECIAL + POSITIVE + NEGATIVE + NEUTRAL)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def dataset(tok: PreTrainedTokenizerFast, size: int, seed: int) -> list[dict]:
    """``size`` tokenized reviews: dicts of ``input_ids``, ``attention_mask`` and ``labels``."""
    rng = random.Random(seed)
    samples = []
    for text, label in (review(rng) for _ in range(size)):
        encoded = tok("[CLS] " + text)  # the classifier reads the first token's state
        samples.append(
            {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "labels": label}
        )
    return samples


def model(vocab_size: int, seed: int) -> BertForSequenceClassification:
    """A two-layer BERT with random weights: 60 thousand parameters."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_dropout_prob=0.0,  # a tiny model on unlimited generated data needs no dropout
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=32,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def main(argv: list[str] | None = None) -> tuple[History, float]:
    """Train and validate; print and return the history and the final validation accuracy."""
    parser = common.example_parser(__doc__, epochs=8, batch_size=32, lr=1e-3)
    parser.add_argument("--samples", type=int, default=4000, help="training reviews (default 4000)")
    args = common.parse(parser, argv)
    tok = tokenizer()
    collate = DataCollatorWithPadding(tok, return_tensors="pt")  # pads each batch to its longest review
    train_set = dataset(tok, args.limit or args.samples, seed=args.seed)
    val_set = dataset(tok, 500, seed=args.seed + 1)
    generator = torch.Generator().manual_seed(args.seed)
    train_loader = DataLoader(train_set, args.batch_size, shuffle=True, collate_fn=collate, generator=generator)
    val_loader = DataLoader(val_set, 100, collate_fn=collate)

    net = model(len(tok), args.seed)
    estimator = Estimator(
        net,
        loss=None,  # the model computes its loss from the batch's labels
        train_metrics="accuracy",  # read from the output's logits
        optimizer=torch.optim.AdamW(net.parameters(), lr=args.lr),
    )
    history = estimator.fit(
        train_loader,
        val_data=val_loader,
        epochs=args.epochs,
        event_handlers=[
            LRSchedulerHandler.one_cycle(max_lr=args.lr),  # warm-up then decay: transformers train badly without
            EarlyStoppingHandler(monitor="val_accuracy", patience=args.patience, restore_best=True),
        ],
    )
    accuracy = estimator.evaluate(val_loader)["val_accuracy"]
    print(f"validation accuracy: {accuracy:.4f} (target >= {TARGET}) after {history.epochs} epochs")
    return history, accuracy


if __name__ == "__main__":
    main()

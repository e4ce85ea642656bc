"""Integration tests of the NLP examples: BiRNN and TextCNN sentiment, the attention translator.

Each example runs on batches of one sample, and a short real training must learn: the training
loss falls and the validation metric beats chance by a stated margin (an untrained model fails).
"""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from helpers import load_example

pytestmark = pytest.mark.integration  # trains the examples

EXAMPLES = ["birnn_sentiment", "textcnn_sentiment", "translator"]
SENTIMENT_CHANCE = 0.5  # balanced labels; also the best any bag-of-words model can do on this corpus
SENTIMENT_MARGIN = 0.25  # so a short training must reach a validation accuracy of 0.75
EXACT_MATCH_CHANCE = 0.0  # guessing a whole ISO date right: about 1 in 73,000
EXACT_MATCH_MARGIN = 0.5


@pytest.mark.parametrize("name", EXAMPLES)
def test_trains_on_batches_of_one(name, tmp_path):
    history = load_example(name).main(
        ["--batch-size", "1", "--epochs", "1", "--limit", "8", "--checkpoint-dir", str(tmp_path)]
    )
    assert history.epochs == 1 and math.isfinite(history["train_loss"][0])
    assert len(list(tmp_path.glob("*-epoch1batch8.pt"))) == 1  # 8 training batches of one sample


@pytest.mark.parametrize("name,prefix", [("birnn_sentiment", "birnn"), ("textcnn_sentiment", "textcnn")])
def test_sentiment_learns_word_order(name, prefix, tmp_path, capsys):
    history = load_example(name).main(
        ["--limit", "2000", "--epochs", "3", "--batch-size", "32", "--lr", "0.006", "--checkpoint-dir", str(tmp_path)]
    )
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert max(history["val_accuracy"]) >= SENTIMENT_CHANCE + SENTIMENT_MARGIN  # the best epoch's weights are kept
    assert (tmp_path / f"{prefix}-best.pt").is_file()
    assert "validation accuracy: " in capsys.readouterr().out


def test_translator_learns_dates(tmp_path, capsys):
    history = load_example("translator").main(
        ["--limit", "2000", "--epochs", "2", "--batch-size", "32", "--lr", "0.004", "--checkpoint-dir", str(tmp_path)]
    )
    assert history["train_loss"][-1] < history["train_loss"][0]
    assert max(history["val_exact_match"]) >= EXACT_MATCH_CHANCE + EXACT_MATCH_MARGIN  # greedy decodes
    assert (tmp_path / "translator-best.pt").is_file()
    out = capsys.readouterr().out
    assert out.count("(expected ") == 5 and "validation exact match: " in out


@pytest.mark.parametrize("name,model", [("birnn_sentiment", "BiRNNClassifier"), ("textcnn_sentiment", "TextCNN")])
def test_sentiment_models_ignore_padding(name, model):
    module = load_example(name)
    net = getattr(module, model)(vocab_size=20).eval()
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    padded = torch.cat([tokens, torch.zeros(1, 7, dtype=torch.int64)], dim=1)  # 0 is <pad>
    lengths = torch.tensor([6])
    torch.testing.assert_close(net(padded, lengths), net(tokens, lengths))


def test_bag_of_words_stays_at_chance():
    """The corpus needs word order: a logistic regression on word counts learns nothing."""
    load_example("birnn_sentiment")  # puts examples/ on sys.path for `data`
    import data

    train, val, vocab = data.sentiment()

    def counts(dataset):
        x = torch.stack([torch.bincount(ids, minlength=len(vocab)).float() for ids in dataset.sequences])
        return TensorDataset(x, torch.stack(dataset.labels))

    net = nn.Linear(len(vocab), 2)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01))
    history = estimator.fit(
        DataLoader(counts(train), batch_size=500, shuffle=True),
        epochs=20,
        val_data=DataLoader(counts(val), batch_size=1000),
        default_handlers=False,
    )
    assert abs(history["val_accuracy"][-1] - SENTIMENT_CHANCE) < 0.05


def test_transformers_text_fine_tunes_a_bert_through_loss_none(capsys):
    pytest.importorskip("transformers")
    history, accuracy = load_example("transformers_text").main(["--epochs", "2"])
    assert accuracy >= 0.95  # the stated target (chance is 0.5): a random-init BERT learnt through its own loss
    assert history["train_loss"][1] < history["train_loss"][0]
    assert f"validation accuracy: {accuracy:.4f}" in capsys.readouterr().out


def test_transformers_text_smoke():
    pytest.importorskip("transformers")
    history, _ = load_example("transformers_text").main(["--smoke"])
    assert history.epochs == 1 and {"train_loss", "train_accuracy", "val_loss", "val_accuracy"} <= set(history)

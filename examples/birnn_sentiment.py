"""Sentiment of movie-review sentences with a bidirectional LSTM, trained with fitforge.

The model embeds the tokens, reads them with a bidirectional LSTM over a packed sequence (the
padding is never read) and classifies the two final states. The data (``data.sentiment``) are
generated sentences such as "the plot was not very funny but charming" (positive), whose label
depends on word order: a bag-of-words classifier stays at chance (50%). Reaches 1.00 validation
accuracy (target >= 0.95) at epoch 2, after a first epoch near chance; early stopping ends the run
three epochs later. About 20 seconds on a 2-core CPU.

    python examples/birnn_sentiment.py                        # full run, checkpoints in a temp folder
    python examples/birnn_sentiment.py --checkpoint-dir ckpt  # keep the checkpoints
    python examples/birnn_sentiment.py --smoke                # one short epoch, for tests
"""

from __future__ import annotations

import common
import data
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.data import DataLoader

from fitforge import BatchProcessor, Estimator, History
from fitforge.handlers import CheckpointHandler, EarlyStoppingHandler, ProgressBarHandler

TARGET = 0.95  # validation accuracy; chance (and any bag-of-words model) is 0.5


class BiRNNClassifier(nn.Module):
    """Embedding -> bidirectional LSTM -> the last state of each direction -> class scores."""

    def __init__(self, vocab_size: int, embed_dim: int = 32, hidden: int = 64, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=data.PAD)
        self.lstm = nn.LSTM(embed_dim, hidden, batch_first=True, bidirectional=True)
        self.dropout = nn.Dropout(0.2)
        self.classify = nn.Linear(2 * hidden, classes)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        # Packing makes each sentence end at its own length, so the forward state is not diluted by
        # padding. pack_padded_sequence reads the lengths on the CPU, where host_inputs keeps them.
        packed = pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (final, _) = self.lstm(packed)  # final: (2 directions, N, hidden)
        return self.classify(self.dropout(torch.cat([final[0], final[1]], dim=1)))


def main(argv: list[str] | None = None) -> History:
    """Train, validate every epoch, stop early; print and return the history.

    ``--limit N`` uses at most N training and N validation samples.
    """
    args = common.parse(common.example_parser(__doc__, epochs=30, batch_size=64, lr=3e-3), argv)
    torch.manual_seed(args.seed)
    train_set, val_set, vocab = data.sentiment(seed=args.seed)
    train_loader = DataLoader(
        data.limit(train_set, args.limit),
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=data.pad_sequences,
        generator=torch.Generator().manual_seed(args.seed),
    )
    val_loader = DataLoader(data.limit(val_set, args.limit), batch_size=256, collate_fn=data.pad_sequences)

    net = BiRNNClassifier(len(vocab))
    # CrossEntropyLoss gets the accuracy metric by default: history keys train_accuracy / val_accuracy.
    # host_inputs=(1,): the lengths (input 1) stay on the CPU, so a GPU is not waited for every batch.
    estimator = Estimator(
        net,
        nn.CrossEntropyLoss(),
        optimizer=torch.optim.Adam(net.parameters(), lr=args.lr),
        batch_processor=BatchProcessor(host_inputs=(1,)),
    )

    with common.checkpoint_dir(args) as folder:
        history = estimator.fit(
            train_loader,
            val_data=val_loader,
            epochs=args.epochs,
            event_handlers=[
                ProgressBarHandler(),
                CheckpointHandler(folder, model_prefix="birnn", monitor="val_accuracy", save_best=True),
                EarlyStoppingHandler(monitor="val_accuracy", patience=args.patience, restore_best=True),
            ],
        )
        # Early stopping put the best epoch's weights back: report the model we keep, not the last epoch.
        accuracy = estimator.evaluate(val_loader)["val_accuracy"]
    print(f"validation accuracy: {accuracy:.4f} (target >= {TARGET}) after {history.epochs} epochs")
    return history


if __name__ == "__main__":
    main()

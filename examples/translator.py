"""Dates written by people translated to ISO 8601 by an encoder-decoder with attention, with fitforge.

"the twenty-first of march 2019", "thursday, march 21, 2019" or "21/03/2019" -> "2019-03-21";
"march 2019" -> "2019-03" (``data.dates``: 11 formats, years 1900-2099). A bidirectional GRU
encodes the source tokens; a GRU decoder writes the ISO date one character at a time, attending
to the encoder's states with additive (Bahdanau) attention.

How it is trained, and what the figures mean:

- A custom ``BatchProcessor`` does teacher forcing: in training, the decoder is fed the true
  previous character. The validation *loss* is computed the same way (so it is comparable with
  the training loss), but the validation *metrics* are computed on greedy decodes, where the
  decoder is fed its own previous prediction, as it will be in use: ``val_exact_match`` is the
  honest figure. The training metrics are measured under teacher forcing.
- Two optimizers, one for the encoder and one for the decoder, passed as
  ``optimizer=[encoder_opt, decoder_opt]``: the decoder gets a 3x larger learning rate, which
  speeds training up here (the history records both rates, ``lr`` and ``lr_1``).
- The loss ignores padding (``CrossEntropyLoss(ignore_index=PAD)`` over N x C x T scores); token
  accuracy ignores it too, and exact match counts a date right only if every character and the
  end-of-sequence mark are right.

Reaches 0.91 validation exact match after one epoch and 1.00 (target >= 0.95) at epoch 2; early
stopping ends the run three epochs later, and a few translations are printed. About a minute on
a 2-core CPU.

    python examples/translator.py                        # full run, checkpoints in a temp folder
    python examples/translator.py --checkpoint-dir ckpt  # keep the checkpoints
    python examples/translator.py --smoke                # one short epoch, for tests
"""

from __future__ import annotations

import common
import data
import torch
from data import BOS, DATE_TARGET, EOS, PAD
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, Subset

from fitforge import BatchOutput, BatchProcessor, Estimator, History, TrainState
from fitforge.handlers import CheckpointHandler, EarlyStoppingHandler, ProgressBarHandler
from fitforge.metrics import Accuracy, SumCountMetric

TARGET = 0.95  # validation exact match of greedy decodes; guessing a whole date right is ~0
MAX_LEN = len("yyyy-mm-dd") + 1  # the longest target, end-of-sequence mark included
DECODER_LR_RATIO = 3.0  # the decoder's learning rate relative to the encoder's


class Encoder(nn.Module):
    """Embedding -> bidirectional GRU; returns every position's state and the decoder's first state."""

    def __init__(self, vocab_size: int, embed_dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=PAD)
        self.gru = nn.GRU(embed_dim, hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)

    def forward(self, sources: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        packed = pack_padded_sequence(
            self.embed(sources), lengths.cpu(), batch_first=True, enforce_sorted=False
        )  # no copy: host_inputs keeps lengths on the CPU
        states, final = self.gru(packed)
        states, _ = pad_packed_sequence(states, batch_first=True, total_length=sources.shape[1])  # (N, S, 2H)
        return states, torch.tanh(self.bridge(torch.cat([final[0], final[1]], dim=1)))


class AttentionDecoder(nn.Module):
    """One step: attend over the encoder states with the previous state, then a GRU cell, then scores."""

    def __init__(self, vocab_size: int, embed_dim: int = 32, hidden: int = 64, memory_dim: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=PAD)
        self.keys = nn.Linear(memory_dim, hidden, bias=False)
        self.query = nn.Linear(hidden, hidden)
        self.energy = nn.Linear(hidden, 1, bias=False)
        self.cell = nn.GRUCell(embed_dim + memory_dim, hidden)
        self.out = nn.Linear(hidden + memory_dim, vocab_size)

    def step(
        self, token: torch.Tensor, state: torch.Tensor, memory: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores (N, C), new state)`` for the previous ``token`` (N,); ``keys = self.keys(memory)``."""
        energy = self.energy(torch.tanh(keys + self.query(state).unsqueeze(1))).squeeze(2)  # (N, S)
        weights = energy.masked_fill(~mask, float("-inf")).softmax(dim=1)  # never attend to padding
        context = torch.bmm(weights.unsqueeze(1), memory).squeeze(1)  # (N, memory_dim)
        state = self.cell(torch.cat([self.embed(token), context], dim=1), state)
        return self.out(torch.cat([state, context], dim=1)), state


class Translator(nn.Module):
    """Encoder + attention decoder. ``forward`` is teacher-forced; ``greedy`` feeds back its own output."""

    def __init__(self, source_vocab: int, target_vocab: int, hidden: int = 64) -> None:
        super().__init__()
        self.encoder = Encoder(source_vocab, hidden=hidden)
        self.decoder = AttentionDecoder(target_vocab, hidden=hidden, memory_dim=2 * hidden)

    def forward(self, sources: torch.Tensor, lengths: torch.Tensor, decoder_inputs: torch.Tensor) -> torch.Tensor:
        """Scores (N, C, T) for each next character, given the true previous ones (N, T)."""
        return self._decode(sources, lengths, decoder_inputs.shape[1], decoder_inputs)

    def greedy(self, sources: torch.Tensor, lengths: torch.Tensor, steps: int) -> torch.Tensor:
        """Scores (N, C, steps), each step fed the previous step's most likely character."""
        return self._decode(sources, lengths, steps, None)

    def translate(self, sources: torch.Tensor, lengths: torch.Tensor, max_len: int = MAX_LEN) -> torch.Tensor:
        """Greedy translations as character ids (N, max_len), padded after the end-of-sequence mark."""
        ids = self.greedy(sources, lengths, max_len).argmax(dim=1)
        ended_before = (ids == EOS).long().cumsum(dim=1) - (ids == EOS).long() > 0
        return ids.masked_fill(ended_before, PAD)

    def _decode(self, sources, lengths, steps: int, decoder_inputs: torch.Tensor | None) -> torch.Tensor:
        memory, state = self.encoder(sources, lengths)
        keys, mask = self.decoder.keys(memory), sources != PAD  # the keys do not change between steps
        token = torch.full((sources.shape[0],), BOS, dtype=torch.int64, device=sources.device)
        scores = []
        for t in range(steps):
            if decoder_inputs is not None:
                token = decoder_inputs[:, t]
            step_scores, state = self.decoder.step(token, state, memory, keys, mask)
            scores.append(step_scores)
            token = step_scores.argmax(dim=1)
        return torch.stack(scores, dim=2)  # (N, C, T): the layout CrossEntropyLoss wants


class TeacherForcing(BatchProcessor):
    """Feed the decoder the true previous character; validation metrics see greedy decodes."""

    def forward(self, net: nn.Module, inputs: tuple[torch.Tensor, ...], label: torch.Tensor) -> torch.Tensor:
        # The decoder input is the target shifted right by one, after a start mark.
        decoder_inputs = torch.cat([torch.full_like(label[:, :1], BOS), label[:, :-1]], dim=1)
        return net(*inputs, decoder_inputs)

    def evaluate_batch(self, state: TrainState, batch) -> BatchOutput:
        output = super().evaluate_batch(state, batch)  # the teacher-forced loss: comparable with training's
        output.pred = state.estimator.val_net.greedy(*output.data, steps=output.label.shape[1])
        return output

    def predict_batch(self, state: TrainState, batch) -> torch.Tensor:
        return state.estimator.val_net.translate(*self.inputs_to_device(state, batch))


class ExactMatch(SumCountMetric):
    """Fraction of sequences whose every non-padding position (end mark included) is right."""

    name = "exact_match"
    higher_is_better = True

    def batch_stats(self, pred: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, int]:
        wrong = (pred.argmax(dim=1) != label) & (label != PAD)
        return (~wrong.any(dim=1)).sum(), label.shape[0]


def main(argv: list[str] | None = None) -> History:
    """Train, validate every epoch, stop early; print a few translations; return the history.

    ``--limit N`` uses at most N training and N validation samples.
    """
    args = common.parse(common.example_parser(__doc__, epochs=30, batch_size=64, lr=2e-3), argv)
    torch.manual_seed(args.seed)
    train_set, val_set, source_vocab = data.dates(seed=args.seed)
    train_loader = DataLoader(
        data.limit(train_set, args.limit),
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=data.pad_sequences,
        generator=torch.Generator().manual_seed(args.seed),
    )
    val_loader = DataLoader(data.limit(val_set, args.limit), batch_size=256, collate_fn=data.pad_sequences)

    net = Translator(len(source_vocab), len(DATE_TARGET))
    encoder_opt = torch.optim.Adam(net.encoder.parameters(), lr=args.lr)
    decoder_opt = torch.optim.Adam(net.decoder.parameters(), lr=args.lr * DECODER_LR_RATIO)
    estimator = Estimator(
        net,
        nn.CrossEntropyLoss(ignore_index=PAD),
        optimizer=[encoder_opt, decoder_opt],
        train_metrics={"token_accuracy": Accuracy(ignore_index=PAD), "exact_match": ExactMatch()},
        batch_processor=TeacherForcing(host_inputs=(1,)),
    )  # lengths stay on the CPU

    with common.checkpoint_dir(args) as folder:
        history = estimator.fit(
            train_loader,
            val_data=val_loader,
            epochs=args.epochs,
            event_handlers=[
                ProgressBarHandler(),
                CheckpointHandler(folder, model_prefix="translator", monitor="val_exact_match", save_best=True),
                EarlyStoppingHandler(monitor="val_exact_match", patience=args.patience, restore_best=True),
            ],
        )
        # Early stopping put the best epoch's weights back: report the model we keep, not the last epoch.
        exact_match = estimator.evaluate(val_loader)["val_exact_match"]

    def iso(ids: list[int]) -> str:
        return "".join(DATE_TARGET.decode(ids)).removesuffix("<eos>")

    samples = DataLoader(Subset(val_set, range(5)), batch_size=5, collate_fn=data.pad_sequences)
    translations = estimator.predict(samples)
    for i, ids in enumerate(translations.tolist()):
        print(f"{val_set.texts[i]:>32} -> {iso(ids)}  (expected {iso(val_set[i][1].tolist())})")
    print(f"validation exact match: {exact_match:.4f} (target >= {TARGET}) after {history.epochs} epochs")
    return history


if __name__ == "__main__":
    main()

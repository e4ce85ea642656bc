"""Tokenized documents packed into fixed-length rows, resumable mid-pass (docs/data-at-scale.md, "Packing").

Each row is a dict of (length,) tensors: ``input_ids``, ``position_ids`` (from 0 in each document),
``document_ids`` (the document's index in the source; -1 on padding) and ``labels`` (-100 wherever a
next-token loss would cross a document's end). A ``DataLoader`` stacks them into batches a model reads by
keyword; :func:`fitforge.inputs.document_masks.document_mask` keeps its attention inside documents.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_flag, check_positive, describe
from fitforge.inputs.stateful import is_stateful

IGNORE_INDEX = -100  # torch's CrossEntropyLoss and Hugging Face's losses skip this label
PADDING_DOCUMENT = -1
_LABELS = ("next", "tokens")
_STATE_KEYS = ("read", "finished", "pending", "source")


@dataclass(frozen=True)
class _Piece:
    """A document's tokens, or the part of them one row holds, from ``position`` on."""

    document: int
    tokens: torch.Tensor
    position: int = 0


class PackedDocuments(IterableDataset):
    """``documents`` (each a sequence of token ids, or a mapping holding them under ``key``), packed in order
    into rows of ``length`` tokens, the rest of a row padded with ``pad_id``.

    A document that does not fit the rest of a row starts the next one; one longer than ``length`` is an
    error, unless ``split=True``, where rows are filled to the end and a document goes on in the next row
    (its positions going on too; attention then sees the piece in its row only).

    ``labels="next"``: each token's label is the document's next token (-100 at its last token), for a loss
    of your own over every position, such as ``nn.CrossEntropyLoss()`` on (N, vocab, L) logits.
    ``labels="tokens"``: the tokens themselves, -100 at each document's first token, for a model that shifts
    its labels (Hugging Face's causal LMs; pass ``document_ids=False`` there, and no attention mask: from
    the restarting ``position_ids`` it builds the same block-diagonal mask).

    Resumable: ``state_dict()`` holds where the pass is (the documents read, the one waiting for the next
    row, a stateful source's own state; at the pass's end, that it is finished) and ``load_state_dict`` makes
    the next pass go on from there, for fit's checkpoints. ``documents`` is read again each pass: a sequence
    (a list, a map-style dataset) from its next index, a source with ``state_dict``/``load_state_dict`` (a
    Hugging Face ``IterableDataset``) from its own state, any other iterable from its start, skipping the
    documents read (exact when each pass yields the same documents). Under DataLoader workers each worker
    packs every ``num_workers``-th document (a stateful source splits itself) and has a state of its own
    (torchdata's ``StatefulDataLoader`` saves each).
    """

    def __init__(
        self,
        documents: Iterable[Any],
        length: int,
        *,
        pad_id: int = 0,
        labels: str = "next",
        split: bool = False,
        document_ids: bool = True,
        key: str = "input_ids",
    ) -> None:
        indexed = hasattr(documents, "__getitem__") and hasattr(documents, "__len__")  # a map-style Dataset too
        if isinstance(documents, (Iterator, torch.Tensor, str, bytes, Mapping)) or not (
            indexed or isinstance(documents, Iterable)
        ):
            fix = (
                "; pass a list, or a class whose __iter__ starts a new pass" if isinstance(documents, Iterator) else ""
            )
            raise FitforgeTypeError(
                "PackedDocuments: documents must be re-iterable documents of token ids, such as a list of lists, "
                f"a Dataset or a Hugging Face dataset (each pass reads them again), got {describe(documents)}{fix}"
            )
        check_positive("PackedDocuments", "length", length)
        if labels not in _LABELS:
            raise FitforgeValueError(f"PackedDocuments: labels must be one of {_LABELS}, got {labels!r}")
        if isinstance(pad_id, bool) or not isinstance(pad_id, int):
            raise FitforgeTypeError(f"PackedDocuments: pad_id must be an int (a token id), got {describe(pad_id)}")
        self.documents, self.length, self.pad_id = documents, length, pad_id
        self.labels, self.key = labels, key
        self.split = check_flag("PackedDocuments", "split", split)
        self.document_ids = check_flag("PackedDocuments", "document_ids", document_ids)
        self._stateful = is_stateful(documents)
        self._indexed = indexed and not self._stateful
        self._read = 0  # the live pass's documents read, and the piece waiting for its next row
        self._pending: _Piece | None = None
        self._finished = False  # the pass's last row is out
        self._resume: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        state, self._resume = self._resume, None
        self._finished = False
        if state is not None and state["finished"]:  # saved after the pass's last row: nothing is left of it
            self._read, self._pending, self._finished = state["read"], None, True
            return
        self._read = 0 if state is None else state["read"]
        pending = None if state is None else _piece_of(state["pending"])
        if state is not None and state.get("source") is not None:
            self.documents.load_state_dict(state["source"])  # type: ignore[attr-defined]
        self._pending = pending
        pieces = self._pieces()
        row: list[_Piece] = []
        room = self.length
        while True:
            if pending is None:
                pending = next(pieces, None)
                if pending is None:
                    break
            size = len(pending.tokens)
            if size <= room:
                row.append(pending)
                room -= size
                pending = None
            elif self.split:
                row.append(_Piece(pending.document, pending.tokens[:room], pending.position))
                pending = _Piece(pending.document, pending.tokens[room:], pending.position + room)
                room = 0
            elif not row:
                raise FitforgeValueError(
                    f"PackedDocuments: document {pending.document} has {size} tokens, more than a row's length="
                    f"{self.length}: pass split=True to go on in the next rows, a larger length, or truncate it"
                )
            else:
                room = 0
            if room == 0:
                self._pending = pending  # what the state holds once the row is out
                yield self._row(row, pending)
                row, room = [], self.length
        # The pass is over (a stateful source may be back at its start): a state saved from here on, loaded, gives
        # what is left of this pass, nothing; a new pass starts at the next iter() without a load (an epoch's).
        self._pending, self._finished = None, True
        if row:
            yield self._row(row, None)

    def set_epoch(self, epoch: int) -> None:
        """Give ``epoch`` to a source that orders its passes by it (a Hugging Face ``IterableDataset``: its
        shuffle, and a loaded state, which it applies again at each pass of the epoch it was saved in)."""
        documents: Any = self.documents
        if callable(getattr(documents, "set_epoch", None)):
            documents.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where the pass stands after the last row yielded (at its end: finished, nothing left to yield);
        loaded and not yet read from, the loaded state."""
        if self._resume is not None:
            return dict(self._resume)
        pending = self._pending
        finished = self._finished
        source = self.documents.state_dict() if self._stateful and self._read and not finished else None  # type: ignore[attr-defined]
        return {
            "read": self._read,
            "finished": finished,
            "pending": None
            if pending is None
            else {"document": pending.document, "tokens": pending.tokens.clone(), "position": pending.position},
            "source": source,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass go on from ``state`` (a :meth:`state_dict`)."""
        if not isinstance(state, Mapping) or not set(_STATE_KEYS) <= set(state):
            raise FitforgeValueError(
                f"PackedDocuments.load_state_dict: state must be a PackedDocuments.state_dict() (keys {_STATE_KEYS}), "
                f"got {describe(state)}"
            )
        if state["source"] is not None and not self._stateful:
            raise FitforgeValueError(
                "PackedDocuments.load_state_dict: the state holds its source's own state, but these documents "
                f"({type(self.documents).__name__}) have no load_state_dict: pass the source the state was saved with"
            )
        self._resume = dict(state)
        self._read, self._pending, self._finished = state["read"], _piece_of(state["pending"]), state["finished"]

    def _pieces(self) -> Iterator[_Piece]:
        """The documents of this pass from ``self._read`` on, as pieces; this worker's share under workers."""
        worker = get_worker_info()
        workers, me = (1, 0) if worker is None or self._stateful else (worker.num_workers, worker.id)
        for index, document in self._documents(self._read, workers, me):
            self._read = index + 1
            if index % workers == me:
                tokens = self._tokens(document, index)
                if len(tokens):  # an empty document has nothing to pack
                    yield _Piece(index, tokens)

    def _documents(self, start: int, workers: int, me: int) -> Iterator[tuple[int, Any]]:
        """``(index, document)`` from ``start`` on (a sequence reads only this worker's, None for the others')."""
        if self._indexed:
            documents: Any = self.documents
            return ((i, documents[i] if i % workers == me else None) for i in range(start, len(documents)))
        source = iter(self.documents)
        if not self._stateful:  # a plain iterable starts over: skip what was read before
            for _ in range(start):
                next(source, None)
        return enumerate(source, start)

    def _tokens(self, document: Any, index: int) -> torch.Tensor:
        if isinstance(document, Mapping):
            if self.key not in document:
                raise FitforgeValueError(
                    f"PackedDocuments: document {index} is a mapping without key={self.key!r} (it has "
                    f"{list(document)}): pass key= the name of its token ids"
                )
            document = document[self.key]
        try:
            tokens = torch.as_tensor(document)
        except (TypeError, ValueError, RuntimeError) as error:
            raise FitforgeTypeError(
                f"PackedDocuments: document {index} must be a sequence of token ids, got {describe(document)}"
            ) from error
        if tokens.shape == (0,):  # an empty list reads as float: nothing to pack whatever its dtype
            return tokens.to(torch.long)
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype is torch.bool:
            raise FitforgeTypeError(
                f"PackedDocuments: document {index} must be a 1-D sequence of integer token ids, got a "
                f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}"
            )
        return tokens.to(torch.long)

    def _row(self, pieces: list[_Piece], continued: _Piece | None) -> dict[str, torch.Tensor]:
        """One row's tensors; ``continued`` is the rest of the last piece's document, when split there."""
        padding = self.length - sum(len(piece.tokens) for piece in pieces)
        inputs = [piece.tokens for piece in pieces] + [torch.full((padding,), self.pad_id)]
        positions = [torch.arange(p.position, p.position + len(p.tokens)) for p in pieces] + [torch.arange(padding)]
        documents = [torch.full((len(p.tokens),), p.document) for p in pieces] + [
            torch.full((padding,), PADDING_DOCUMENT)
        ]
        labels = [self._labels(piece, continued if piece is pieces[-1] else None) for piece in pieces]
        row = {
            "input_ids": torch.cat(inputs),
            "position_ids": torch.cat(positions),
            "labels": torch.cat(labels + [torch.full((padding,), IGNORE_INDEX)]),
        }
        if self.document_ids:
            row["document_ids"] = torch.cat(documents)
        return row

    def _labels(self, piece: _Piece, continued: _Piece | None) -> torch.Tensor:
        if self.labels == "tokens":  # the model shifts them: no label where the token before is another document's
            return torch.cat([torch.tensor([IGNORE_INDEX]), piece.tokens[1:]])
        after = IGNORE_INDEX if continued is None or continued.document != piece.document else continued.tokens[0]
        return torch.cat([piece.tokens[1:], torch.tensor([int(after)])])


def _piece_of(state: Mapping[str, Any] | None) -> _Piece | None:
    if state is None:
        return None
    return _Piece(int(state["document"]), torch.as_tensor(state["tokens"], dtype=torch.long), int(state["position"]))

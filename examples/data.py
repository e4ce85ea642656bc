"""Data for the example models: real datasets shipped with scikit-learn and seeded generators.

Nothing is downloaded. The scikit-learn loaders read files installed with the package; the
generators build small synthetic datasets in memory, deterministically from ``seed``, in well
under a second. Every function returns ``torch.utils.data.Dataset`` objects (so the examples keep
the real ``DataLoader`` code) split into training and validation parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset, Subset, TensorDataset


def split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffled train/validation index tensors for ``n`` samples (a seeded permutation)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(n * val_fraction))
    return order[n_val:], order[:n_val]


def limit(dataset: Dataset, size: int | None) -> Dataset:
    """The first ``size`` samples of ``dataset`` (all of them when ``size`` is None)."""
    if size is None or size >= len(dataset):  # type: ignore[arg-type]
        return dataset
    return Subset(dataset, range(size))


# --- images: scikit-learn's handwritten digits -----------------------------------------------------


def digits(size: int = 8, val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 1797 8x8 digit images (10 classes) as float (N, 1, size, size) in [0, 1], int64 labels.

    ``size`` > 8 upscales bilinearly (for networks built for larger inputs, e.g. AlexNet-style).
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    if size != 8:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.tensor(data.target, dtype=torch.int64)
    train, val = split(len(labels), val_fraction, seed)
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])


# --- tabular: scikit-learn's breast-cancer data ----------------------------------------------------


def breast_cancer(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """569 tumours, 30 features, standardised with the training part's mean and std (no leak from
    validation); float labels of shape (N, 1), 1 = benign, for ``BCEWithLogitsLoss``."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    features = torch.tensor(data.data, dtype=torch.float32)
    labels = torch.tensor(data.target, dtype=torch.float32).unsqueeze(1)
    train, val = split(len(labels), val_fraction, seed)
    mean, std = features[train].mean(0), features[train].std(0)
    features = (features - mean) / std
    return TensorDataset(features[train], labels[train]), TensorDataset(features[val], labels[val])


# --- images: augmentation --------------------------------------------------------------------------


class RandomAffine(Dataset):
    """``dataset`` of (image (C, H, W), label) with a fresh random small affine warp per access.

    Each image is rotated by up to ``degrees``, scaled by a factor in ``scale`` and shifted by up to
    ``shift`` of its size (zero fill, i.e. background for the digits), so every epoch sees slightly
    different digits. For the training set only: validation measures the images as they are.
    Deterministic for a given ``seed`` and access order (the DataLoader's seeded shuffle), with
    ``num_workers=0``; worker processes would each copy the generator and repeat its draws.
    """

    def __init__(
        self,
        dataset: Dataset,
        degrees: float = 10.0,
        scale: tuple[float, float] = (0.9, 1.1),
        shift: float = 0.1,
        seed: int = 0,
    ) -> None:
        self.dataset, self.degrees, self.scale, self.shift = dataset, degrees, scale, shift
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.dataset[index]
        angle, zoom, dx, dy = torch.rand(4, generator=self.generator) * 2 - 1  # each in [-1, 1)
        angle = angle * self.degrees * torch.pi / 180
        zoom = self.scale[0] + (zoom + 1) / 2 * (self.scale[1] - self.scale[0])
        # affine_grid maps output to input coordinates in [-1, 1]: dividing by zoom enlarges the digit,
        # and a translation of 2 * shift moves it by ``shift`` of the image size.
        cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
        theta = torch.stack(
            [torch.stack([cos, -sin, 2 * self.shift * dx]), torch.stack([sin, cos, 2 * self.shift * dy])]
        ).unsqueeze(0)
        grid = F.affine_grid(theta, [1, *image.shape], align_corners=False)
        return F.grid_sample(image.unsqueeze(0), grid, align_corners=False).squeeze(0), label


# --- segmentation: bright shapes on noisy backgrounds, a class for every pixel ---------------------

SHAPE_CLASSES = ("background", "circle", "square", "triangle")


def _shape_masks(
    kind: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor, radius: torch.Tensor, size: int
) -> torch.Tensor:
    """Boolean (n, size, size) masks, one shape per image: kind 1 circle, 2 square, 3 triangle."""
    grid = torch.arange(size, dtype=torch.float32) + 0.5  # pixel centres
    dy = grid.view(1, -1, 1) - cy.view(-1, 1, 1)
    dx = grid.view(1, 1, -1) - cx.view(-1, 1, 1)
    r, kind = radius.view(-1, 1, 1), kind.view(-1, 1, 1)
    circle = dy**2 + dx**2 <= r**2
    square = (dy.abs() <= 0.9 * r) & (dx.abs() <= 0.9 * r)  # about a circle's area: size is no clue
    triangle = (dy.abs() <= r) & (dx.abs() <= (dy + r) / 2)  # apex up, base 2r wide
    return torch.where(kind == 1, circle, torch.where(kind == 2, square, triangle))


def shapes_segmentation(
    n_train: int = 2000, n_val: int = 400, size: int = 32, max_shapes: int = 3, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """1 to ``max_shapes`` circles, squares and triangles (radius 3-8 px, bright random colours,
    later shapes may hide earlier ones) on dark backgrounds with a gradient and pixel noise.

    Images are float (N, 3, size, size); labels int64 (N, size, size), the class of each pixel as
    in ``SHAPE_CLASSES`` (0 background). About 85% of the pixels are background.
    """
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_val
    ramp = torch.linspace(0, 1, size).view(1, 1, 1, -1)
    images = 0.35 * torch.rand(n, 3, 1, 1, generator=g) + 0.2 * torch.rand(n, 1, 1, 1, generator=g) * ramp
    images = images.expand(n, 3, size, size).clone()
    labels = torch.zeros(n, size, size, dtype=torch.int64)
    count = torch.randint(1, max_shapes + 1, (n,), generator=g)
    for slot in range(max_shapes):  # vectorised over images, one shape per image at a time
        kind = torch.randint(1, len(SHAPE_CLASSES), (n,), generator=g)
        radius = 3 + 5 * torch.rand(n, generator=g)
        cy, cx = (radius + (size - 2 * radius) * torch.rand(n, generator=g) for _ in range(2))
        mask = _shape_masks(kind, cy, cx, radius, size) & (slot < count).view(-1, 1, 1)
        colour = 0.55 + 0.45 * torch.rand(n, 3, 1, 1, generator=g)
        images = torch.where(mask.unsqueeze(1), colour, images)
        labels = torch.where(mask, kind.view(-1, 1, 1), labels)
    images = images + 0.08 * torch.randn(images.shape, generator=g)
    return (TensorDataset(images[:n_train], labels[:n_train]), TensorDataset(images[n_train:], labels[n_train:]))


# --- detection: squares and circles with their bounding boxes --------------------------------------

DETECTION_CLASSES = ("background", "square", "circle")


class BoxesDataset(Dataset):
    """Images with a varying number of objects. Item ``i`` is ``(image, (boxes, classes))``: a float
    (3, H, W) image, float (k, 4) boxes as (x1, y1, x2, y2) fractions of the image size, and int64
    (k,) classes as in ``DETECTION_CLASSES``. Batching needs a ``collate_fn`` that pads the boxes."""

    def __init__(self, images: torch.Tensor, boxes: list[torch.Tensor], classes: list[torch.Tensor]) -> None:
        self.images, self.boxes, self.classes = images, boxes, classes

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return self.images[i], (self.boxes[i], self.classes[i])


def _place_objects(draws: list[list[float]], count: int, size: int) -> list[tuple[float, float, float]]:
    """(centre x, centre y, side) in pixels for up to ``count`` objects that do not overlap, tried in
    turn from ``draws`` (uniform triples); an object that never fits is dropped."""
    placed: list[tuple[float, float, float]] = []
    for u_side, u_x, u_y in draws:
        if len(placed) == count:
            break
        side = 7 + 10 * u_side  # 7-17 px
        cx, cy = side / 2 + u_x * (size - side), side / 2 + u_y * (size - side)
        if all(abs(cx - x) > (side + s) / 2 + 1 or abs(cy - y) > (side + s) / 2 + 1 for x, y, s in placed):
            placed.append((cx, cy, side))
    return placed


def shape_detection(
    n_train: int = 2000, n_val: int = 400, size: int = 32, max_objects: int = 3, seed: int = 0
) -> tuple[BoxesDataset, BoxesDataset]:
    """1 to ``max_objects`` non-overlapping bright squares and circles (side/diameter 7-17 px,
    random colours) on dark noisy backgrounds, with their boxes and classes (see ``BoxesDataset``)."""
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_val
    counts = torch.randint(1, max_objects + 1, (n,), generator=g).tolist()
    draws = torch.rand(n, 10 * max_objects, 3, generator=g).tolist()  # one bulk draw: fast and seeded
    placed = [_place_objects(d, c, size) for d, c in zip(draws, counts)]
    # Pad to (n, max_objects) so that drawing is vectorised over images, one object slot at a time.
    cx, cy, side = torch.tensor([p + [(-size, -size, 0.0)] * (max_objects - len(p)) for p in placed]).unbind(-1)
    kinds = torch.randint(1, len(DETECTION_CLASSES), (n, max_objects), generator=g)
    images = (0.35 * torch.rand(n, 3, 1, 1, generator=g)).expand(n, 3, size, size).clone()
    grid = torch.arange(size, dtype=torch.float32) + 0.5  # pixel centres
    for slot in range(max_objects):
        dy = grid.view(1, -1, 1) - cy[:, slot].view(-1, 1, 1)
        dx = grid.view(1, 1, -1) - cx[:, slot].view(-1, 1, 1)
        half = side[:, slot].view(-1, 1, 1) / 2
        square = (dy.abs() <= half) & (dx.abs() <= half)
        circle = dy**2 + dx**2 <= half**2
        mask = torch.where(kinds[:, slot].view(-1, 1, 1) == 1, square, circle)
        colour = 0.55 + 0.45 * torch.rand(n, 3, 1, 1, generator=g)
        images = torch.where(mask.unsqueeze(1), colour, images)
    images = images + 0.08 * torch.randn(images.shape, generator=g)
    corners = torch.stack([cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2], dim=-1) / size
    boxes = [corners[i, : len(p)] for i, p in enumerate(placed)]
    classes = [kinds[i, : len(p)] for i, p in enumerate(placed)]
    return (
        BoxesDataset(images[:n_train], boxes[:n_train], classes[:n_train]),
        BoxesDataset(images[n_train:], boxes[n_train:], classes[n_train:]),
    )


# --- text: sentiment sentences that bag-of-words cannot classify (and the text helpers) ------------

PAD, UNK = 0, 1  # the ids of "<pad>" and "<unk>" in every Vocab


class Vocab:
    """Token <-> id mapping: id 0 is ``<pad>``, id 1 ``<unk>`` (any token not in the list)."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = ["<pad>", "<unk>"] + [t for t in dict.fromkeys(tokens) if t not in ("<pad>", "<unk>")]
        self.ids = {token: i for i, token in enumerate(self.tokens)}

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, tokens: list[str]) -> list[int]:
        return [self.ids.get(token, UNK) for token in tokens]

    def decode(self, ids: list[int]) -> list[str]:
        """The tokens of ``ids``, padding left out."""
        return [self.tokens[i] for i in ids if i != PAD]


class SequenceDataset(Dataset):
    """Variable-length samples ``(token ids int64 (L,), label)``; a collate_fn pads them into batches.

    ``texts`` keeps each sample's source string, for printing examples.
    """

    def __init__(self, sequences: list[list[int]], labels: list[torch.Tensor], texts: list[str]) -> None:
        self.sequences = [torch.tensor(s, dtype=torch.int64) for s in sequences]
        self.labels, self.texts = labels, texts

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sequences[i], self.labels[i]


def pad_sequences(
    samples: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """collate_fn for SequenceDataset: ``(ids, label)`` samples -> ``((ids (N, L), lengths (N,)),
    labels)``, ids padded with PAD; class labels are stacked (N,), target sequences padded (N, T)."""
    sequences, labels = zip(*samples)
    lengths = torch.tensor([len(s) for s in sequences])
    ids = pad_sequence(list(sequences), batch_first=True, padding_value=PAD)
    if labels[0].dim() == 0:
        return (ids, lengths), torch.stack(labels)
    return (ids, lengths), pad_sequence(list(labels), batch_first=True, padding_value=PAD)


def _text_datasets(
    texts: list[str], labels: list[torch.Tensor], n_train: int, tokenize
) -> tuple[SequenceDataset, SequenceDataset, Vocab]:
    """Split generated samples into train/validation; the vocabulary is built from the training part."""
    tokens = [tokenize(t) for t in texts]
    vocab = Vocab(sorted({w for sentence in tokens[:n_train] for w in sentence}))
    ids = [vocab.encode(t) for t in tokens]
    return (
        SequenceDataset(ids[:n_train], labels[:n_train], texts[:n_train]),
        SequenceDataset(ids[n_train:], labels[n_train:], texts[n_train:]),
        vocab,
    )


_POSITIVE = ["good", "great", "funny", "charming", "brilliant", "moving", "clever", "gripping", "lovely", "fresh"]
_NEGATIVE = ["bad", "boring", "dull", "awful", "slow", "silly", "bland", "weak", "tedious", "messy"]
_SUBJECTS = [
    "the film",
    "the movie",
    "this film",
    "the plot",
    "the story",
    "the acting",
    "the cast",
    "the script",
    "the ending",
    "the music",
    "the dialogue",
    "the sequel",
]
_OPENERS = ["", "", "honestly ,", "i think", "in my opinion", "to be fair ,", "overall"]
_INTENSIFIERS = ["", "", "very", "really", "quite", "so"]
# Two opinions of opposite polarity; the connective makes Y the one that counts.
_TEMPLATES = [
    "{subject} was {X} but {Y}",
    "although {subject} was {X} , it was {Y}",
    "{subject} was {Y} , although {X}",
    "{subject} was {Y} despite being {X}",
    "despite being {X} , {subject} was {Y}",
]


def _opinion(rng, polarity: int) -> str:
    """A phrase such as "not very dull" that means ``polarity`` (+1 positive, -1 negative)."""
    negated = rng.random() < 0.5
    adjective = rng.choice(_POSITIVE if (polarity > 0) != negated else _NEGATIVE)  # "not dull" is positive
    return " ".join(w for w in ("not" if negated else "", rng.choice(_INTENSIFIERS), adjective) if w)


def sentiment(n_train: int = 4000, n_val: int = 1000, seed: int = 0) -> tuple[SequenceDataset, SequenceDataset, Vocab]:
    """Review sentences labelled 1 (positive) or 0 (negative), 6 to 17 tokens, and their Vocab.

    Each sentence joins two opinions of opposite polarity, and the connective decides which one
    counts: "the plot was not very funny but charming" is positive, "although the cast was great ,
    it was tedious" negative, "the film was dull despite being clever" negative. "not" flips the
    opinion it precedes. Labels are balanced; the samples are ``(ids (L,), int64 label)``.

    Why bag-of-words fails: the two opinions are drawn independently (given their polarities), so
    the sentence with them swapped is exactly as likely. The swap keeps the words and flips the
    label: every bag of words is equally likely to carry either label, and any classifier of word
    counts stays at chance (50%; tests/examples/test_models_text.py checks it with a logistic regression).
    A model must read the order: which opinion follows the connective, and which adjective "not" applies to.
    """
    import random

    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n_train + n_val):
        label = rng.randrange(2)
        template, polarity = rng.choice(_TEMPLATES), 1 if label else -1
        sentence = template.format(subject=rng.choice(_SUBJECTS), X=_opinion(rng, -polarity), Y=_opinion(rng, polarity))
        texts.append(f"{rng.choice(_OPENERS)} {sentence}".strip())
        labels.append(torch.tensor(label))
    return _text_datasets(texts, labels, n_train, str.split)


# --- text: dates written by people, to translate into ISO 8601 -------------------------------------

_MONTHS = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
]
_UNITS = ["", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"]
_TEENS = [
    "tenth",
    "eleventh",
    "twelfth",
    "thirteenth",
    "fourteenth",
    "fifteenth",
    "sixteenth",
    "seventeenth",
    "eighteenth",
    "nineteenth",
]
_DATE_FORMATS = [
    "{month} {d}, {y}",
    "{d} {mon} {y}",
    "the {nth} of {month} {y}",
    "{month} the {nth}, {y}",
    "{d}{suffix} {month} {y}",
    "{dd}/{mm}/{y}",
    "{weekday}, {month} {d}, {y}",
    "{weekday} {d} {mon} {y}",
]
_MONTH_FORMATS = ["{month} {y}", "{mon} {y}", "{mm}/{y}"]  # no day: the ISO form is "yyyy-mm"
_WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
DATE_TARGET = Vocab(list("0123456789-") + ["<bos>", "<eos>"])  # the output characters (<pad> = 0)
BOS, EOS = DATE_TARGET.ids["<bos>"], DATE_TARGET.ids["<eos>"]


def _ordinal(day: int) -> str:
    """21 -> "twenty-first"."""
    if 10 <= day < 20:
        return _TEENS[day - 10]
    tens = ["", "", "twenty", "thirty"][day // 10]
    if day % 10 == 0:
        return tens[:-1] + "ieth"
    return f"{tens}-{_UNITS[day % 10]}" if tens else _UNITS[day]


def _suffix(day: int) -> str:
    """1 -> "st", 22 -> "nd", 13 -> "th"."""
    return "th" if 10 <= day < 20 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")


def tokenize_date(text: str) -> list[str]:
    """Words and punctuation are tokens; numbers are spelled digit by digit ("21st" -> 2 1 st)."""
    import re

    return re.findall(r"[a-z\-]+|\d|[^\sa-z\d]", text.lower())


def dates(
    n_train: int = 10000, n_val: int = 1000, seed: int = 0, month_only: float = 0.2
) -> tuple[SequenceDataset, SequenceDataset, Vocab]:
    """Dates written by people, to translate into ISO 8601, and the source Vocab.

    Sources in 11 formats, e.g. "the twenty-first of march 2019", "march 21, 2019", "21 mar 2019",
    "thursday, march 21, 2019", "21/03/2019"; a fraction ``month_only`` has no day ("march 2019",
    target "2019-03"), so targets differ in length. Years 1900-2099. A sample is ``(source ids (S,),
    target ids (T,))``: the target characters of ``DATE_TARGET`` then ``EOS``.
    """
    import datetime
    import random

    rng = random.Random(seed)
    first, days = datetime.date(1900, 1, 1), (datetime.date(2099, 12, 31) - datetime.date(1900, 1, 1)).days
    texts, targets = [], []
    for _ in range(n_train + n_val):
        date = first + datetime.timedelta(days=rng.randrange(days + 1))
        day_less = rng.random() < month_only
        month = _MONTHS[date.month - 1]
        texts.append(
            rng.choice(_MONTH_FORMATS if day_less else _DATE_FORMATS).format(
                month=month,
                mon=month[:3],
                y=date.year,
                mm=f"{date.month:02d}",
                d=date.day,
                dd=f"{date.day:02d}",
                nth=_ordinal(date.day),
                suffix=_suffix(date.day),
                weekday=_WEEKDAYS[date.weekday()],
            )
        )
        iso = date.isoformat()[:7] if day_less else date.isoformat()
        targets.append(torch.tensor(DATE_TARGET.encode(list(iso)) + [EOS]))
    return _text_datasets(texts, targets, n_train, tokenize_date)

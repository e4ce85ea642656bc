"""Data for the example models: real datasets shipped with scikit-learn and seeded generators.

Nothing is downloaded. The scikit-learn loaders read files installed with the package; the
generators build small synthetic datasets in memory, deterministically from ``seed``, in well
under a second. Every function returns ``torch.utils.data.Dataset`` objects (so the examples keep
the real ``DataLoader`` code) split into training and validation parts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset


def split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffled train/validation index tensors for ``n`` samples (a seeded permutation)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(n * val_fraction)))
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

    def __init__(self, dataset: Dataset, degrees: float = 10.0, scale: tuple[float, float] = (0.9, 1.1),
                 shift: float = 0.1, seed: int = 0) -> None:
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
        theta = torch.stack([torch.stack([cos, -sin, 2 * self.shift * dx]),
                             torch.stack([sin, cos, 2 * self.shift * dy])]).unsqueeze(0)
        grid = F.affine_grid(theta, [1, *image.shape], align_corners=False)
        return F.grid_sample(image.unsqueeze(0), grid, align_corners=False).squeeze(0), label


# --- segmentation: bright shapes on noisy backgrounds, a class for every pixel ---------------------

SHAPE_CLASSES = ("background", "circle", "square", "triangle")


def _shape_masks(kind: torch.Tensor, cy: torch.Tensor, cx: torch.Tensor, radius: torch.Tensor,
                 size: int) -> torch.Tensor:
    """Boolean (n, size, size) masks, one shape per image: kind 1 circle, 2 square, 3 triangle."""
    grid = torch.arange(size, dtype=torch.float32) + 0.5  # pixel centres
    dy = grid.view(1, -1, 1) - cy.view(-1, 1, 1)
    dx = grid.view(1, 1, -1) - cx.view(-1, 1, 1)
    r, kind = radius.view(-1, 1, 1), kind.view(-1, 1, 1)
    circle = dy**2 + dx**2 <= r**2
    square = (dy.abs() <= 0.9 * r) & (dx.abs() <= 0.9 * r)  # about a circle's area: size is no clue
    triangle = (dy.abs() <= r) & (dx.abs() <= (dy + r) / 2)  # apex up, base 2r wide
    return torch.where(kind == 1, circle, torch.where(kind == 2, square, triangle))


def shapes_segmentation(n_train: int = 2000, n_val: int = 400, size: int = 32, max_shapes: int = 3,
                        seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
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
    return (TensorDataset(images[:n_train], labels[:n_train]),
            TensorDataset(images[n_train:], labels[n_train:]))


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


def shape_detection(n_train: int = 2000, n_val: int = 400, size: int = 32, max_objects: int = 3,
                    seed: int = 0) -> tuple[BoxesDataset, BoxesDataset]:
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
    boxes = [corners[i, :len(p)] for i, p in enumerate(placed)]
    classes = [kinds[i, :len(p)] for i, p in enumerate(placed)]
    return (BoxesDataset(images[:n_train], boxes[:n_train], classes[:n_train]),
            BoxesDataset(images[n_train:], boxes[n_train:], classes[n_train:]))

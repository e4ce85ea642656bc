"""SSD object detection of generated squares and circles, trained with fitforge.

The model is a small single-shot detector (Liu et al., 2016): a convolutional backbone gives feature
maps at 1/4 and 1/8 of the image size, and on each map two 3x3 convolution heads predict, for every
default box ("anchor", two sizes per cell), class scores (background + 2 classes) and four box
offsets relative to the anchor. Training needs targets per anchor, so a custom ``BatchProcessor``
matches each image's ground-truth boxes to the anchors (IoU >= 0.5, and each object's best anchor
always) before the losses see the batch: cross-entropy with hard-negative mining for the classes,
smooth L1 over the matched (positive) anchors for the boxes, weighted ``loss=[cls, box]``. Metrics
are the class accuracy and the box IoU on positive anchors. ``predict`` decodes the offsets into
boxes and keeps the best few per image after non-maximum suppression.
The data are 1000 training and 400 validation 32x32 images with 1-3 non-overlapping bright squares
and circles of 7-17 px and their boxes (``data.shape_detection``).
Reaches about 0.98 detection F1 at IoU 0.5 on the validation images (target >= 0.9) in 6 epochs
and about 25 seconds on a 2-core CPU (longer when other work shares it).

    python examples/ssd_detection.py                        # full run, checkpoints in a temp folder
    python examples/ssd_detection.py --checkpoint-dir ckpt  # keep the checkpoints
    python examples/ssd_detection.py --smoke                # one short epoch, for tests
"""

from __future__ import annotations

from typing import Any

import common
import data
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fitforge import BatchProcessor, Estimator, History, TrainState
from fitforge.handlers import CheckpointHandler, EarlyStoppingHandler, ProgressBarHandler
from fitforge.metrics import Accuracy, SumCountMetric

TARGET = 0.9  # validation detection F1 at IoU >= 0.5; an untrained net finds nothing (F1 0)
NUM_CLASSES = len(data.DETECTION_CLASSES)  # background, square, circle
IMAGE_SIZE = 32
# Feature maps (cells per side) and the anchor sizes on each, in pixels: objects are 7-17 px.
ANCHOR_LAYOUT = ((8, (8.0, 11.0)), (4, (15.0, 20.0)))
ANCHORS_PER_CELL = 2
BOX_SCALE = torch.tensor([0.1, 0.1, 0.2, 0.2])  # SSD's "variances": offsets of similar magnitude


# --- boxes: (x1, y1, x2, y2) corners or (cx, cy, w, h) centres, fractions of the image size ---------


def make_anchors() -> torch.Tensor:
    """(A, 4) anchors as (cx, cy, w, h), ordered as the heads' outputs: map, row, column, size."""
    anchors = []
    for cells, sizes in ANCHOR_LAYOUT:
        centres = (torch.arange(cells, dtype=torch.float32) + 0.5) / cells
        cy, cx = torch.meshgrid(centres, centres, indexing="ij")
        for y, x in zip(cy.flatten().tolist(), cx.flatten().tolist()):
            anchors += [[x, y, s / IMAGE_SIZE, s / IMAGE_SIZE] for s in sizes]
    return torch.tensor(anchors)


def to_corners(boxes: torch.Tensor) -> torch.Tensor:
    cxcy, wh = boxes[..., :2], boxes[..., 2:]
    return torch.cat([cxcy - wh / 2, cxcy + wh / 2], dim=-1)


def to_centres(boxes: torch.Tensor) -> torch.Tensor:
    return torch.cat([(boxes[..., :2] + boxes[..., 2:]) / 2, boxes[..., 2:] - boxes[..., :2]], dim=-1)


def area(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes[..., 2:] - boxes[..., :2]).clamp(min=0).prod(-1)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of corner boxes ``a`` (..., 4) and ``b`` (..., 4), broadcast over the leading dims."""
    top_left = torch.maximum(a[..., :2], b[..., :2])
    bottom_right = torch.minimum(a[..., 2:], b[..., 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(-1)
    return inter / (area(a) + area(b) - inter + 1e-9)


def encode(boxes: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Corner boxes -> offsets from the anchors: centre shift / anchor size, log size ratio."""
    centres, scale = to_centres(boxes), BOX_SCALE.to(boxes.device)
    shift = (centres[..., :2] - anchors[..., :2]) / anchors[..., 2:]
    ratio = torch.log(centres[..., 2:].clamp(min=1e-6) / anchors[..., 2:])
    return torch.cat([shift, ratio], dim=-1) / scale


def decode(offsets: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Offsets from the anchors -> corner boxes (the inverse of ``encode``)."""
    offsets = offsets * BOX_SCALE.to(offsets.device)
    centres = anchors[..., :2] + offsets[..., :2] * anchors[..., 2:]
    sizes = anchors[..., 2:] * offsets[..., 2:].clamp(max=4).exp()
    return to_corners(torch.cat([centres, sizes], dim=-1))


# --- data: pad each batch's boxes; match them to the anchors ---------------------------------------


def pad_boxes(samples: list) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """collate_fn: images stacked; boxes padded to the batch's most objects, padding class -1."""
    most = max(len(classes) for _, (_, classes) in samples)
    boxes = torch.zeros(len(samples), most, 4)
    classes = torch.full((len(samples), most), -1, dtype=torch.int64)
    for i, (_, (image_boxes, image_classes)) in enumerate(samples):
        boxes[i, : len(image_classes)], classes[i, : len(image_classes)] = image_boxes, image_classes
    return torch.stack([image for image, _ in samples]), (boxes, classes)


def match_anchors(
    anchors: torch.Tensor, boxes: torch.Tensor, classes: torch.Tensor, threshold: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-anchor targets for padded ground truth (N, M, 4) boxes and (N, M) classes (-1: padding).

    An anchor takes the class and box of the object it overlaps most if their IoU >= ``threshold``,
    else background (0). Each object's best anchor is positive whatever the IoU, so small objects
    are never lost. Vectorised over the batch, without a host read.
    Returns the class targets (N, A) and the box targets (N, A, 5): offsets and a positive flag.
    """
    n, m = classes.shape
    iou = box_iou(to_corners(anchors)[None, :, None], boxes[:, None])  # (N, A, M)
    iou = iou.masked_fill(classes[:, None] < 0, -1.0)
    best_iou, best_object = iou.max(dim=2)
    # Force each object's best anchor; padding objects write to a spare column that is then dropped.
    forced = torch.where(classes >= 0, iou.argmax(dim=1), anchors.shape[0])  # (N, M)
    spare = torch.zeros(n, 1, device=boxes.device)
    best_iou = torch.cat([best_iou, spare], 1).scatter(1, forced, 2.0)[:, :-1]
    objects = torch.arange(m, device=boxes.device).expand(n, m)
    best_object = torch.cat([best_object, spare.long()], 1).scatter(1, forced, objects)[:, :-1]
    positive = best_iou >= threshold
    class_target = torch.where(positive, classes.gather(1, best_object), 0)
    matched = boxes.gather(1, best_object[..., None].expand(-1, -1, 4))
    return class_target, torch.cat([encode(matched, anchors), positive[..., None].float()], dim=-1)


class SSDProcessor(BatchProcessor):
    """Matches ground truth to anchors for training and evaluation; decodes boxes in ``predict``."""

    def __init__(self, anchors: torch.Tensor, detections_per_image: int = 5) -> None:
        super().__init__()
        self.anchors, self.detections_per_image = anchors, detections_per_image

    def to_device(self, state: TrainState, batch: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        # to_device is the step fit_batch and evaluate_batch share (predict does not use it): the place
        # to turn the label into training targets, here one class and one box per anchor.
        images, (boxes, classes) = super().to_device(state, batch)
        self.anchors = self.anchors.to(boxes.device)
        return images, match_anchors(self.anchors, boxes, classes)  # the label both losses see

    def predict_batch(self, state: TrainState, batch: Any) -> tuple[torch.Tensor, ...]:
        scores, offsets = super().predict_batch(state, batch)
        return detect(scores, decode(offsets, self.anchors.to(offsets.device)), self.detections_per_image)


def detect(
    scores: torch.Tensor, boxes: torch.Tensor, keep: int, candidates: int = 20, overlap: float = 0.45
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy non-maximum suppression over each image's best ``candidates`` anchors, vectorised over
    the batch. Returns the ``keep`` best per image: boxes (N, keep, 4), scores (N, keep) and classes
    (N, keep), padded with zeros (a fixed size, so that predict can concatenate the batches).
    Suppression ignores the class, since objects here never overlap."""
    probability, classes = scores.softmax(dim=1)[:, 1:].max(dim=1)  # best object class per anchor
    probability, order = probability.topk(min(candidates, probability.shape[1]), dim=1)
    boxes = boxes.gather(1, order[..., None].expand(-1, -1, 4))
    classes = classes.gather(1, order) + 1
    ious = box_iou(boxes[:, :, None], boxes[:, None])  # (N, T, T)
    kept = torch.ones_like(probability, dtype=torch.bool)
    for i in range(1, kept.shape[1]):  # in score order: drop a box that overlaps a kept better one
        kept[:, i] = ~((ious[:, i, :i] > overlap) & kept[:, :i]).any(dim=1)
    probability = probability * kept
    probability, best = probability.topk(min(keep, probability.shape[1]), dim=1)
    found = probability > 0
    boxes = boxes.gather(1, best[..., None].expand(-1, -1, 4)) * found[..., None]
    return boxes, probability, torch.where(found, classes.gather(1, best), 0)


# --- the model ---------------------------------------------------------------------------------------


def conv_block(in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class SSD(nn.Module):
    """Backbone to 1/4 and 1/8 resolution; per map, a class head and a box head (3x3 convolutions).

    Returns class scores (N, num_classes, A), laid out like an image's (N, C, H, W) so that
    ``cross_entropy`` takes them directly, and box offsets (N, A, 4)."""

    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 32) -> None:
        super().__init__()
        w, k = width, ANCHORS_PER_CELL
        self.stage1 = nn.Sequential(
            conv_block(3, w), conv_block(w, w, 2), conv_block(w, 2 * w, 2), conv_block(2 * w, 2 * w)
        )  # 1/4
        self.stage2 = nn.Sequential(conv_block(2 * w, 4 * w, 2), conv_block(4 * w, 4 * w))  # 1/8
        self.class_heads = nn.ModuleList(nn.Conv2d(c, k * num_classes, 3, padding=1) for c in (2 * w, 4 * w))
        self.box_heads = nn.ModuleList(nn.Conv2d(c, k * 4, 3, padding=1) for c in (2 * w, 4 * w))
        self.num_classes = num_classes

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fine = self.stage1(images)
        maps = (fine, self.stage2(fine))
        n, k = images.shape[0], ANCHORS_PER_CELL
        # (N, k * C, H, W) -> (N, C, H * W * k): anchors in row, column, size order, as make_anchors.
        scores = [
            head(x).view(n, k, self.num_classes, -1).permute(0, 2, 3, 1).reshape(n, self.num_classes, -1)
            for head, x in zip(self.class_heads, maps)
        ]
        offsets = [
            head(x).view(n, k, 4, -1).permute(0, 3, 1, 2).reshape(n, -1, 4) for head, x in zip(self.box_heads, maps)
        ]
        return torch.cat(scores, dim=2), torch.cat(offsets, dim=1)


# --- losses and metrics --------------------------------------------------------------------------------


def class_loss(scores: torch.Tensor, target: torch.Tensor, negatives_per_positive: int = 3) -> torch.Tensor:
    """Cross-entropy over the positive anchors and the hardest negatives (3 per positive), per
    positive: the ~97% easy background anchors would otherwise drown the objects."""
    loss = F.cross_entropy(scores, target, reduction="none")  # (N, A)
    positive = target > 0
    positives = positive.sum(dim=1, keepdim=True)
    negative_loss = loss.detach().masked_fill(positive, -1.0)
    rank = negative_loss.argsort(dim=1, descending=True).argsort(dim=1)
    hard_negative = rank < negatives_per_positive * positives
    return (loss * (positive | hard_negative)).sum() / positives.sum().clamp(min=1)


def box_loss(offsets: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Smooth L1 of the offsets of positive anchors, per positive."""
    # Each loss sees only its own label, yet the box loss must know which anchors are positive (the
    # class targets say so): match_anchors gives the box label a 5th column, the positive flag.
    positive = target[..., 4]
    loss = F.smooth_l1_loss(offsets, target[..., :4], reduction="none").sum(dim=-1)
    return (loss * positive).sum() / positive.sum().clamp(min=1)


class BoxIoU(SumCountMetric):
    """IoU of the decoded predicted box with its object's box, averaged over the positive anchors."""

    name = "box_iou"
    higher_is_better = True

    def __init__(self, anchors: torch.Tensor) -> None:
        super().__init__()
        self.anchors = anchors

    def batch_stats(self, offsets: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        iou = box_iou(decode(offsets, self.anchors), decode(target[..., :4], self.anchors))
        positive = target[..., 4]
        return (iou * positive).sum(), positive.sum()  # a device count: no host read per batch

    def to(self, device: torch.device | str) -> BoxIoU:
        self.anchors = self.anchors.to(device)
        super().to(device)
        return self


def detection_f1(
    detections: tuple[torch.Tensor, ...], dataset: Dataset, min_score: float = 0.5, min_iou: float = 0.5
) -> tuple[float, float, float]:
    """(precision, recall, F1) of the detections scoring >= ``min_score``: an object is found when a
    detection of its class overlaps it with IoU >= ``min_iou``."""
    boxes, scores, classes = detections
    found, confident, objects = 0, int((scores >= min_score).sum()), 0
    for i in range(len(dataset)):
        _, (true_boxes, true_classes) = dataset[i]
        hit = (box_iou(true_boxes[:, None], boxes[i][None]) >= min_iou) & (true_classes[:, None] == classes[i])
        found += int((hit & (scores[i] >= min_score)).any(dim=1).sum())
        objects += len(true_classes)
    precision, recall = found / max(confident, 1), found / objects
    return precision, recall, 2 * precision * recall / max(precision + recall, 1e-9)


def main(argv: list[str] | None = None) -> History:
    """Train, validate every epoch, keep the best checkpoint, stop early; print and return the history."""
    parser = common.example_parser(__doc__, epochs=6, batch_size=16, lr=3e-3)
    parser.add_argument("--box-weight", type=float, default=1.0, help="weight of the box loss (default 1)")
    args = common.parse(parser, argv)
    torch.manual_seed(args.seed)
    train_set, val_set = data.shape_detection(n_train=1000, n_val=400, size=IMAGE_SIZE, seed=args.seed)
    if args.smoke:  # seconds, not minutes: validate on a few images too
        val_set = data.limit(val_set, common.SMOKE_SAMPLES)
    train_loader = DataLoader(
        data.limit(train_set, args.limit),
        batch_size=args.batch_size,
        shuffle=True,
        collate_fn=pad_boxes,
        generator=torch.Generator().manual_seed(args.seed),
    )
    val_loader = DataLoader(val_set, batch_size=200, collate_fn=pad_boxes)

    anchors = make_anchors()
    net = SSD(NUM_CLASSES)
    # Two outputs, two labels (made by SSDProcessor), two losses matched by position; metrics per
    # output. The class accuracy leaves out the background anchors, so it is measured on the objects.
    metrics = {0: {"object_accuracy": Accuracy(ignore_index=0)}, 1: {"box_iou": BoxIoU(anchors)}}
    estimator = Estimator(
        net,
        loss=[class_loss, box_loss],
        loss_weights=[1.0, args.box_weight],
        train_metrics=metrics,
        optimizer=torch.optim.Adam(net.parameters(), lr=args.lr),
        batch_processor=SSDProcessor(anchors),
    )

    with common.checkpoint_dir(args) as folder:
        history = estimator.fit(
            train_loader,
            val_data=val_loader,
            epochs=args.epochs,
            event_handlers=[
                ProgressBarHandler(),
                CheckpointHandler(folder, model_prefix="ssd", monitor="val_loss", save_best=True),
                EarlyStoppingHandler(monitor="val_loss", patience=args.patience, restore_best=True),
            ],
        )
    # Early stopping put the best epoch's weights back: report the model we keep, not the last epoch.
    precision, recall, f1 = detection_f1(estimator.predict(val_loader), val_set)
    print(f"validation detection precision {precision:.4f}, recall {recall:.4f} (score >= 0.5, IoU >= 0.5)")
    print(f"validation detection F1: {f1:.4f} (target >= {TARGET}) after {history.epochs} epochs")
    return history


if __name__ == "__main__":
    main()

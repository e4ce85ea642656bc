"""Integration tests of the dense-prediction examples: FCN segmentation and SSD detection.

Each model runs at batch size 1 (BatchNorm must cope) and trains briefly to show that it learns.
"""

import math
import re

import pytest
import torch

from helpers import load_example

pytestmark = pytest.mark.integration  # trains the examples

pytest.importorskip("torchmetrics")

fcn = load_example("fcn_segmentation")
ssd = load_example("ssd_detection")

# FCN: predicting background everywhere gives a mean IoU of (background share) / 4 classes, about
# 0.21 on the validation images; an untrained net does no better. A short run must clear it by 0.25.
ALL_BACKGROUND_MEAN_IOU = 0.21
MEAN_IOU_MARGIN = 0.25
# SSD: on the anchors matched to an object, a blind guess between the two object classes is right
# half the time; a short run must beat that by 0.15. The anchors themselves (zero offsets) overlap
# their objects with IoU 0.60 on average; the predicted boxes must improve on that by 0.1. An
# untrained net has no detection scoring >= 0.5, so its detection F1 is 0; a short run must reach 0.5.
OBJECT_CHANCE, OBJECT_MARGIN = 0.5, 0.15
ANCHOR_IOU, BOX_IOU_MARGIN = 0.60, 0.1
MIN_DETECTION_F1 = 0.5


def checkpoints(folder, prefix):
    return sorted(p.name for p in folder.glob(f"{prefix}-*.pt"))


def test_fcn_runs_at_batch_size_one(tmp_path):
    history = fcn.main(["--smoke", "--batch-size", "1", "--limit", "8", "--checkpoint-dir", str(tmp_path)])
    assert history.epochs == 1
    assert not math.isnan(history.last("val_mean_iou"))
    assert checkpoints(tmp_path, "fcn") == ["fcn-best.pt", "fcn-epoch1batch8.pt"]


def test_fcn_learns_to_segment(tmp_path, capsys):
    # Small batches: more steps for the same compute, which a short run needs more than smooth gradients.
    history = fcn.main(["--batch-size", "4", "--epochs", "2", "--limit", "256", "--checkpoint-dir", str(tmp_path)])
    loss, mean_iou = history["train_loss"], history["val_mean_iou"]
    assert loss[-1] < loss[0]
    assert history.last("val_mean_iou") > ALL_BACKGROUND_MEAN_IOU + MEAN_IOU_MARGIN, mean_iou
    assert "validation mean IoU: " in capsys.readouterr().out


def test_ssd_runs_at_batch_size_one(tmp_path):
    history = ssd.main(["--smoke", "--batch-size", "1", "--limit", "8", "--checkpoint-dir", str(tmp_path)])
    assert history.epochs == 1
    assert {"val_loss_0", "val_loss_1", "val_object_accuracy", "val_box_iou"} <= set(history)
    assert (tmp_path / "ssd-epoch1batch8.pt").exists()


def test_ssd_learns_to_detect(tmp_path, capsys):
    history = ssd.main(["--batch-size", "8", "--epochs", "2", "--limit", "512", "--checkpoint-dir", str(tmp_path)])
    for key in ("train_loss_0", "train_loss_1"):  # both losses fell
        assert history[key][-1] < history[key][0], history[key]
    assert history.last("val_object_accuracy") > OBJECT_CHANCE + OBJECT_MARGIN, history["val_object_accuracy"]
    assert history.last("val_box_iou") > ANCHOR_IOU + BOX_IOU_MARGIN, history["val_box_iou"]
    f1 = float(re.search(r"validation detection F1: ([0-9.]+)", capsys.readouterr().out).group(1))
    assert f1 > MIN_DETECTION_F1  # predict's decoded boxes find the objects


def test_ssd_matching_gives_every_object_an_anchor_and_ignores_padding():
    anchors = ssd.make_anchors()
    boxes = torch.tensor(
        [[[0.1, 0.1, 0.35, 0.35], [0.6, 0.55, 0.9, 0.85]], [[0.40, 0.40, 0.62, 0.62], [0.0, 0.0, 0.0, 0.0]]]
    )  # image 2: one object + padding
    classes = torch.tensor([[1, 2], [2, -1]])
    class_target, box_target = ssd.match_anchors(anchors, boxes, classes)
    positive = box_target[..., 4] > 0
    assert torch.equal(positive, class_target > 0)
    assert set(class_target[0].unique().tolist()) == {0, 1, 2} and set(class_target[1].unique().tolist()) == {0, 2}
    # the positive anchors' targets decode back to their object's box exactly
    decoded = ssd.decode(box_target[..., :4], anchors)
    best = ssd.box_iou(decoded[:, :, None], boxes[:, None]).amax(dim=2)
    assert torch.allclose(best[positive], torch.ones(int(positive.sum())), atol=1e-4)


def test_ssd_detect_suppresses_duplicates_and_pads():
    boxes = torch.tensor([[[0.1, 0.1, 0.3, 0.3], [0.11, 0.1, 0.31, 0.3], [0.6, 0.6, 0.8, 0.8]]])
    scores = torch.tensor([[[0.0, 0.0, 0.0], [4.0, 3.0, 0.0], [0.0, 0.0, 5.0]]])  # (1, classes, anchors)
    found_boxes, found_scores, found_classes = ssd.detect(scores, boxes, keep=3)
    assert found_boxes.shape == (1, 3, 4) and found_scores.shape == found_classes.shape == (1, 3)
    assert found_classes.tolist() == [[2, 1, 0]]  # the overlapping second box is suppressed; padding is 0
    assert found_scores[0, 2] == 0 and torch.equal(found_boxes[0, 1], boxes[0, 0])

"""The learning assertions of the model tests are real: an untrained model fails each of them.

Every example runs one small epoch with ``--lr 0``, so its weights never move (BatchNorm statistics
still do), and the figure each ``test_models_*`` file requires of a short training must then be out
of reach. The thresholds are imported from those files, so the two cannot drift apart.
"""

import re

import pytest
import test_models_dense as dense
import test_models_text as text
import test_models_vision as vision

from helpers import load_example

pytestmark = pytest.mark.integration  # trains the examples

pytest.importorskip("sklearn")
pytest.importorskip("torchmetrics")

UNTRAINED = ["--lr", "0", "--epochs", "1", "--limit", "64"]
LEAST_ACCURACY = {name: least for name, _, least in vision.SHORT_RUNS}


def run(name, tmp_path):
    return load_example(name).main(UNTRAINED + ["--checkpoint-dir", str(tmp_path)])


@pytest.mark.parametrize("name", sorted(LEAST_ACCURACY))
def test_untrained_classifiers_miss_the_accuracy_required(name, tmp_path, capsys):
    run(name, tmp_path)
    assert vision.printed_accuracy(capsys.readouterr().out) < LEAST_ACCURACY[name]


def test_an_untrained_fcn_misses_the_mean_iou_required(tmp_path):
    history = run("fcn_segmentation", tmp_path)
    assert history.last("val_mean_iou") <= dense.ALL_BACKGROUND_MEAN_IOU + dense.MEAN_IOU_MARGIN


def test_an_untrained_ssd_misses_every_figure_required(tmp_path, capsys):
    history = run("ssd_detection", tmp_path)
    assert history.last("val_object_accuracy") <= dense.OBJECT_CHANCE + dense.OBJECT_MARGIN
    assert history.last("val_box_iou") <= dense.ANCHOR_IOU + dense.BOX_IOU_MARGIN
    f1 = float(re.search(r"validation detection F1: ([0-9.]+)", capsys.readouterr().out).group(1))
    assert f1 <= dense.MIN_DETECTION_F1


@pytest.mark.parametrize("name", ["birnn_sentiment", "textcnn_sentiment"])
def test_untrained_sentiment_models_miss_the_accuracy_required(name, tmp_path):
    history = run(name, tmp_path)
    assert max(history["val_accuracy"]) < text.SENTIMENT_CHANCE + text.SENTIMENT_MARGIN


def test_an_untrained_translator_misses_the_exact_match_required(tmp_path):
    history = run("translator", tmp_path)
    assert max(history["val_exact_match"]) < text.EXACT_MATCH_CHANCE + text.EXACT_MATCH_MARGIN

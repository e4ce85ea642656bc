"""Integration tests of the image classifiers (AlexNet-style, ResNet-18) and logistic regression.

Each example runs through its ``main`` as a user would run the script: once at batch size 1 (the
smallest batch must work, BatchNorm included) and once for a short real training that must learn.
"""

import math
import re

import pytest

from helpers import load_example

pytestmark = pytest.mark.integration  # trains the examples

pytest.importorskip("sklearn")

PREFIXES = {"alexnet": "alexnet", "resnet18": "resnet18", "logistic_regression": "logreg"}


def printed_accuracy(out: str) -> float:
    """The validation accuracy of the kept model, from the example's last line."""
    return float(re.search(r"validation accuracy: ([\d.]+)", out).group(1))


@pytest.mark.parametrize("name", sorted(PREFIXES))
def test_trains_at_batch_size_one(name, tmp_path, capsys):
    history = load_example(name).main(
        ["--batch-size", "1", "--epochs", "1", "--limit", "8", "--checkpoint-dir", str(tmp_path)]
    )
    assert history.epochs == 1 and math.isfinite(history.last("train_loss"))
    # one epoch of 8 batches of one sample, and the best-so-far copy
    assert (tmp_path / f"{PREFIXES[name]}-epoch1batch8.pt").is_file()
    assert (tmp_path / f"{PREFIXES[name]}-best.pt").is_file()
    assert not math.isnan(printed_accuracy(capsys.readouterr().out))


# name, command line of a short run, least validation accuracy it must reach. The margins over
# chance are wide enough that seeded runs pass with room, and an untrained model fails by far.
SHORT_RUNS = [
    # 10 balanced digit classes: chance 0.10; margin 0.50 (this run reaches about 0.82)
    ("alexnet", ["--epochs", "2", "--limit", "768"], 0.10 + 0.50),
    # chance 0.10; margin 0.50 (about 0.92). Small batches: BatchNorm's running statistics, used at
    # validation, need a few dozen steps to settle.
    ("resnet18", ["--epochs", "3", "--limit", "640", "--batch-size", "16"], 0.10 + 0.50),
    # majority class (benign) is 0.63 of the validation set, an untrained (random) linear model
    # scores about 0.5; margin 0.27 over the majority class (this run reaches about 0.97)
    ("logistic_regression", ["--epochs", "5"], 0.63 + 0.27),
]


@pytest.mark.parametrize("name, argv, least_accuracy", SHORT_RUNS, ids=[run[0] for run in SHORT_RUNS])
def test_short_training_learns(name, argv, least_accuracy, tmp_path, capsys):
    history = load_example(name).main(argv + ["--checkpoint-dir", str(tmp_path)])
    losses = history["train_loss"]
    assert losses[-1] < losses[0], f"training loss did not fall: {losses}"
    accuracy = printed_accuracy(capsys.readouterr().out)
    assert accuracy >= least_accuracy, f"validation accuracy {accuracy:.3f} < {least_accuracy:.2f}"

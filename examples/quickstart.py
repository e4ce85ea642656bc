"""Quickstart: a small CNN on scikit-learn's handwritten digits, trained with fitforge.

The digits (1797 real 8x8 grey-scale images, 10 classes) ship inside scikit-learn, so nothing is
downloaded. Reaches about 98% validation accuracy on a laptop CPU in a few seconds.

    python examples/quickstart.py                 # 15 epochs, plot saved to ./quickstart_history.png
    python examples/quickstart.py --epochs 5 --plot /tmp/digits.png
    python examples/quickstart.py --smoke         # 1 epoch, for tests
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.handlers import ProgressBarHandler

SEED = 0


def digits_loaders(batch_size: int = 64, seed: int = SEED) -> tuple[DataLoader, DataLoader]:
    """Train/validation DataLoaders of (N, 1, 8, 8) float images in [0, 1] and int64 labels (80/20)."""
    digits = load_digits()
    images = digits.images.reshape(-1, 1, 8, 8) / 16.0  # pixel values are 0..16
    x_train, x_val, y_train, y_val = train_test_split(
        images, digits.target, test_size=0.2, stratify=digits.target, random_state=seed
    )

    def dataset(x, y):
        return TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64))

    train = DataLoader(
        dataset(x_train, y_train), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    return train, DataLoader(dataset(x_val, y_val), batch_size=256)


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 64 x 4 x 4
        nn.Flatten(),
        nn.Dropout(0.25),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def main(argv: list[str] | None = None) -> float:
    """Train, validate, plot; return the final validation accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="train 1 epoch (for tests)")
    parser.add_argument("--plot", default="quickstart_history.png", help="where to save the PNG plot")
    args = parser.parse_args(argv)
    epochs = 1 if args.smoke else args.epochs

    torch.manual_seed(SEED)
    train_loader, val_loader = digits_loaders()
    net = make_net()

    # The training part: configure, fit (validation every epoch), done.
    estimator = Estimator(
        net,
        nn.CrossEntropyLoss(),
        train_metrics="accuracy",
        optimizer=torch.optim.Adam(net.parameters(), lr=2e-3),
        device=None,
    )
    history = estimator.fit(train_loader, val_data=val_loader, epochs=epochs, event_handlers=[ProgressBarHandler()])

    history.plot(args.plot)
    print(f"loss/accuracy plot saved to {args.plot}")
    accuracy = history.last("val_accuracy")
    print(f"validation accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()

"""ResNet-18 on scikit-learn's handwritten digits, with data augmentation, trained with fitforge.

The model is ResNet-18 (He et al., 2016): four stages of two BasicBlocks each, [2, 2, 2, 2], with
BatchNorm and identity shortcuts (1x1 projections where the shape changes). For small images the
stem is one 3x3 convolution without max-pooling, as in the CIFAR variants, and the width starts at
``--width`` channels (16 by default, against 64 in the paper) so that it trains on a CPU.
The data are the 1797 8x8 digits upscaled to 16x16 (80/20 split); every training image gets a
random small rotation, zoom and shift each epoch (``data.RandomAffine``), validation images none.
Reaches 0.997 validation accuracy (target >= 0.95) in 19 epochs and about 65 seconds on a 2-core
CPU, stopped early when the validation loss no longer improves (the best epoch's weights are kept).

    python examples/resnet18.py                        # full run, checkpoints in a temp folder
    python examples/resnet18.py --width 32             # wider, slower
    python examples/resnet18.py --checkpoint-dir ckpt  # keep the checkpoints
    python examples/resnet18.py --smoke                # one short epoch, for tests
"""

from __future__ import annotations

import common
import data
import torch
from torch import nn
from torch.utils.data import DataLoader

from fitforge import Estimator, History
from fitforge.handlers import CheckpointHandler, EarlyStoppingHandler, ProgressBarHandler

TARGET = 0.95  # validation accuracy; chance is 0.10 (10 balanced classes)
IMAGE_SIZE = 16  # the last stage then works on 2x2 maps, so BatchNorm has >1 value per channel at batch size 1


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, added to the (projected) input: out = relu(f(x) + x)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False),  # BatchNorm has the bias
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet18(num_classes: int = 10, width: int = 16, in_channels: int = 1) -> nn.Sequential:
    """ResNet-18 with a small-image stem; stages of width, 2x, 4x, 8x channels, stride 2 from stage 2."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
    ]
    channels = width
    for stage, multiplier in enumerate([1, 2, 4, 8]):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(BasicBlock(channels, width * multiplier, stride))
            channels = width * multiplier
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def main(argv: list[str] | None = None) -> History:
    """Train with augmentation, validate every epoch, stop early; print and return the history."""
    parser = common.example_parser(__doc__, epochs=30, batch_size=32, lr=1e-3)
    parser.add_argument("--width", type=int, default=16, help="channels of the first stage (default 16)")
    parser.set_defaults(patience=5)  # augmentation makes the validation loss noisier from epoch to epoch
    args = common.parse(parser, argv)
    torch.manual_seed(args.seed)
    train_set, val_set = data.digits(size=IMAGE_SIZE, seed=args.seed)
    augmented = data.RandomAffine(data.limit(train_set, args.limit), seed=args.seed)  # training set only
    train_loader = DataLoader(
        augmented, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(args.seed)
    )
    val_loader = DataLoader(val_set, batch_size=256)

    net = resnet18(width=args.width)
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), train_metrics="accuracy", optimizer=torch.optim.Adam(net.parameters(), lr=args.lr)
    )

    with common.checkpoint_dir(args) as folder:
        history = estimator.fit(
            train_loader,
            val_data=val_loader,
            epochs=args.epochs,
            event_handlers=[
                ProgressBarHandler(),
                # resnet18-epoch<E>batch<B>.pt every epoch (newest 5 kept), and resnet18-best.pt: lowest val_loss
                CheckpointHandler(folder, model_prefix="resnet18", monitor="val_loss", save_best=True),
                EarlyStoppingHandler(monitor="val_loss", patience=args.patience, restore_best=True),
            ],
        )
    # Early stopping put the best epoch's weights back: report the model we keep, not the last epoch.
    accuracy = estimator.evaluate(val_loader)["val_accuracy"]
    print(f"validation accuracy: {accuracy:.4f} (target >= {TARGET}) after {history.epochs} epochs")
    return history


if __name__ == "__main__":
    main()

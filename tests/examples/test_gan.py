"""examples/gan.py: two optimizers taking turns, losses logged by name, samples on the ring."""

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.events import BatchBegin, BatchEnd, Stage
from helpers import load_example

pytestmark = pytest.mark.integration  # trains the examples


def test_the_gan_learns_the_ring_and_logs_both_losses(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    history, good, covered = load_example("gan").main(["--epochs", "30", "--plot", str(tmp_path / "gan.png")])
    assert good >= 0.5 and covered >= 6  # 0.66 and 7 of 8 at 30 epochs; a collapsed GAN covers 1 or 2
    assert {"train_d_loss", "train_g_loss"} <= set(history) and len(history["train_d_loss"]) == 30
    assert "train_loss" not in history  # the mean of alternating D and G losses is left out (record_loss=False)
    assert (tmp_path / "gan.png").stat().st_size > 1000
    assert "blobs covered" in capsys.readouterr().out


class Changed(BatchBegin, BatchEnd):
    """Records, per batch, which of the two nets the optimizer step changed."""

    priority = Stage.STEP + 1  # right after GradientUpdateHandler's step

    def __init__(self, gan):
        self.gan, self.changed = gan, []

    def batch_begin(self, state):
        self.before = [[p.detach().clone() for p in net.parameters()] for net in self.nets]

    def batch_end(self, state):
        self.changed.append(
            tuple(
                any(not torch.equal(a, b) for a, b in zip(old, net.parameters()))
                for old, net in zip(self.before, self.nets)
            )
        )

    @property
    def nets(self):
        return (self.gan.discriminator, self.gan.generator)


def test_each_batch_steps_only_its_nets_optimizer():
    gan_example = load_example("gan")
    torch.manual_seed(0)
    gan = gan_example.GAN()
    estimator = Estimator(
        gan,
        nn.BCEWithLogitsLoss(),
        optimizer=[torch.optim.Adam(gan.discriminator.parameters()), torch.optim.Adam(gan.generator.parameters())],
        batch_processor=gan_example.TakeTurns(),
    )
    recorder = Changed(gan)
    points = gan_example.ring(64, seed=0)
    estimator.fit([(points[i : i + 16],) for i in range(0, 64, 16)], epochs=2, event_handlers=[recorder])
    # discriminator, generator, discriminator...: the other net's weights stay as they were
    assert recorder.changed == [(True, False), (False, True)] * 4

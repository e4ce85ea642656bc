"""The first batch's trial copy of a metric (fitforge.metrics.trial)."""

import torch

from fitforge.metrics import Accuracy, SumCountMetric
from fitforge.metrics.trial import trial_copy


def test_the_first_batch_trial_of_a_builtin_metric_leaves_its_running_state_alone():
    metric = Accuracy(ignore_index=-1)
    metric.update(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 0]))  # 1 of 2 right
    trial = trial_copy(metric)
    trial.update(torch.tensor([[0.9, 0.1]]), torch.tensor([0]))
    assert trial.ignore_index == -1 and float(trial.compute()) == 1.0  # fresh: only its own batch
    assert float(metric.compute()) == 0.5 and metric._count == 2  # the original's sums untouched


def test_the_first_batch_trial_of_another_metric_is_a_deep_copy():
    class Buffered(SumCountMetric):  # a user's metric whose reset() empties a list in place
        def __init__(self):
            super().__init__()
            self.seen = []

        def reset(self):
            super().reset()
            self.seen.clear()

    metric = Buffered()
    metric.seen.append(1)
    trial_copy(metric).seen.append(2)
    assert metric.seen == [1]

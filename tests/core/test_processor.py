"""The custom-step contract of BatchProcessor: a fit_batch written whole keeps the estimator's mixed
precision (forward under autocast, backward outside it and scaled under fp16) with no code of its own."""

import pytest
import torch
from torch import nn

from fitforge import BatchOutput, BatchProcessor, Estimator
from fitforge.core.processor import bound_step
from fitforge.events import BackwardEnd


class L2Penalty(BatchProcessor):
    """The docs' custom step: the data loss is recorded, the penalised one backpropagated."""

    def __init__(self, weight=1e-4):
        super().__init__()
        self.weight = weight

    def fit_batch(self, state, batch):
        inputs, label = self.to_device(state, batch)
        estimator = state.estimator
        pred = self.forward(estimator.train_net, inputs, label)
        loss, losses = estimator.compute_loss(pred, label)
        penalty = sum(p.pow(2).sum() for p in estimator.net.parameters())
        self.backward(loss + self.weight * penalty)
        return BatchOutput(inputs, label, pred, loss, losses, batch_size=len(label))


class Recording(nn.Linear):
    """A Linear(4, 1) that records the autocast state and its output dtype in forward, and the
    autocast state in its backward."""

    def __init__(self):
        super().__init__(4, 1)
        self.forwards, self.backwards = [], []
        self.weight.register_hook(lambda grad: self.backwards.append(torch.is_autocast_enabled("cpu")))

    def forward(self, x):
        out = super().forward(x)
        self.forwards.append((torch.is_autocast_enabled("cpu"), out.dtype))
        return out.float()


def batches(n=3):
    torch.manual_seed(0)
    return [(torch.rand(8, 4), torch.rand(8, 1)) for _ in range(n)]


def estimator(net, precision, processor=None):
    return Estimator(
        net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu",
        precision=precision, batch_processor=processor or L2Penalty(),
    )  # fmt: skip


def test_a_custom_fit_batch_runs_its_forward_under_bf16_autocast_and_its_backward_outside():
    net = Recording()
    est = estimator(net, "bf16-mixed")
    est.fit(batches(), epochs=1, default_handlers=False)
    assert net.forwards == [(True, torch.bfloat16)] * 3
    assert net.backwards == [False] * 3


def test_a_custom_evaluate_and_predict_batch_run_under_autocast():
    class Custom(BatchProcessor):
        def evaluate_batch(self, state, batch):
            return super().evaluate_batch(state, batch)

        def predict_batch(self, state, batch):
            inputs = self.inputs_to_device(state, batch)
            return self.forward(state.estimator.val_net, inputs, None)

    net = Recording()
    est = estimator(net, "bf16-mixed", Custom())
    est.evaluate(batches(1))
    est.predict(batches(1))
    assert net.forwards == [(True, torch.bfloat16)] * 2


def test_float32_enters_no_autocast():
    net = Recording()
    estimator(net, None).fit(batches(), epochs=1, default_handlers=False)
    assert set(net.forwards) == {(False, torch.float32)}


class InfGradient(BackwardEnd):
    def backward_end(self, state):
        if state.global_step == 0:
            state.estimator.net.weight.grad.fill_(float("inf"))


def test_a_custom_fit_batch_is_scaled_under_fp16_and_a_step_with_inf_gradients_is_skipped():
    net = Recording()
    est = estimator(net, "16-mixed")
    scale = est.scaler.get_scale()
    scaled = []
    net.weight.register_hook(lambda grad: scaled.append(est.scaler.get_scale()))
    before = net.weight.detach().clone()
    est.fit(batches(1), epochs=1, default_handlers=False, event_handlers=[InfGradient()])
    assert scaled == [scale]  # the gradient flowed from a loss the scaler had scaled
    assert torch.equal(before, net.weight)  # the step was skipped
    assert est.scaler.get_scale() < scale  # and the scale backed off
    est.fit(batches(), epochs=1, default_handlers=False)  # then it trains, no "_scale is None"
    assert not torch.equal(before, net.weight)


def test_the_default_step_is_returned_unwrapped():
    processor = BatchProcessor()
    est = estimator(nn.Linear(4, 1), "bf16-mixed", processor)
    assert bound_step(processor, est, "fit_batch") == processor.fit_batch
    assert bound_step(L2Penalty(), estimator(nn.Linear(4, 1), None), "fit_batch").__name__ == "fit_batch"


def test_a_duck_typed_processor_is_called_as_it_is():
    class Duck:
        allow_nonfinite = False

        def fit_batch(self, state, batch): ...
        def evaluate_batch(self, state, batch): ...
        def predict_batch(self, state, batch): ...

    duck = Duck()
    assert bound_step(duck, estimator(nn.Linear(4, 1), "bf16-mixed"), "fit_batch") == duck.fit_batch


def test_a_duck_typed_processor_must_have_what_the_loop_reads():
    from fitforge.core.processor import check_batch_processor
    from fitforge.exceptions import FitforgeTypeError

    class Duck:
        def fit_batch(self, state, batch): ...
        def evaluate_batch(self, state, batch): ...
        def predict_batch(self, state, batch): ...

    with pytest.raises(FitforgeTypeError, match="lacks allow_nonfinite, logs, record_loss, label_keys: subclass"):
        check_batch_processor(Duck())
    Duck.allow_nonfinite, Duck.logs, Duck.record_loss, Duck.label_keys = False, (), True, ("label",)
    assert isinstance(check_batch_processor(Duck()), Duck)


def test_backward_of_a_non_tensor_is_explained():
    from fitforge.exceptions import LossInputError

    with pytest.raises(LossInputError, match="backward needs the loss as a tensor, got float 1.0"):
        BatchProcessor().backward(1.0)

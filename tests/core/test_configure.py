"""Argument resolution and checks (checks/options.py) and the loss set with its label hints (losses/loss.py)."""

import math
import re
import warnings

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.checks.options import (
    check_duration,
    check_net,
    resolve_device,
    resolve_optimizers,
    warn_default_optimizer,
)
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, LossInputError
from fitforge.losses.loss import LossSet

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")


# -- resolve_device ------------------------------------------------------------------------------------
class TestResolveDevice:
    @no_cuda
    def test_none_is_cpu_without_cuda(self):
        assert resolve_device(None) == torch.device("cpu")

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    def test_none_is_cuda_with_cuda(self):  # pragma: no cover - depends on the machine
        assert resolve_device(None).type == "cuda"

    @pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "CPU".lower()])
    def test_cpu(self, device):
        resolved = resolve_device(device)
        assert isinstance(resolved, torch.device) and resolved == torch.device("cpu")

    @pytest.mark.parametrize("device", ["gpu0", "gpu", "", "cuda:x"])
    def test_bad_string(self, device):
        msg = f"device {device!r} is not a device name; expected 'cpu', 'cuda', 'cuda:<index>' or 'mps'"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            resolve_device(device)

    @no_cuda
    @pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1", torch.device("cuda")])
    def test_cuda_unavailable(self, device):
        with pytest.raises(FitforgeValueError, match="CUDA is not available on this machine") as info:
            resolve_device(device)
        assert "device='cpu'" in str(info.value)
        assert repr(device) in str(info.value)

    @no_cuda
    def test_int_index_cuda_unavailable(self):
        with pytest.raises(FitforgeValueError, match="CUDA is not available on this machine") as info:
            resolve_device(0)
        assert "device='cpu'" in str(info.value)

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    def test_cuda_index_out_of_range(self):  # pragma: no cover - depends on the machine
        count = torch.cuda.device_count()
        with pytest.raises(FitforgeValueError, match=re.escape(f"this machine has {count} CUDA device(s)")):
            resolve_device(f"cuda:{count}")

    @pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is available here")
    def test_mps_unavailable(self):
        with pytest.raises(
            FitforgeValueError,
            match=re.escape("device 'mps' was requested but MPS is not available; pass device='cpu'"),
        ):
            resolve_device("mps")

    @pytest.mark.parametrize(
        "device,shown",
        [
            (3.5, "float 3.5"),
            (True, "bool True"),
            (False, "bool False"),
            ([0], "list [0]"),
            (nn.Linear(1, 1), "Linear"),
        ],
    )
    def test_wrong_type(self, device, shown):
        msg = (
            f"device must be None, a string such as 'cpu' or 'cuda:0', an int GPU index or a torch.device, got {shown}"
        )
        with pytest.raises(FitforgeTypeError, match=re.escape(msg)):
            resolve_device(device)


# -- resolve_optimizers -----------------------------------------------------------------------------------
def param_ids(optimizer):
    return [id(p) for group in optimizer.param_groups for p in group["params"]]


class TestResolveOptimizers:
    def test_none_gives_adam_without_a_warning(self):
        net = nn.Linear(3, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned of when training starts (warn_default_optimizer)
            optimizers = resolve_optimizers(None, net)
        assert len(optimizers) == 1
        assert type(optimizers[0]) is torch.optim.Adam
        assert optimizers[0].param_groups[0]["lr"] == 1e-3
        assert param_ids(optimizers[0]) == [id(p) for p in net.parameters()]

    @pytest.mark.parametrize(
        "name,cls,lr",
        [
            ("adam", torch.optim.Adam, 1e-3),
            ("Adam", torch.optim.Adam, 1e-3),
            ("ADAMW", torch.optim.AdamW, 1e-3),
            ("sgd", torch.optim.SGD, 1e-2),
            ("SGD", torch.optim.SGD, 1e-2),
            ("rmsprop", torch.optim.RMSprop, 1e-2),
            ("adagrad", torch.optim.Adagrad, 1e-2),
        ],
    )
    def test_names(self, name, cls, lr):
        net = nn.Linear(3, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a name is an explicit choice: no warning
            (optimizer,) = resolve_optimizers(name, net)
        assert type(optimizer) is cls and optimizer.param_groups[0]["lr"] == lr
        assert param_ids(optimizer) == [id(p) for p in net.parameters()]

    @pytest.mark.parametrize("name", ["sgd", None])
    def test_a_name_or_the_default_holds_frozen_parameters_too(self, name):
        net = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
        net[0].requires_grad_(False)  # skipped while without a gradient; trained once unfrozen
        (optimizer,) = resolve_optimizers(name, net)
        assert param_ids(optimizer) == [id(p) for p in net.parameters()]

    def test_unknown_name(self):
        msg = (
            "optimizer 'adamax' is not a known name; known: adam, adamw, sgd, rmsprop, adagrad, muon, "
            "or pass a torch.optim.Optimizer instance"
        )
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            resolve_optimizers("adamax", nn.Linear(1, 1))

    def test_optimizer_instance(self):
        net = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        result = resolve_optimizers(optimizer, net)
        assert result == [optimizer] and result[0] is optimizer
        assert optimizer.param_groups[0]["lr"] == 0.5

    @pytest.mark.parametrize("container", [list, tuple])
    def test_several(self, container):
        net = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
        first = torch.optim.SGD(net[0].parameters(), lr=0.1)
        second = torch.optim.Adam(net[1].parameters())
        result = resolve_optimizers(container([first, second]), net)
        assert isinstance(result, list) and len(result) == 2
        assert result[0] is first and result[1] is second

    def test_list_is_not_mutated(self):
        net = nn.Linear(1, 1)
        given = [torch.optim.SGD(net.parameters(), lr=0.1)]
        result = resolve_optimizers(given, net)
        result.append("x")
        assert len(given) == 1

    @pytest.mark.parametrize("empty", [[], ()])
    def test_empty_list(self, empty):
        with pytest.raises(
            FitforgeValueError, match=re.escape("optimizer is an empty list; give at least one torch.optim.Optimizer")
        ):
            resolve_optimizers(empty, nn.Linear(1, 1))

    @pytest.mark.parametrize("spec", [torch.optim.Adam, [torch.optim.Adam]])
    def test_class_instead_of_instance(self, spec):
        msg = (
            "optimizer must be a torch.optim.Optimizer, a list of them, a name such as 'adam', or None, "
            "got the class Adam; pass an instance: Adam(net.parameters(), lr=...)"
        )
        with pytest.raises(FitforgeTypeError, match=re.escape(msg)):
            resolve_optimizers(spec, nn.Linear(1, 1))

    @pytest.mark.parametrize(
        "spec,shown", [(3, "int 3"), (nn.Linear(1, 1), "Linear"), ({"lr": 0.1}, "dict {'lr': 0.1}")]
    )
    def test_not_an_optimizer(self, spec, shown):
        with pytest.raises(FitforgeTypeError, match=re.escape(f"or None, got {shown}")) as info:
            resolve_optimizers(spec, nn.Linear(1, 1))
        assert "pass an instance" not in str(info.value)

    def test_not_an_optimizer_inside_list(self):
        net = nn.Linear(1, 1)
        with pytest.raises(FitforgeTypeError, match=re.escape("got str 'sgd'")):
            resolve_optimizers([torch.optim.SGD(net.parameters(), lr=0.1), "sgd"], net)

    def test_net_without_trainable_parameters(self):
        net = nn.Linear(2, 1).requires_grad_(False)
        msg = "net has no trainable parameters (none with requires_grad=True), so no optimizer can train it"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            resolve_optimizers("adam", net)
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            resolve_optimizers("sgd", nn.ReLU())
        assert resolve_optimizers(None, net) == []  # for evaluation and prediction; training raises
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            warn_default_optimizer([], net, False, "fit")


# -- check_net / check_duration ----------------------------------------------------------------------------
class TestCheckNet:
    def test_module_is_returned(self):
        net = nn.Linear(1, 1)
        assert check_net(net) is net

    def test_class(self):
        with pytest.raises(FitforgeTypeError, match=re.escape("net got the class Linear; pass an instance: Linear()")):
            check_net(nn.Linear)

    def test_class_names_argument(self):
        with pytest.raises(FitforgeTypeError, match=re.escape("val_net got the class ReLU; pass an instance: ReLU()")):
            check_net(nn.ReLU, argument="val_net")

    @pytest.mark.parametrize(
        "net,shown", [(lambda x: x, "function"), (None, "NoneType None"), ("resnet", "str 'resnet'")]
    )
    def test_not_a_module(self, net, shown):
        with pytest.raises(FitforgeTypeError, match=re.escape(f"net must be a torch.nn.Module, got {shown}")):
            check_net(net)


class TestCheckDuration:
    @pytest.mark.parametrize("epochs,batches", [(1, None), (None, 1), (10, None), (None, 500)])
    def test_valid(self, epochs, batches):
        assert check_duration(epochs, batches) is None

    @pytest.mark.parametrize("epochs,batches", [(2, 3), (None, None)])
    def test_exactly_one(self, epochs, batches):
        msg = f"give exactly one of epochs or batches, got epochs={epochs!r} and batches={batches!r}"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            check_duration(epochs, batches)

    @pytest.mark.parametrize(
        "epochs,batches,name,bad", [(0, None, "epochs", 0), (-1, None, "epochs", -1), (None, 0, "batches", 0)]
    )
    def test_not_positive(self, epochs, batches, name, bad):
        with pytest.raises(FitforgeValueError, match=re.escape(f"{name} must be a positive int, got {bad}")):
            check_duration(epochs, batches)

    @pytest.mark.parametrize(
        "epochs,batches,name,shown",
        [
            (2.5, None, "epochs", "float 2.5"),
            (True, None, "epochs", "bool True"),
            (None, "10", "batches", "str '10'"),
            (None, 3.0, "batches", "float 3.0"),
        ],
    )
    def test_wrong_type(self, epochs, batches, name, shown):
        with pytest.raises(FitforgeTypeError, match=re.escape(f"{name} must be a positive int, got {shown}")):
            check_duration(epochs, batches)


# -- LossSet ------------------------------------------------------------------------------------------------
class TestLossSet:
    def test_single_loss(self):
        loss = LossSet(nn.MSELoss())
        pred, label = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])
        total, parts = loss(pred, label)
        assert total.item() == pytest.approx(2.5)
        assert parts == (total,)
        assert loss.names == ["MSELoss"] and loss.weights == [1.0] and not loss.multi

    def test_losses_by_output_name(self):
        loss = LossSet({"cls": nn.CrossEntropyLoss(), "reg": nn.MSELoss()}, weights={"reg": 0.5})
        assert loss.keys == ("cls", "reg") and loss.weights == [1.0, 0.5] and loss.named and loss.multi
        pred = {"reg": torch.tensor([1.0]), "cls": torch.tensor([[0.0, 0.0]]), "extra": "left alone"}
        label = {"cls": torch.tensor([1]), "reg": torch.tensor([3.0]), "mask": None}
        total, (cls, reg) = loss(pred, label)
        assert cls.item() == pytest.approx(math.log(2)) and reg.item() == pytest.approx(4.0)
        assert total.item() == pytest.approx(math.log(2) + 2.0)

    def test_one_loss_by_output_name(self):
        loss = LossSet({"y": nn.MSELoss()})
        total, parts = loss({"y": torch.tensor([2.0])}, {"y": torch.tensor([0.0])})
        assert total.item() == 4.0 and len(parts) == 1

    def test_a_failing_loss_is_named_by_its_output(self):
        loss = LossSet({"reg": nn.MSELoss()})
        with pytest.raises(LossInputError, match=re.escape("loss 'reg' (MSELoss) compares pred and label elementwise")):
            loss({"reg": torch.zeros(4, 1)}, {"reg": torch.zeros(4)})

    def test_callable_loss_and_name(self):
        def l1(pred, label):
            return (pred - label).abs().mean()

        loss = LossSet(l1)
        total, _ = loss(torch.tensor([1.0, -3.0]), torch.tensor([0.0, 0.0]))
        assert total.item() == pytest.approx(2.0) and loss.names == ["l1"]

    def test_single_loss_with_weight(self):
        total, parts = LossSet(nn.MSELoss(), weights=[0.5])(torch.tensor([2.0]), torch.tensor([0.0]))
        assert total.item() == pytest.approx(2.0) and parts[0].item() == pytest.approx(4.0)

    def test_several_losses_weighted(self):
        loss = LossSet([nn.CrossEntropyLoss(), nn.MSELoss()], weights=[2.0, 0.5])
        logits, classes = torch.randn(4, 3), torch.tensor([0, 2, 1, 1])
        box, target = torch.randn(4, 2), torch.randn(4, 2)
        total, parts = loss((logits, box), (classes, target))
        ce = nn.functional.cross_entropy(logits, classes)
        mse = nn.functional.mse_loss(box, target)
        assert len(parts) == 2
        assert parts[0].item() == pytest.approx(ce.item()) and parts[1].item() == pytest.approx(mse.item())
        assert total.item() == pytest.approx(2.0 * ce.item() + 0.5 * mse.item())
        assert loss.multi and loss.names == ["CrossEntropyLoss", "MSELoss"] and loss.weights == [2.0, 0.5]

    def test_several_losses_default_weights(self):
        loss = LossSet((nn.L1Loss(), nn.L1Loss()))
        total, parts = loss([torch.ones(2), torch.zeros(2)], [torch.zeros(2), torch.full((2,), 3.0)])
        assert [p.item() for p in parts] == [1.0, 3.0] and total.item() == 4.0
        assert loss.weights == [1.0, 1.0]

    def test_gradient_flows_through_total(self):
        w = torch.ones(2, requires_grad=True)
        total, _ = LossSet([nn.MSELoss(), nn.MSELoss()], weights=[1, 3])((w, w), (torch.zeros(2), torch.zeros(2)))
        total.backward()
        assert torch.allclose(w.grad, torch.full((2,), 4.0))  # d/dw (1+3) * mean(w^2) = 4 * 2w/2

    def test_to_moves_loss_modules(self):
        weighted = nn.CrossEntropyLoss(weight=torch.ones(3))
        loss = LossSet([weighted, lambda p, y: p.sum()])
        assert loss.to(torch.device("meta")) is loss
        assert weighted.weight.device.type == "meta"

    @pytest.mark.parametrize("weights", [[1.0], [1.0, 2.0, 3.0]])
    def test_wrong_number_of_weights(self, weights):
        msg = f"loss_weights has {len(weights)} weight(s) but 2 loss(es) are configured; give one per loss"
        with pytest.raises(FitforgeValueError, match=re.escape(msg)):
            LossSet([nn.MSELoss(), nn.L1Loss()], weights=weights)

    @pytest.mark.parametrize(
        "weights, shown",
        [
            ([1.0, "2"], "list [1.0, '2']"),
            ([1.0, None], "list [1.0, None]"),
            ("a", "str 'a'"),
            ([True, 1.0], "list [True, 1.0]"),
        ],
    )
    def test_weights_of_wrong_type(self, weights, shown):
        msg = f"loss_weights must be a list of numbers, one per loss, got {shown}"
        with pytest.raises(FitforgeTypeError, match=re.escape(msg)):
            LossSet([nn.MSELoss(), nn.L1Loss()], weights=weights)

    @pytest.mark.parametrize("loss,shown", [(3, "int 3"), ([nn.MSELoss(), "mse"], "str 'mse'")])
    def test_not_callable(self, loss, shown):
        msg = (
            "loss must be a loss module or a callable (pred, label) -> scalar tensor, or a list of them, "
            f"or a dict of them by output name, got {shown}"
        )
        with pytest.raises(FitforgeTypeError, match=re.escape(msg)):
            LossSet(loss)

    @pytest.mark.parametrize("loss", [nn.MSELoss, [nn.L1Loss(), nn.MSELoss]])
    def test_class_instead_of_instance(self, loss):
        with pytest.raises(
            FitforgeTypeError, match=re.escape("loss got the class MSELoss; pass an instance: MSELoss()")
        ):
            LossSet(loss)

    def test_argument_name_in_errors(self):
        with pytest.raises(FitforgeTypeError, match=re.escape("val_loss got the class MSELoss")):
            LossSet(nn.MSELoss, argument="val_loss")

    @pytest.mark.parametrize("empty", [[], ()])
    def test_empty(self, empty):
        with pytest.raises(FitforgeValueError, match=re.escape("loss is an empty list; give at least one loss")):
            LossSet(empty)

    def test_count_mismatch(self):
        loss = LossSet(nn.MSELoss())
        msg = "the net returned 2 output(s), 1 loss(es) are configured and the batch has 1 label(s)"
        with pytest.raises(LossInputError, match=re.escape(msg)):
            loss((torch.zeros(2), torch.zeros(2)), torch.zeros(2))

    def test_count_mismatch_labels(self):
        loss = LossSet([nn.MSELoss(), nn.MSELoss()])
        msg = "the net returned 2 output(s), 2 loss(es) are configured and the batch has 1 label(s)"
        with pytest.raises(LossInputError, match=re.escape(msg)):
            loss((torch.zeros(2), torch.zeros(2)), torch.zeros(2))

    def test_cross_entropy_float_label_hint(self):
        loss = LossSet(nn.CrossEntropyLoss())
        with pytest.raises(LossInputError, match=re.escape("use label.long()")) as info:
            loss(torch.randn(4, 3), torch.tensor([0.0, 1.0, 2.0, 1.0]))
        message = str(info.value)
        assert "loss 0 (CrossEntropyLoss) failed on pred shape (4, 3) float32 and label shape (4,) float32" in message
        assert "class-index labels must be int64 of shape (4,)" in message
        assert "Original error:" in message
        assert isinstance(info.value.__cause__, RuntimeError)

    def test_cross_entropy_float_label_hint_segmentation(self):
        loss = LossSet(nn.CrossEntropyLoss())
        with pytest.raises(
            LossInputError, match=re.escape("class-index labels must be int64 of shape (2, 5, 5): use label.long()")
        ):
            loss(torch.randn(2, 3, 5, 5), torch.zeros(2, 5, 5))

    def test_cross_entropy_probability_labels_are_fine(self):
        probs = torch.softmax(torch.randn(4, 3), dim=1)
        total, _ = LossSet(nn.CrossEntropyLoss())(torch.randn(4, 3), probs)
        assert total.dim() == 0

    def test_mse_shape_mismatch_is_refused_before_torch_broadcasts(self, recwarn):
        loss = LossSet(nn.MSELoss())
        with pytest.raises(LossInputError, match=re.escape("pred has shape (4, 3) and label (4, 2)")):
            loss(torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.long))
        assert not recwarn.list  # torch's own broadcast warning never fires

    def test_shapes_are_checked_on_the_first_call_only_until_rearmed(self):
        loss = LossSet(nn.MSELoss())
        loss(torch.zeros(4, 1), torch.zeros(4, 1))
        with pytest.warns(UserWarning, match="target size"):  # not checked again: torch only warns
            loss(torch.zeros(4, 1), torch.zeros(4))
        loss.arm_checks()
        with pytest.raises(LossInputError, match="would broadcast silently"):
            loss(torch.zeros(4, 1), torch.zeros(4))

    def test_mse_int_label_is_refused_before_it_trains(self):
        # MSELoss promotes an int label in the forward (and HuberLoss fails only in backward): issue 14
        # asks for integer targets to be rejected on the first batch, with the fix.
        with pytest.raises(
            LossInputError, match=re.escape("loss 0 (MSELoss) needs a floating-point label, got label shape (2,) int64")
        ):
            LossSet(nn.MSELoss())(torch.tensor([0.5, 2.0]), torch.tensor([1, 2]))

    @pytest.mark.parametrize("fn", [nn.BCELoss(), nn.BCEWithLogitsLoss()])
    def test_bce_int_label_hint(self, fn):
        with pytest.raises(LossInputError, match=re.escape("use label.float()")) as info:
            LossSet(fn)(torch.rand(4), torch.tensor([0, 1, 1, 0]))
        assert type(fn).__name__ in str(info.value)

    def test_other_errors_have_no_hint(self):
        def broken(pred, label):
            raise ValueError("boom")

        with pytest.raises(
            LossInputError,
            match=re.escape(
                "loss 0 (broken) failed on pred shape (2,) float32 and label shape (2,) int64. Original error: boom"
            ),
        ):
            LossSet(broken)(torch.zeros(2), torch.zeros(2, dtype=torch.long))

    def test_non_tensor_output(self):
        # e.g. a net returning a dict: the error names what the net returned (no dtype hint applies)
        with pytest.raises(
            LossInputError,
            match=re.escape("output 0 of the net is dict {'out': tensor([[0., 0., 0.],")
            + ".*not a tensor; it holds out: use Estimator\\(loss=None\\).*output_key",
        ) as info:
            LossSet(nn.CrossEntropyLoss())({"out": torch.zeros(2, 3)}, torch.zeros(2, dtype=torch.long))
        assert "use label" not in str(info.value)

    @pytest.mark.parametrize(
        "pred,shown,fix",
        [(None, "NoneType None", "forget a return"), ({"out": torch.zeros(2)}, "dict", "loss=None")],
    )
    def test_non_tensor_output_elementwise_loss(self, pred, shown, fix):
        with pytest.raises(LossInputError, match=re.escape(f"output 0 of the net is {shown}") + f".*{re.escape(fix)}"):
            LossSet(nn.MSELoss())(pred, torch.zeros(2))

    def test_error_names_the_failing_loss_index(self):
        loss = LossSet([nn.MSELoss(), nn.CrossEntropyLoss()])
        with pytest.raises(LossInputError, match=re.escape("loss 1 (CrossEntropyLoss) failed")):
            loss((torch.zeros(2), torch.randn(2, 3)), (torch.zeros(2), torch.zeros(2)))

    def test_shape_mismatch_message(self):
        msg = (
            "loss 0 (MSELoss) compares pred and label elementwise, but pred has shape (4, 1) and label (4,), "
            "which would broadcast silently; make them equal (e.g. label.view(4, 1) or squeeze the output)"
        )
        with pytest.raises(LossInputError, match=re.escape(msg)):
            LossSet(nn.MSELoss())(torch.randn(4, 1), torch.randn(4))

    @pytest.mark.parametrize(
        "pred, fix",
        [
            ((4, 10), "nn.functional.one_hot(label, 10).float()"),
            ((4, 10, 5, 5), "nn.functional.one_hot(label, 10).movedim(-1, 1).float()"),  # (N, C, H, W)
        ],
    )
    def test_class_scores_and_class_indices_are_pointed_to_a_classification_loss(self, pred, fix):
        label = torch.randint(0, 10, (pred[0], *pred[2:]))
        msg = (
            f"which would broadcast silently; pred looks like scores of 10 classes (dim 1) and label like class "
            f"indices: use a classification loss such as nn.CrossEntropyLoss, or give one-hot labels ({fix})"
        )
        with pytest.raises(LossInputError, match=re.escape(msg)):
            LossSet(nn.MSELoss())(torch.randn(pred), label)
        one_hot = nn.functional.one_hot(label, 10)
        assert (one_hot.movedim(-1, 1) if len(pred) > 2 else one_hot).shape == pred  # the fix suggested fits

    @pytest.mark.parametrize(
        "pred, label",
        [
            ((4, 10), torch.randn(4)),  # float labels: not class indices
            ((4, 10), torch.zeros(4, dtype=torch.bool)),
            ((4, 3), torch.randn(3, 4)),  # as many values, in another layout: no view suggested
            ((4, 7, 10), torch.randint(0, 10, (4, 7))),  # classes last
        ],
    )
    def test_other_shape_mismatches_ask_for_the_labels_shape(self, pred, label):
        msg = f"which would broadcast silently; the net's output must have the label's shape {tuple(label.shape)}"
        with pytest.raises(LossInputError, match=re.escape(msg)):
            LossSet(nn.MSELoss())(torch.randn(pred), label)

    def test_shape_mismatch_second_loss(self):
        loss = LossSet([nn.CrossEntropyLoss(), nn.L1Loss()])
        preds = (torch.randn(4, 3), torch.randn(4, 2))
        labels = (torch.tensor([0, 1, 2, 0]), torch.randn(4, 1))
        with pytest.raises(
            LossInputError,
            match=re.escape(
                "loss 1 (L1Loss) compares pred and label elementwise, but pred has shape (4, 2) and label (4, 1)"
            ),
        ):
            loss(preds, labels)

    def test_check_first_batch_ok(self):
        loss = LossSet([nn.CrossEntropyLoss(), nn.MSELoss()])
        total, _ = loss((torch.randn(4, 3), torch.randn(4, 2)), (torch.tensor([0, 1, 2, 0]), torch.randn(4, 2)))
        assert loss.check_first_batch(total) is None

    @pytest.mark.parametrize("total,shown", [(torch.zeros(4), "shape (4,) float32"), (1.5, "float 1.5")])
    def test_check_first_batch_non_scalar_total(self, total, shown):
        msg = f"the loss must be a scalar tensor, got {shown}; use reduction='mean' or reduce the loss to a scalar"
        with pytest.raises(LossInputError, match=re.escape(msg)):
            LossSet(nn.MSELoss(reduction="none")).check_first_batch(total)

    def test_errors_are_value_errors(self):
        assert issubclass(LossInputError, FitforgeValueError) and issubclass(FitforgeValueError, ValueError)
        assert issubclass(FitforgeTypeError, TypeError)


def test_optimizer_for_another_net_is_refused():
    other = nn.Linear(1, 1)
    with pytest.raises(FitforgeValueError, match="optimizer holds none of net's parameters"):
        Estimator(nn.Linear(1, 1), nn.MSELoss(), optimizer=torch.optim.SGD(other.parameters(), lr=0.1), device="cpu")
    net = nn.Linear(1, 1)  # a second optimizer for another module (a GAN's discriminator) is fine
    Estimator(
        net,
        nn.MSELoss(),
        optimizer=[torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)],
        device="cpu",
    )


def test_cross_entropy_label_with_a_class_axis_gets_the_squeeze_hint():
    est = Estimator(nn.Linear(5, 3), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    batches = [(torch.randn(4, 5), torch.randint(0, 3, (4, 1)))]
    with pytest.raises(LossInputError, match=re.escape("without the class axis: use label.squeeze(1)")):
        est.fit(batches, epochs=1)


def test_cross_entropy_label_hints_for_int32_and_out_of_range_classes():
    est = Estimator(nn.Linear(5, 2), nn.CrossEntropyLoss(), optimizer="sgd", device="cpu")
    with pytest.raises(
        LossInputError, match=re.escape("class-index labels must be int64, got int32: use label.long()")
    ):
        est.fit([(torch.randn(4, 5), torch.tensor([0, 1, 1, 0], dtype=torch.int32))], epochs=1)
    with pytest.raises(
        LossInputError,
        match=re.escape(
            "labels go up to 2 but the net outputs 2 class scores, so labels "
            "must lie in 0..1: give the last layer 3 outputs"
        ),
    ):
        est.fit([(torch.randn(4, 5), torch.tensor([0, 1, 2, 0]))], epochs=1)


def test_a_list_of_one_loss_behaves_like_the_loss():
    total, parts = LossSet([nn.MSELoss()])(torch.ones(2), torch.zeros(2))
    assert total.item() == 1.0 and parts[0] is total


def test_a_loss_that_returns_a_python_number_is_refused_at_the_first_batch():
    from helpers import regression_batches

    net = nn.Linear(1, 1)
    estimator = Estimator(net, lambda p, y: ((p - y) ** 2).mean().item(), optimizer="sgd", device="cpu")
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(LossInputError, match=r"returned float .*, not a tensor.*\.item\(\), float\(\), numpy"):
        estimator.fit(regression_batches(2), epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # no step was taken

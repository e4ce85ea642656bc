"""``Estimator(activation_checkpointing=Block)``: on a 12-block toy model with dropout, the same losses and
weights bitwise as without it, far fewer activations kept for the backward, ``state_dict`` keys unchanged,
evaluation untouched, and clear errors. Under DDP and FSDP: tests/distributed/test_data_parallel.py."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def toy(blocks=12, width=32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), *[Block(width) for _ in range(blocks)], nn.Linear(width, 3))


def data():
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))


def trained(checkpointing):
    estimator = Estimator(toy(), nn.CrossEntropyLoss(), optimizer="adam", activation_checkpointing=checkpointing)
    torch.manual_seed(2)  # the dropout masks
    history = estimator.fit(data(), val_data=data(), epochs=2)
    return estimator, history


def saved_bytes(net):
    """The bytes of the tensors one training forward keeps for its backward."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        net(torch.randn(16, 8)).sum().backward()
    return total


def test_the_losses_and_weights_are_bitwise_those_without_it_and_fewer_activations_are_kept():
    plain, plain_history = trained(None)
    checkpointed, history = trained(Block)
    assert history["train_loss"] == plain_history["train_loss"] and history["val_loss"] == plain_history["val_loss"]
    for (name, a), b in zip(plain.net.state_dict().items(), checkpointed.net.state_dict().values()):
        assert torch.equal(a, b), name
    assert list(checkpointed.net.state_dict()) == list(plain.net.state_dict())  # keys unchanged
    kept, kept_plain = saved_bytes(checkpointed.net), saved_bytes(plain.net)
    assert kept < kept_plain / 5, (kept, kept_plain)  # 12 blocks keep only their inputs


@pytest.mark.filterwarnings("ignore:.*export_memory_timeline.*:FutureWarning")  # its CUDA-only successor
def test_the_peak_memory_of_a_step_is_lower(tmp_path):
    """Measured on the CPU by torch's profiler (its memory timeline: every live allocation, by time)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    if not hasattr(profile, "export_memory_timeline"):
        pytest.skip("this torch's profiler has no memory timeline")

    def peak(checkpointing, folder):
        net = Estimator(toy(), nn.CrossEntropyLoss(), optimizer="adam", activation_checkpointing=checkpointing).net
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
            net(torch.randn(64, 8)).sum().backward()
        p.export_memory_timeline(str(tmp_path / f"{folder}.json"), device="cpu")
        _, sizes = json.loads((tmp_path / f"{folder}.json").read_text())
        return max(sum(size) for size in sizes)

    plain, checkpointed = peak(None, "plain"), peak(Block, "checkpointed")
    assert checkpointed < 0.75 * plain, (checkpointed, plain)  # measured 931,296 vs 1,552,928 bytes


def test_a_tuple_of_classes_and_a_second_estimator_on_the_same_net():
    net = toy(blocks=2)
    Estimator(net, nn.CrossEntropyLoss(), optimizer="adam", activation_checkpointing=(Block, nn.LayerNorm))
    forward = net[1].forward
    Estimator(net, nn.CrossEntropyLoss(), optimizer="adam", activation_checkpointing=Block)
    assert net[1].forward is forward  # not wrapped twice


@pytest.mark.parametrize(
    ("blocks", "error", "message"),
    [
        ("Block", FitforgeTypeError, r"activation_checkpointing must be a module class .* got str 'Block'"),
        ((), FitforgeTypeError, r"activation_checkpointing must be a module class"),
        (nn.Conv2d, FitforgeValueError, r"the net holds no Conv2d below its root; its module classes: Block, "),
    ],
)
def test_errors_name_what_the_net_holds(blocks, error, message):
    with pytest.raises(error, match=message):
        Estimator(toy(blocks=1), nn.CrossEntropyLoss(), optimizer="adam", activation_checkpointing=blocks)


def test_a_copy_runs_its_own_weights_and_the_net_pickles(tmp_path):
    import copy

    net = toy(blocks=2)
    Estimator(net, nn.CrossEntropyLoss(), optimizer="adam", activation_checkpointing=Block)
    twin = copy.deepcopy(net)
    with torch.no_grad():
        for parameter in twin.parameters():
            parameter.zero_()
    x = torch.randn(4, 8)
    assert torch.equal(twin(x), torch.zeros(4, 3)) and not torch.equal(net(x), twin(x))
    torch.save(net, tmp_path / "net.pt")
    loaded = torch.load(tmp_path / "net.pt", weights_only=False)
    net.eval(), loaded.eval()  # no dropout
    assert torch.equal(loaded(x), net(x))

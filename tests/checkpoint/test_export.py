"""``Estimator.export``: a safetensors file that loads into a fresh net with ``load_file`` and gives the same
outputs (tied weights too), with the weights evaluation uses (an EMA's); a Hugging Face model's
``save_pretrained`` folder that ``from_pretrained`` loads with equal logits; clear errors. Under FSDP on two
ranks: tests/distributed/test_data_parallel.py."""

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import EMAHandler
from fitforge.testing import linear_data

safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="export writes safetensors (the [safetensors] extra)"
)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.embed(tokens)).mean(dim=1)


def test_a_safetensors_file_loads_into_a_fresh_net_with_the_same_outputs(tmp_path):
    torch.manual_seed(0)
    estimator = Estimator(Tied(), nn.CrossEntropyLoss(), optimizer="adam")
    tokens = torch.randint(0, 7, (16, 3))
    estimator.fit([(tokens, tokens[:, 0])], epochs=2)
    path = estimator.export(tmp_path / "out" / "model.safetensors")
    fresh = Tied()
    fresh.load_state_dict(safetensors_torch.load_file(path))  # both keys of the tied weight are in it
    with torch.no_grad():
        assert torch.equal(fresh(tokens), estimator.net(tokens))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.safetensors"]  # no temporary left


def test_the_exported_weights_are_those_evaluation_uses(tmp_path):
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    estimator = Estimator(net, nn.MSELoss(), optimizer="sgd")
    ema = EMAHandler(decay=0.5)
    estimator.fit(linear_data(n=32, batch_size=8), epochs=2, event_handlers=[ema])
    exported = safetensors_torch.load_file(estimator.export(tmp_path / "ema.safetensors"))
    assert torch.equal(exported["weight"], ema.averaged_state_dict()["weight"])
    assert not torch.equal(exported["weight"], net.weight.detach())  # the trained ones stay in the net


def test_a_hugging_face_model_exports_a_folder_from_pretrained_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=17, n_positions=8)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    estimator = Estimator(model, None, optimizer="adamw")
    path = estimator.export(tmp_path / "gpt2", format="hf")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(path)
    tokens = torch.randint(0, 17, (2, 6))
    model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, model(tokens).logits, atol=1e-6)
    assert (path / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"format": "onnx"}, FitforgeValueError, r"format must be one of \('safetensors', 'hf'\), got str 'onnx'"),
        ({"format": "hf"}, FitforgeValueError, r"the net is Linear, which has no save_pretrained: use format="),
        ({"path": 3}, FitforgeTypeError, r"path must be a file or folder path, got int 3"),
        ({"path": "."}, FitforgeValueError, r"is a folder; format='safetensors' writes one file: give its path, e.g. "),
    ],
)
def test_errors_name_the_argument_and_the_fix(tmp_path, arguments, error, message):
    estimator = Estimator(nn.Linear(1, 1), nn.MSELoss(), optimizer="sgd")
    with pytest.raises(error, match=message):
        estimator.export(**{"path": tmp_path / "m.safetensors", **arguments})

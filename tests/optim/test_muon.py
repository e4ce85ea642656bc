"""Muon for the hidden matrices, AdamW for the rest: the routing (embeddings, the head, norms, biases and kernels
keep AdamW; a tied weight once), ``optimizer="muon"``, and a resume at step 10 bitwise equal to the run never
stopped. Two ranks under DDP: tests/distributed/test_muon_ranks.py."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler
from fitforge.optim import muon, muon_routing

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch 2.9+")


class TinyLM(nn.Module):
    """An embedding, a block (attention-like projections, a norm, an MLP), a 1-D convolution and a head."""

    def __init__(self, vocab=11, width=8, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.mix = nn.Conv1d(width, width, kernel_size=3, padding=1)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = self.norm(x + torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v)
        x = x + self.mlp(x)
        x = x + self.mix(x.transpose(1, 2)).transpose(1, 2)
        return self.head(x).mean(dim=1)


def test_the_hidden_matrices_go_to_muon_and_the_rest_to_adamw():
    hidden, rest = muon_routing(TinyLM())
    assert hidden == ["qkv.weight", "mlp.0.weight", "mlp.2.weight"]
    assert rest == ["embed.weight", "norm.weight", "norm.bias", "mlp.0.bias", "mlp.2.bias", "mix.weight", "mix.bias",
                    "head.weight"]  # fmt: skip
    hidden, rest = muon_routing(TinyLM(tied=True))  # the head's weight is the embedding's: once, with AdamW
    assert "head.weight" not in hidden + rest and "embed.weight" in rest and len(hidden) == 3
    hidden, _ = muon_routing(TinyLM(), adamw=["mlp.2", "qkv.weight"])  # a prefix, a parameter's name
    assert hidden == ["mlp.0.weight"]


def test_muon_builds_both_optimizers_over_every_parameter_once():
    net = TinyLM()
    first, second = muon(net, lr=2e-3, weight_decay=0.05)
    assert isinstance(first, torch.optim.Muon) and isinstance(second, torch.optim.AdamW)
    assert first.defaults["adjust_lr_fn"] == "match_rms_adamw" and first.defaults["lr"] == second.defaults["lr"]
    held = [id(p) for opt in (first, second) for group in opt.param_groups for p in group["params"]]
    assert sorted(held) == sorted(id(p) for p in net.parameters())
    assert [type(o) for o in Estimator(TinyLM(), nn.CrossEntropyLoss(), optimizer="muon").optimizers] == [
        torch.optim.Muon,
        torch.optim.AdamW,
    ]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: muon(TinyLM(), adamw=["decoder"]), FitforgeValueError, r"adamw names \['decoder'\], which match no"),
        (lambda: muon(TinyLM(), adamw=[3]), FitforgeTypeError, r"adamw must be parameter names or prefixes"),
        (lambda: muon(nn.Linear(3, 2)), FitforgeValueError, r"no hidden linear layer for Muon .* optimizer='adamw'"),
        (lambda: muon("net"), FitforgeTypeError, r"net must be a torch.nn.Module, got str"),
        (
            lambda: Estimator(TinyLM(), nn.CrossEntropyLoss(), optimizer="muonx"),
            FitforgeValueError,
            r"known: adam, adamw, sgd, rmsprop, adagrad, muon",
        ),
    ],
)
def test_errors_name_the_argument_and_the_fix(call, error, message):
    with pytest.raises(error, match=message):
        call()


def data():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (64, 5), generator=generator)
    return DataLoader(TensorDataset(tokens, tokens[:, 0]), batch_size=4, shuffle=True)  # 16 batches an epoch


def fit(folder, batches, resume=False):
    torch.manual_seed(0)
    estimator = Estimator(TinyLM(), nn.CrossEntropyLoss(), optimizer="muon")
    saver = CheckpointHandler(folder, batch_period=5, resume_from_checkpoint=resume)
    history = estimator.fit(data(), batches=batches, event_handlers=[saver])
    return estimator, history


def test_it_learns():
    torch.manual_seed(0)
    net = TinyLM()
    history = Estimator(net, nn.CrossEntropyLoss(), optimizer=muon(net, lr=1e-2)).fit(data(), epochs=4)
    assert history["train_loss"][-1] < 0.8 * history["train_loss"][0]


def test_a_resume_at_step_10_is_bitwise_the_uninterrupted_run(tmp_path):
    whole, _ = fit(tmp_path / "whole", 20)
    fit(tmp_path / "cut", 10)
    resumed, _ = fit(tmp_path / "cut", 20, resume=True)
    for (name, a), b in zip(whole.net.state_dict().items(), resumed.net.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(whole.optimizers, resumed.optimizers):
        assert str(a.state_dict()) == str(b.state_dict())


def test_only_linear_layers_weights_go_to_muon_and_norms_and_biases_are_not_decayed():
    class WithPositions(TinyLM):
        def __init__(self):
            super().__init__()
            self.positions = nn.Parameter(torch.zeros(5, 8))  # a 2-D parameter, not a linear layer's

    hidden, rest = muon_routing(WithPositions())
    assert "positions" in rest and "positions" not in hidden
    _, adamw = muon(TinyLM())
    decayed, plain = adamw.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.ndim >= 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.ndim < 2 for p in plain["params"])


def test_gpt2s_conv1d_projections_go_to_muon():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=20, n_positions=8)
    hidden, rest = muon_routing(transformers.GPT2LMHeadModel(config))
    assert hidden == [
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight",
    ]
    assert "transformer.wte.weight" in rest and "transformer.wpe.weight" in rest  # the head is tied to wte

"""Estimator.load_weights: safetensors (a file, or a Hugging Face folder whole or sharded) into the net, a net
built on the meta device included; the errors of a file that does not fit. Under FSDP on 2 ranks:
tests/distributed/test_load_weights_ranks.py."""

import logging

import pytest
import torch
from torch import nn

from fitforge import Estimator
from fitforge.checkpoint.load_weights import refuse_meta
from fitforge.exceptions import DeviceMismatchError, FitforgeTypeError, FitforgeValueError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="load_weights reads safetensors")

CONFIG = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 64, "n_positions": 16}


def gpt2(meta=False, seed=0):
    config = transformers.GPT2Config(**CONFIG, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return transformers.GPT2LMHeadModel(config).eval()


def logits(net):
    tokens = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        return net(tokens).logits


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pretrained")
    model = gpt2(seed=3)
    model.save_pretrained(folder / "whole")
    model.save_pretrained(folder / "sharded", max_shard_size="20KB")  # several files and their index
    model.to(torch.bfloat16).save_pretrained(folder / "bf16")
    return folder, gpt2(seed=3)


def test_a_net_built_on_the_meta_device_loads_a_hugging_face_folder_and_keeps_its_tied_weights(pretrained):
    folder, model = pretrained
    assert len(list((folder / "sharded").glob("*.safetensors"))) > 1
    for name in ("whole", "sharded"):
        estimator = Estimator(gpt2(meta=True), None, optimizer="adamw", device="cpu")
        estimator.load_weights(folder / name)
        net = estimator.net
        assert not any(tensor.is_meta for tensor in net.state_dict().values())
        assert torch.equal(logits(net), logits(model))
        assert net.lm_head.weight is net.transformer.wte.weight  # still one tensor
        assert estimator.optimizer.param_groups[0]["params"][0] is net.transformer.wte.weight


def test_the_loaded_net_trains_and_a_file_of_another_dtype_is_cast(pretrained):
    folder, model = pretrained
    estimator = Estimator(gpt2(meta=True), None, optimizer="adamw", device="cpu")
    estimator.load_weights(folder / "bf16")
    expected = model.transformer.h[0].mlp.c_fc.weight.to(torch.bfloat16).float()
    assert estimator.net.transformer.h[0].mlp.c_fc.weight.dtype == torch.float32
    assert torch.equal(estimator.net.transformer.h[0].mlp.c_fc.weight, expected)
    before = estimator.net.transformer.wte.weight.clone()
    tokens = torch.arange(24).reshape(4, 6)
    estimator.fit([{"input_ids": tokens, "labels": tokens}], epochs=1, default_handlers=False)
    assert not torch.equal(estimator.net.transformer.wte.weight, before)


def test_one_file_loads_into_a_plain_net_beside_other_files(tmp_path):
    source = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    source[1].running_mean.fill_(0.5)
    safetensors_torch.save_file(source.state_dict(), tmp_path / "a.safetensors")
    safetensors_torch.save_file({"other": torch.zeros(1)}, tmp_path / "b.safetensors")
    estimator = Estimator(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), nn.MSELoss(), device="cpu")
    estimator.load_weights(tmp_path / "a.safetensors")
    for name, value in source.state_dict().items():
        assert torch.equal(estimator.net.state_dict()[name], value), name


def test_a_file_that_does_not_fit_is_refused_by_name_and_strict_false_loads_the_rest(tmp_path, caplog):
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file({"0.weight": torch.ones(4, 3), "extra": torch.zeros(2)}, path)
    estimator = Estimator(nn.Sequential(nn.Linear(3, 4)), nn.MSELoss(), device="cpu")
    with pytest.raises(FitforgeValueError, match=r"missing 0\.bias; unexpected extra\. Pass strict=False"):
        estimator.load_weights(path)
    bias = estimator.net[0].bias.clone()
    with caplog.at_level(logging.INFO, logger="fitforge"):
        estimator.load_weights(path, strict=False)
    assert torch.equal(estimator.net[0].weight, torch.ones(4, 3))
    assert torch.equal(estimator.net[0].bias, bias)
    assert "kept the net's own 0.bias; ignored the file's extra" in caplog.text

    safetensors_torch.save_file({"0.weight": torch.ones(3, 3), "0.bias": torch.ones(4)}, path)
    with pytest.raises(FitforgeValueError, match=r"shapes differ: 0\.weight \(3, 3\) in the file, \(4, 3\) in the net"):
        estimator.load_weights(path, strict=False)


def test_a_meta_net_must_get_every_value_and_cannot_train_before(tmp_path):
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    estimator = Estimator(net, nn.MSELoss(), device="cpu")
    meta_refused = r"parameter '0\.weight' of net is on the meta device.*load_weights\(path\)"
    for call in (
        lambda: estimator.fit([(torch.ones(2, 3), torch.ones(2, 1))], epochs=1),
        lambda: estimator.export(tmp_path / "out.safetensors"),
        lambda: estimator.load_checkpoint(tmp_path / "model.pt"),
    ):
        with pytest.raises(DeviceMismatchError, match=meta_refused):
            call()
    with pytest.raises(DeviceMismatchError, match=meta_refused):
        refuse_meta(net, "net")  # what fit checks under FSDP, which places the shards itself
    path = tmp_path / "half.safetensors"
    safetensors_torch.save_file({"0.weight": torch.ones(4, 3), "0.bias": torch.ones(4)}, path)
    with pytest.raises(FitforgeValueError, match=r"lacks 1\.weight, 1\.bias, which the net built on the meta device"):
        estimator.load_weights(path, strict=False)

    class Rotary(nn.Module):  # a buffer no file holds
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)
            self.register_buffer("frequencies", torch.ones(2), persistent=False)

    with torch.device("meta"):
        rotary = Rotary()
    safetensors_torch.save_file({"linear.weight": torch.ones(2, 2), "linear.bias": torch.ones(2)}, path)
    with pytest.raises(FitforgeValueError, match=r"buffers frequencies are saved in no file.*init_empty_weights"):
        Estimator(rotary, nn.MSELoss(), device="cpu").load_weights(path)


def test_paths_that_hold_no_safetensors_are_refused(tmp_path):
    estimator = Estimator(nn.Linear(2, 1), nn.MSELoss(), device="cpu")
    with pytest.raises(FileNotFoundError, match="no safetensors file or folder"):
        estimator.load_weights(tmp_path / "nothing.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors file in the folder"):
        estimator.load_weights(tmp_path)
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(FitforgeValueError, match=r"reads safetensors files.*load_checkpoint"):
        estimator.load_weights(tmp_path / "model.pt")
    with pytest.raises(FitforgeTypeError, match="path must be"):
        estimator.load_weights(3)


def test_ddp_refuses_a_net_on_the_meta_device():
    from fitforge.distributed.ddp import wrap_ddp

    with torch.device("meta"):
        net = nn.Linear(2, 1)
    with pytest.raises(FitforgeValueError, match=r"strategy='ddp' copies rank 0's weights.*strategy='fsdp'"):
        wrap_ddp(net, torch.device("cpu"), {})


def test_a_folder_reads_the_files_its_index_names_and_refuses_a_name_in_two_files(pretrained, tmp_path):
    folder, model = pretrained
    stray = {name: value + 1 for name, value in model.state_dict().items() if name != "lm_head.weight"}
    for name in ("sharded", "whole"):
        copy = tmp_path / name
        copy.mkdir()
        for file in (folder / name).iterdir():
            (copy / file.name).write_bytes(file.read_bytes())
        safetensors_torch.save_file(stray, copy / "old-model.safetensors")
    estimator = Estimator(gpt2(meta=True), None, optimizer="adamw", device="cpu")
    estimator.load_weights(tmp_path / "sharded")  # its index names its shards, not old-model.safetensors
    assert torch.equal(logits(estimator.net), logits(model))
    estimator.load_weights(tmp_path / "sharded" / "model.safetensors.index.json")
    with pytest.raises(FitforgeValueError, match=r"are in two files of the folder"):
        estimator.load_weights(tmp_path / "whole")


def test_a_meta_net_gets_the_estimator_placement_and_the_last_fit_average_is_dropped(tmp_path, caplog):
    from fitforge.handlers import EMAHandler

    source = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 1))
    path = tmp_path / "conv.safetensors"
    safetensors_torch.save_file(source.state_dict(), path)
    with torch.device("meta"):
        net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 1))
    estimator = Estimator(net, nn.MSELoss(), optimizer="sgd", device="cpu", channels_last=True)
    estimator.load_weights(path)
    assert estimator.net[0].weight.is_contiguous(memory_format=torch.channels_last)
    batches = [(torch.randn(4, 1, 4, 4), torch.randn(4, 1))]
    estimator.fit(batches, epochs=2, event_handlers=[EMAHandler(decay=0.5)])
    with caplog.at_level(logging.INFO, logger="fitforge"):
        estimator.load_weights(path)
    assert estimator.weight_average is None and "not the last fit's average" in caplog.text
    assert torch.equal(estimator.predict(batches[0][0]), source(batches[0][0]))

    with torch.device("meta"):
        other = nn.Linear(2, 1)
    with pytest.raises(FitforgeValueError, match="val_net is on the meta device, and load_weights loads net only"):
        Estimator(nn.Linear(2, 1), nn.MSELoss(), val_net=other, device="cpu")

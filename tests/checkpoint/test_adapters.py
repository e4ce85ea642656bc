"""LoRA (``peft``) on a tiny GPT-2 built from a config (no download): checkpoints hold the adapter and its
optimizer state, not the frozen base (within 1.2x of those two); a resume is bitwise, after a kill -9 too
(adapter_trainer.py); the exported adapter loads
with ``PeftModel.from_pretrained`` and gives the same logits; a resume onto another base is refused by name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fitforge import Estimator
from fitforge.checkpoint.adapters import base_of, weights_fingerprint
from fitforge.exceptions import CheckpointError, FitforgeValueError
from fitforge.handlers import CheckpointHandler
from helpers import checkpoint_files

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="LoRA needs peft (pip install peft)")


def lora_gpt2(base_seed=0):
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=128, vocab_size=500, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(base_seed)  # the "pretrained" base
    base = transformers.GPT2LMHeadModel(config)
    torch.manual_seed(1)  # the adapter's initialisation
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    return peft.get_peft_model(base, lora)


def batches():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 500, (48, 16), generator=generator)
    return [{"input_ids": tokens[i : i + 4], "labels": tokens[i : i + 4]} for i in range(0, 48, 4)]  # 12 batches


def fit(folder, batches_to_train, resume=False, base_seed=0):
    model = lora_gpt2(base_seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    estimator = Estimator(model, None, optimizer=torch.optim.AdamW(trainable, lr=1e-3), device="cpu")
    saver = CheckpointHandler(folder, batch_period=6, resume_from_checkpoint=resume)
    estimator.fit(batches(), batches=batches_to_train, event_handlers=[saver], default_handlers=False)
    return estimator, saver


def test_the_checkpoint_holds_the_adapter_and_its_optimizer_state_not_the_base(tmp_path):
    estimator, _ = fit(tmp_path, 6)
    (name,) = checkpoint_files(tmp_path)
    saved = torch.load(tmp_path / name, weights_only=False)
    trainable = {n for n, p in estimator.net.named_parameters() if p.requires_grad}
    assert set(saved["model"]) == trainable and all("lora_" in key for key in trainable)
    adapter = sum(p.numel() * 4 for p in estimator.net.parameters() if p.requires_grad)
    size = (tmp_path / name).stat().st_size
    assert size <= 1.2 * 3 * adapter, (size, adapter)  # the weights and AdamW's two moments (rng, history: 20 kB)
    assert saved["frozen_base"] == base_of(estimator.net)


def test_a_resume_is_bitwise_and_another_base_is_refused(tmp_path):
    whole, _ = fit(tmp_path / "whole", 12)
    fit(tmp_path / "cut", 6)
    resumed, _ = fit(tmp_path / "cut", 12, resume=True)
    for (key, a), b in zip(whole.net.state_dict().items(), resumed.net.state_dict().values()):
        assert torch.equal(a, b), key
    with pytest.raises(CheckpointError, match=r"an adapter trained on another base model: .* same pretrained base"):
        fit(tmp_path / "cut", 18, resume=True, base_seed=5)


def test_the_exported_adapter_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    estimator, _ = fit(tmp_path / "run", 6)
    folder = estimator.export(tmp_path / "adapter", format="hf")
    assert (folder / "adapter_model.safetensors").is_file() and (folder / "adapter_config.json").is_file()
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=128, vocab_size=500, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    loaded = peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel(config), folder)
    tokens = batches()[0]["input_ids"]
    estimator.net.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=tokens).logits, estimator.net(input_ids=tokens).logits, atol=1e-6)


def test_the_fingerprint_changes_with_one_bit():
    weights = [torch.randn(3, 4), torch.randn(5)]
    flipped = weights[0].clone()
    flipped.view(torch.int32)[0, 0] ^= 1
    assert weights_fingerprint(weights) != weights_fingerprint([flipped, weights[1]])
    assert weights_fingerprint(weights) != weights_fingerprint(weights[::-1])


@pytest.mark.integration  # its own processes
def test_a_run_killed_with_sigkill_resumes_bitwise(tmp_path):
    trainer = Path(__file__).with_name("adapter_trainer.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}

    def run(folder, out, *kill_at):
        command = [sys.executable, str(trainer), str(folder), str(out), *map(str, kill_at)]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)

    whole = run(tmp_path / "whole", tmp_path / "whole.pt")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = run(tmp_path / "run", tmp_path / "killed.pt", 16)  # in epoch 2, a batch after a save
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run(tmp_path / "run", tmp_path / "resumed.pt")
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr[-3000:]
    want, got = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_load_refused_for_its_base_succeeds_once_the_right_base_is_loaded(tmp_path):
    fit(tmp_path, 6)
    (name,) = checkpoint_files(tmp_path)
    other = lora_gpt2(base_seed=5)
    estimator = Estimator(other, None, optimizer="adamw", device="cpu")
    with pytest.raises(CheckpointError, match="another base model"):
        estimator.load_checkpoint(tmp_path / name, optimizers=False)
    right = lora_gpt2(base_seed=0).state_dict()
    other.load_state_dict({k: v for k, v in right.items() if "lora_" not in k}, strict=False)
    estimator.load_checkpoint(tmp_path / name, optimizers=False)  # the fingerprint is computed again at each load


def test_a_transposed_matrix_changes_the_fingerprint_and_a_peft_model_exports_only_as_hf(tmp_path):
    square = torch.randn(4, 4)
    assert weights_fingerprint([square]) != weights_fingerprint([square.t().contiguous()])
    estimator = Estimator(lora_gpt2(), None, optimizer="adamw", device="cpu")
    with pytest.raises(FitforgeValueError, match=r"the net is a peft model: format='hf' writes its adapter"):
        estimator.export(tmp_path / "m.safetensors")

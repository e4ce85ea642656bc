"""``python -m fitforge`` in fresh processes, as a user runs it: fit from a YAML config then evaluate
its checkpoint; a config error's exit status and message; a run killed after epoch 2 resumed from
its checkpoint's config alone, ending equal to an uninterrupted run. The ``fitforge`` console script
imports the current folder's modules as ``python -m`` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from configs import write_config

from fitforge.checkpoint.files import load_checkpoint
from helpers import checkpoint_files

pytestmark = pytest.mark.integration  # each process imports torch and jsonargparse: seconds

HERE = Path(__file__).resolve().parent  # tiny_run lives here


def fitforge(folder: Path, *arguments: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m fitforge ARGUMENTS`` in ``folder``, with this folder importable (and the
    PYTHONPATH this test runs with, which may name the fitforge under test)."""
    path = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    environment = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "fitforge", *arguments],
        cwd=folder,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_fit_from_a_yaml_config_then_evaluate_its_checkpoint(tmp_path):
    config = write_config(tmp_path)
    trained = fitforge(tmp_path, "fit", "--config", str(config), "--fit.epochs", "2")
    assert trained.returncode == 0, trained.stderr
    assert "[Epoch 2/2]" in trained.stderr and "Epoch 3" not in trained.stderr  # the override, in the log
    checkpoint = tmp_path / "ckpt" / "model-epoch2batch8.pt"
    saved = load_checkpoint(checkpoint)
    assert saved["config"]["fit"]["epochs"] == 2 and saved["config"]["model"]["init_args"]["hidden"] == 8
    evaluated = fitforge(tmp_path, "evaluate", "--config", str(config), "--checkpoint", str(checkpoint))
    assert evaluated.returncode == 0, evaluated.stderr
    metrics = json.loads(evaluated.stdout)
    assert metrics["val_loss"] == pytest.approx(saved["history"]["columns"]["val_loss"][-1], rel=1e-6)


def test_a_config_error_exits_with_status_2_and_the_nearest_key(tmp_path):
    config = write_config(tmp_path, fit={"epoch": 3})
    failed = fitforge(tmp_path, "fit", "--config", str(config), FITFORGE_TEST_BUILT_MARKER=str(tmp_path / "built"))
    assert failed.returncode == 2
    assert "'fit.epoch' is not accepted (did you mean 'fit.epochs'?)" in failed.stderr
    assert "Traceback" not in failed.stderr and not (tmp_path / "built").exists()


def test_print_config_in_a_process(tmp_path):
    config = write_config(tmp_path)
    printed = fitforge(tmp_path, "fit", "--config", str(config), "--print_config")
    assert printed.returncode == 0, printed.stderr
    assert "class_path: tiny_run.TinyNet" in printed.stdout and "  epochs: 3" in printed.stdout


def test_a_killed_run_resumed_from_its_checkpoints_config_alone_ends_as_an_uninterrupted_one(tmp_path):
    crash = {"class_path": "tiny_run.CrashAfter", "init_args": {"epochs": 2}}
    handlers = [{"class_path": "fitforge.handlers.CheckpointHandler", "init_args": {"model_dir": "ckpt"}}, crash]
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    for folder in (killed, whole):
        folder.mkdir()
        write_config(folder, handlers=handlers, fit={"epochs": 4})
    first = fitforge(killed, "fit", "--config", "cfg.yaml", FITFORGE_TEST_CRASH="1")
    assert first.returncode == 3, first.stderr  # CrashAfter ended the process after epoch 2's checkpoint
    assert checkpoint_files(killed / "ckpt") == [
        "model-epoch1batch4.pt",
        "model-epoch2batch8.pt",
    ]
    (killed / "cfg.yaml").unlink()  # the checkpoint's config alone
    resumed = fitforge(killed, "fit", "--from_checkpoint", "ckpt/model-epoch2batch8.pt")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed after 2 epochs" in resumed.stderr
    uninterrupted = fitforge(whole, "fit", "--config", "cfg.yaml")
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    a, b = (load_checkpoint(folder / "ckpt" / "model-epoch4batch16.pt") for folder in (killed, whole))
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][key], b["model"][key]) for key in a["model"])
    assert a["history"]["columns"]["train_loss"] == b["history"]["columns"]["train_loss"]
    assert a["config"] == b["config"]  # recorded as given: resume_from_checkpoint stays False


def test_the_console_script_imports_a_module_of_the_current_folder_and_names_one_it_cannot(tmp_path):
    script = Path(sys.executable).parent / "fitforge"
    if not script.exists():
        pytest.skip("the fitforge console script is not installed beside this interpreter")
    (tmp_path / "my_module.py").write_text((HERE / "tiny_run.py").read_text())  # in the folder, not on any path
    data = {"function": "my_module.line_data", "args": {"n": 64}}
    model = {"class_path": "my_module.TinyNet", "init_args": {"hidden": 8}}
    config = write_config(tmp_path, model=model, data=data, fit={"epochs": 1})
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}  # a PYTHONPATH naming the fitforge under test stays

    def console(*arguments):
        return subprocess.run(
            [str(script), *arguments], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
        )

    trained = console("fit", "--config", str(config))
    assert trained.returncode == 0, trained.stderr
    assert (tmp_path / "ckpt" / "model-epoch1batch4.pt").is_file()
    misspelt = write_config(tmp_path, "bad.yaml", model={**model, "class_path": "my_modle.TinyNet"}, data=data)
    failed = console("fit", "--config", str(misspelt))
    assert failed.returncode == 2
    error = [line for line in failed.stderr.splitlines() if line.strip()]
    assert len(error) == 1 and error[0].startswith("error: fitforge fit: cannot import 'my_modle.TinyNet'")
    assert f"no module named 'my_modle' in the current folder ({tmp_path})" in error[0]

"""fitforge.cli in-process: fit, evaluate and predict from a YAML config, overrides, --print_config,
config errors found before anything is built (with the nearest key), and the resolved config
recorded in the checkpoint, CSV's params.json and MLflow's params."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from configs import BASE, write_config

from fitforge.checkpoint.files import load_checkpoint
from fitforge.cli import main, recorded_config, run
from fitforge.exceptions import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:mlflow")


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """Run in tmp_path; the file TinyNet writes when it is built (so a test proves it was not)."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "built"
    monkeypatch.setenv("FITFORGE_TEST_BUILT_MARKER", str(path))
    return path


def test_fit_from_a_yaml_config_trains_checkpoints_and_records_the_config(tmp_path, marker):
    config = write_config(tmp_path)
    history = run(["fit", "--config", str(config)])
    assert history.epochs == 3 and history["train_loss"][-1] < 0.05 * history["train_loss"][0]
    checkpoint = tmp_path / "ckpt" / "model-epoch3batch12.pt"
    recorded = recorded_config(checkpoint)
    assert recorded["model"] == {"class_path": "tiny_run.TinyNet", "init_args": {"hidden": 8, "in_features": 1}}
    assert recorded["data"] == {"function": "tiny_run.line_data", "args": {"n": 64, "batch_size": 16, "shuffle": True}}
    assert recorded["fit"]["epochs"] == 3 and recorded["seed"] == 0
    assert set(recorded) == {"seed", "model", "data", "estimator", "fit", "handlers"}
    params = json.loads((tmp_path / "log.params.json").read_text())
    assert params["config.model.init_args.hidden"] == 8
    assert params["config.estimator.optimizer.init_args.lr"] == 0.1
    assert params["config.handlers.0.init_args.model_dir"] == "ckpt"


def test_a_command_line_value_overrides_the_config(tmp_path, marker):
    config = write_config(tmp_path)
    history = run(["fit", "--config", str(config), "--fit.epochs", "2", "--model.init_args.hidden", "3"])
    assert history.epochs == 2
    recorded = recorded_config(tmp_path / "ckpt" / "model-epoch2batch8.pt")
    assert recorded["fit"]["epochs"] == 2 and recorded["model"]["init_args"]["hidden"] == 3


def test_print_config_prints_the_whole_resolved_config_and_builds_nothing(tmp_path, marker, capsys):
    config = write_config(tmp_path)
    resolved = run(["fit", "--config", str(config), "--fit.epochs", "5", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert {key: printed[key] for key in resolved} == resolved
    assert printed["fit"]["epochs"] == 5 and printed["fit"]["batches"] is None
    assert printed["data"]["args"] == {"n": 64, "batch_size": 16, "shuffle": True}  # the function's defaults too
    assert printed["handlers"][0]["init_args"]["max_checkpoints"] == 5
    assert "config" not in printed and "print_config" not in printed
    assert not marker.exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--fit.epoch", "3"], r"'fit\.epoch' is not accepted \(did you mean 'fit\.epochs'\?\); expected one of: fit"),
        (["--config", "{fitt: {epochs: 3}}"], r"'fitt\.epochs' is not accepted \(did you mean 'fit\.epochs'\?\)"),
        (["--model.init_args.hiden", "3"], r"'hiden' of tiny_run\.TinyNet .* \(did you mean 'hidden'\?\); it takes"),
        (["--data.args.nn", "3"], r"'data\.args\.nn' is not accepted \(did you mean 'data\.args\.n'\?\)"),
        (
            ["--estimator.optimizer", "{class_path: torch.optim.SGD, init_args: {lrr: 1}}"],
            r"'lrr' of torch\.optim\.SGD \(under 'estimator\.optimizer'\) .* \(did you mean 'lr'\?\)",
        ),
        (
            ["--config", "{handlers: [{class_path: fitforge.handlers.CSVLoggerHandler, init_args: {pth: a.csv}}]}"],
            r"'pth' of fitforge\.handlers\.CSVLoggerHandler \(under 'handlers'\) .* \(did you mean 'path'\?\)",
        ),
    ],
)
def test_a_misspelt_key_fails_before_anything_is_built_naming_the_nearest(tmp_path, marker, arguments, expected):
    config = write_config(tmp_path)
    with pytest.raises(ConfigError, match=expected):
        run(["fit", "--config", str(config), *arguments])
    assert not marker.exists()


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--fit.epochs", "three"], r"the config's fit\.epochs = 'three' is not valid; it takes an int or null"),
        (["--data.args.n", "many"], r"the config's data\.args\.n = 'many' is not valid; it takes an int\."),
        (
            ["--estimator.optimizer", "adamm"],
            r"optimizer = 'adamm' is not valid \(did you mean 'adam'\?\); it takes one of adam",
        ),
        (["--estimator.train_metrics", "[msee]"], r"train_metrics = 'msee' is not valid \(did you mean 'mse'\?\)"),
    ],
)
def test_a_wrong_type_fails_before_anything_is_built_naming_key_and_type(tmp_path, marker, arguments, expected):
    config = write_config(tmp_path)
    with pytest.raises(ConfigError, match=f"(?s){expected}"):
        run(["fit", "--config", str(config), *arguments])
    assert not marker.exists()


def test_main_prints_a_config_error_and_returns_2(tmp_path, marker, capsys):
    config = write_config(tmp_path, fit={"epoch": 3})
    assert main(["fit", "--config", str(config)]) == 2
    assert "did you mean 'fit.epochs'?" in capsys.readouterr().err
    assert not marker.exists()


def test_evaluate_and_predict_a_checkpoint(tmp_path, marker, capsys):
    config = write_config(tmp_path)
    history = run(["fit", "--config", str(config)])
    checkpoint = str(tmp_path / "ckpt" / "model-epoch3batch12.pt")
    capsys.readouterr()
    metrics = run(["evaluate", "--config", str(config), "--checkpoint", checkpoint, "--output", "out/metrics.json"])
    assert metrics["val_loss"] == pytest.approx(history["val_loss"][-1], rel=1e-6)
    assert json.loads(capsys.readouterr().out) == metrics == json.loads((tmp_path / "out/metrics.json").read_text())
    test = run(["evaluate", "--config", str(config), "--checkpoint", checkpoint, "--split", "test"])
    assert test["test_loss"] == pytest.approx(metrics["val_loss"])
    predictions = run(["predict", "--config", str(config), "--checkpoint", checkpoint, "--output", "out/preds.pt"])
    assert predictions.shape == (32, 1)
    assert torch.equal(torch.load(tmp_path / "out/preds.pt", weights_only=True), predictions)


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--fit.epochs", "three"], "the config's fit.epochs = 'three' is not valid; it takes an int or null"),
        (
            ["--estimator.optimizer.init_args.lr", "fast"],
            "the config's estimator.optimizer.init_args.lr = 'fast' is not valid; it takes a float.",
        ),
        (
            ["--estimator.train_metrics", "[acuracy]"],
            "the config's estimator.train_metrics = 'acuracy' is not valid (did you mean 'accuracy'?); it takes one of",
        ),
        (["--estimator.optimizer", "adamm"], "estimator.optimizer = 'adamm' is not valid (did you mean 'adam'?)"),
        (
            ["--model.init_args.hidden", "eight"],
            "the config's model.init_args.hidden = 'eight' is not valid; it takes an int.",
        ),
        (
            ["--estimator.loss", "{class_path: torch.nn.CrossEntropyLoss, init_args: {label_smoothing: lots}}"],
            "the config's estimator.loss.init_args.label_smoothing = 'lots' is not valid; it takes a float.",
        ),
        (
            ["--estimator.loss", "torch.nn.MSELos"],
            "estimator.loss = 'torch.nn.MSELos' does not fit: module 'torch.nn' has no attribute 'MSELos' "
            "(did you mean 'torch.nn.MSELoss'?)",
        ),
        (
            ["--model", "tiny_run.line_data"],
            "model = 'tiny_run.line_data' is not valid; it takes the class_path of a Module",
        ),
    ],
)
def test_a_wrong_value_on_the_command_line_is_one_line_with_the_nearest_choice(
    tmp_path, marker, capsys, arguments, expected
):
    config = write_config(tmp_path)
    assert main(["fit", "--config", str(config), *arguments]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and err[0].endswith("Nothing was built")
    assert not marker.exists()


@pytest.mark.integration  # fresh interpreters, to see what they import
def test_a_torchmetrics_metric_in_the_config_is_parsed_and_trains_with_torchmetrics_imported_only_then(
    tmp_path, marker
):
    code = (
        "import sys; from fitforge.cli.commands import _parsed; "
        "_parsed(['fit', '--config', sys.argv[1]]); print('torchmetrics' in sys.modules)"
    )
    estimator = {**BASE["estimator"], "train_metrics": ["mse"]}
    lean = write_config(tmp_path, "lean.yaml", estimator=estimator)
    metric = {"class_path": "torchmetrics.regression.MeanSquaredError"}
    rich = write_config(tmp_path, "rich.yaml", estimator={**estimator, "train_metrics": [metric]}, fit={"epochs": 1})
    for config, imported in ((lean, "False"), (rich, "True")):
        here = str(Path(__file__).parent)  # tiny_run
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(
            [sys.executable, "-c", code, str(config)], capture_output=True, text=True, cwd=tmp_path, env=env
        )
        assert done.stdout.strip() == imported, done.stderr
    history = run(["fit", "--config", str(rich)])
    assert history["train_mean_squared_error"][0] > 0


def test_a_second_run_into_the_same_folder_names_from_checkpoint_once(tmp_path, marker, capsys):
    config = write_config(tmp_path)
    assert main(["fit", "--config", str(config)]) == 0
    capsys.readouterr()
    assert main(["fit", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "--from_checkpoint ckpt/model-epoch3batch12.pt" in err and "resume_from_checkpoint" not in err
    assert err.count("earlier run") == 1  # the run's closing line names the error's type only
    assert "overwrite: true in the CheckpointHandler's init_args" in err


def test_predict_reads_the_inputs_of_a_data_function_returning_arrays(tmp_path, marker):
    from tiny_run import TinyNet, array_data

    from fitforge import Estimator

    data = {"function": "tiny_run.array_data", "args": {"n": 64}}
    config = write_config(tmp_path, data=data, fit={"epochs": 2, "batch_size": 16})
    run(["fit", "--config", str(config)])
    checkpoint = str(tmp_path / "ckpt" / "model-epoch2batch8.pt")
    predictions = run(["predict", "--config", str(config), "--checkpoint", checkpoint, "--output", "preds.pt"])
    estimator = Estimator(TinyNet(hidden=8), torch.nn.MSELoss(), device="cpu", optimizer="sgd")
    estimator.load_checkpoint(checkpoint, optimizers=False)
    x_val, _ = array_data()["val_data"]
    assert torch.equal(predictions, estimator.predict(x_val, batch_size=16))
    assert torch.equal(torch.load(tmp_path / "preds.pt", weights_only=True), predictions)


def test_evaluate_and_predict_a_checkpoint_alone_with_the_config_it_recorded(tmp_path, marker, monkeypatch):
    config = write_config(tmp_path)
    history = run(["fit", "--config", str(config)])
    checkpoint = str(tmp_path / "ckpt" / "model-epoch3batch12.pt")
    config.unlink()  # the checkpoint alone: its run's config is recorded in it
    metrics = run(["evaluate", "--checkpoint", checkpoint])
    assert metrics["val_loss"] == pytest.approx(history["val_loss"][-1], rel=1e-6)
    test = run(["evaluate", f"--checkpoint={checkpoint}", "--split", "test"])  # options still apply
    assert test["test_loss"] == pytest.approx(metrics["val_loss"])
    predictions = run(["predict", "--checkpoint", checkpoint, "--output", "preds.pt"])
    assert predictions.shape == (32, 1)


def test_a_checkpoint_without_a_recorded_config_still_needs_one(tmp_path, marker):
    from fitforge.handlers import CheckpointHandler
    from fitforge.testing import linear_problem

    estimator, data, _ = linear_problem()
    estimator.fit(data, epochs=1, event_handlers=[CheckpointHandler(tmp_path / "plain")])
    checkpoint = str(next((tmp_path / "plain").glob("*.pt")))
    with pytest.raises(ConfigError, match=r"arguments are required: .*evaluate\.estimator\.loss, evaluate\.model"):
        run(["evaluate", "--checkpoint", checkpoint])


def test_a_missing_checkpoint_fails_before_anything_is_built(tmp_path, marker):
    config = write_config(tmp_path)
    with pytest.raises(ConfigError, match=r"fitforge evaluate: --checkpoint nope\.pt: no such file; nothing was built"):
        run(["evaluate", "--config", str(config), "--checkpoint", "nope.pt"])
    assert not marker.exists()


def test_a_split_the_data_function_does_not_return_is_named(tmp_path, marker):
    config = write_config(tmp_path)
    run(["fit", "--config", str(config), "--fit.epochs", "1"])
    checkpoint = str(tmp_path / "ckpt" / "model-epoch1batch4.pt")
    with pytest.raises(ConfigError, match=r"reads predict_data \(--split predict\).* returned train_data, val_data"):
        run(["predict", "--config", str(config), "--checkpoint", checkpoint, "--output", "p.pt", "--split", "predict"])


def test_a_data_function_returning_another_key_is_told_the_nearest(tmp_path, marker):
    config = write_config(tmp_path, data={"function": "tiny_run.misnamed_data"})
    with pytest.raises(ConfigError, match=r"key 'val_dat' \(did you mean 'val_data'\?\); its keys must be among"):
        run(["fit", "--config", str(config)])


def test_a_config_without_seed_records_the_one_drawn(tmp_path, marker):
    config = write_config(tmp_path, seed=None)
    run(["fit", "--config", str(config), "--fit.epochs", "1"])
    seed = recorded_config(tmp_path / "ckpt" / "model-epoch1batch4.pt")["seed"]
    assert isinstance(seed, int) and not isinstance(seed, bool)


def test_from_checkpoint_needs_a_recorded_config_and_a_handler_saving_there(tmp_path, marker):
    from fitforge.handlers import CheckpointHandler
    from fitforge.testing import linear_problem

    estimator, train, _ = linear_problem()
    estimator.fit(train, epochs=1, event_handlers=[CheckpointHandler(tmp_path / "plain")])
    assert "config" not in load_checkpoint(tmp_path / "plain" / "model-epoch1batch8.pt")
    with pytest.raises(ConfigError, match=r"holds no config: its run was not started from one"):
        run(["fit", "--from_checkpoint", str(tmp_path / "plain" / "model-epoch1batch8.pt")])
    config = write_config(tmp_path)
    run(["fit", "--config", str(config), "--fit.epochs", "1"])
    checkpoint = str(tmp_path / "ckpt" / "model-epoch1batch4.pt")
    with pytest.raises(ConfigError, match=r"no handler that resumes"):
        run(["fit", "--from_checkpoint", checkpoint, "--handlers", "[]"])
    with pytest.raises(ConfigError, match=r"checkpoints go to .*elsewhere, not to .*ckpt; start the resume from"):
        run(
            [
                "fit",
                "--from_checkpoint",
                checkpoint,
                "--handlers",
                str(BASE["handlers"][:1]).replace("ckpt", "elsewhere"),
            ]
        )


def _no_fsync(connection, record):
    connection.execute("PRAGMA synchronous=OFF")


def test_the_resolved_config_is_an_mlflow_param_each(tmp_path, marker, monkeypatch):
    """(MLflow's SQLite store without fsync, as in tests/handlers/test_mlflow.py: seconds fewer.)"""
    mlflow = pytest.importorskip("mlflow")
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    event.listen(Engine, "connect", _no_fsync)
    try:
        _fit_into_mlflow(mlflow, tmp_path, monkeypatch)
    finally:
        event.remove(Engine, "connect", _no_fsync)


def _fit_into_mlflow(mlflow, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = {"class_path": "fitforge.handlers.MLflowHandler", "init_args": {"tracking_uri": uri}}
    config = write_config(tmp_path, handlers=[tracker])
    run(["fit", "--config", str(config), "--fit.epochs", "1"])
    client = mlflow.MlflowClient(uri)
    (found,) = client.search_runs(["0"])
    assert found.data.params["config.model.init_args.hidden"] == "8"
    assert found.data.params["config.data.function"] == "tiny_run.line_data"
    assert found.data.params["config.fit.batches"] == "null"


def test_without_jsonargparse_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # an import of it fails
    for name in [name for name in sys.modules if name.startswith("fitforge.cli")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r'pip install "fitforge\[cli\]"'):
        importlib.import_module("fitforge.cli")


def test_evaluate_and_predict_use_the_average_of_an_ema_run(tmp_path, marker):
    ema = {"class_path": "fitforge.handlers.EMAHandler", "init_args": {"decay": 0.5}}
    config = write_config(tmp_path, handlers=[*BASE["handlers"], ema])
    history = run(["fit", "--config", str(config)])
    checkpoint = str(tmp_path / "ckpt" / "model-epoch3batch12.pt")
    metrics = run(["evaluate", "--config", str(config), "--checkpoint", checkpoint])
    assert metrics["val_loss"] == pytest.approx(history["val_loss"][-1], rel=1e-6)  # the average, as fit judged it
    raw = run(["evaluate", "--config", str(write_config(tmp_path, "raw.yaml")), "--checkpoint", checkpoint])
    assert raw["val_loss"] != pytest.approx(metrics["val_loss"], rel=1e-6)


def test_a_value_a_config_cannot_hold_is_left_out_of_the_record(tmp_path, marker, caplog):
    config = write_config(tmp_path, data={"function": "tiny_run.line_data_with_transform", "args": {"n": 64}})
    with caplog.at_level("WARNING", logger="fitforge"):
        run(["fit", "--config", str(config), "--fit.epochs", "1"])
    recorded = recorded_config(tmp_path / "ckpt" / "model-epoch1batch4.pt")
    assert "transform" not in recorded["data"]["args"] and recorded["data"]["args"]["n"] == 64


def test_an_error_found_once_the_run_is_built_is_printed_without_a_traceback(tmp_path, marker, capsys):
    config = write_config(tmp_path)
    assert main(["fit", "--config", str(config), "--fit.epochs", "1"]) == 0
    assert main(["fit", "--config", str(config), "--fit.epochs", "1"]) == 1  # the folder holds that run's files
    err = capsys.readouterr().err
    assert "error: FitforgeValueError: CheckpointHandler:" in err and "already holds" in err
    assert "Traceback" not in err


def test_diff_names_a_changed_config_key_and_exits_with_its_status(tmp_path, marker, monkeypatch, capsys):
    checkpoints = {"class_path": "fitforge.handlers.CheckpointHandler", "init_args": {"model_dir": "ckpt"}}
    fingerprints = {"class_path": "fitforge.handlers.FingerprintHandler", "init_args": {"every": 2}}
    for name, lr in (("a", 0.1), ("b", 0.1), ("c", 0.2)):
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.chdir(folder)
        optimizer = {"class_path": "torch.optim.SGD", "init_args": {"lr": lr}}
        write_config(
            folder, estimator={**BASE["estimator"], "optimizer": optimizer}, handlers=[checkpoints, fingerprints]
        )
        run(["fit", "--config", "cfg.yaml", "--fit.epochs", "1"])
    monkeypatch.chdir(tmp_path)
    manifest = json.loads((tmp_path / "a" / "ckpt" / "manifest.json").read_text())
    assert manifest["config"] == recorded_config(tmp_path / "a" / "ckpt" / "model-epoch1batch4.pt")
    capsys.readouterr()
    assert main(["diff", "a/ckpt", "b/ckpt"]) == 0
    assert "bitwise identical: the 2 fingerprints both runs recorded match" in capsys.readouterr().out
    assert main(["diff", "a/ckpt", "c/ckpt/manifest.json"]) == 1
    shown = capsys.readouterr().out
    assert "config.estimator.optimizer.init_args.lr: 0.1 -> 0.2" in shown and "diverge at step 0" in shown
    assert main(["diff", "a/ckpt", "nowhere"]) == 2
    assert "error: fitforge diff: no manifest.json in nowhere" in capsys.readouterr().err

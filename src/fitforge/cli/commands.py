"""``fitforge fit|evaluate|predict``: parse and check the whole config (its every key and type, then
the data function's arguments), so that a mistake is found before anything is built; then build and run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser, Namespace

from fitforge.checkpoint.earlier_run import EarlierRunError
from fitforge.checkpoint.files import save_atomic
from fitforge.cli.build import build, data_of
from fitforge.cli.parser import RUN_SECTIONS, command_parser, data_arguments, recorded_config
from fitforge.cli.suggest import config_error, parameters
from fitforge.exceptions import CheckpointError, ConfigError, FitforgeTypeError, FitforgeValueError
from fitforge.inputs.arrays import from_pandas, is_arrays
from fitforge.reporting.run_diff import RunDiff, diff_runs

log = logging.getLogger("fitforge")
_RESUME = "resume_from_checkpoint"


def run(args: list[str] | None = None) -> Any:
    """Run a command as the console would (``run(["fit", "--config", "cfg.yaml"])``) and return its
    result: ``fit`` the History, ``evaluate`` the metrics dict, ``predict`` the predictions,
    ``--print_config`` the resolved config (a dict), having built nothing; ``diff`` the
    :class:`~fitforge.reporting.run_diff.RunDiff` it printed."""
    argv = _with_recorded_config(sys.argv[1:] if args is None else list(args))
    commands, parsed = _parsed(argv)
    command = parsed.command
    config: Namespace = parsed[command]
    if command == "diff":
        return _diff(config)
    subparser = commands[command]
    data_parser = _check_data_arguments(config, command)
    if config.print_config:  # the config with the command's own options, as --config would take it back
        shown = config.clone()
        shown.pop("config", None)
        shown.pop("print_config", None)
        print(subparser.dump(shown, skip_unset=False, skip_validation=True), end="")
        return recordable(subparser, config)
    if command != "fit" and not Path(config.checkpoint).is_file():
        raise ConfigError(f"fitforge {command}: --checkpoint {config.checkpoint}: no such file; nothing was built")
    if config.seed is None:  # drawn once and recorded, so that the recorded config builds the same run
        config.seed = random.SystemRandom().randrange(2**31)
    runner = {"fit": _fit, "evaluate": _evaluate, "predict": _predict}[command]
    return runner(subparser, data_parser, config)


def _parsed(argv: list[str]) -> tuple[dict[str, ArgumentParser], Namespace]:
    """The command's parsers and ``argv`` parsed. torchmetrics takes seconds to import, so metrics are
    parsed without it first; one the parser refuses may be a torchmetrics metric: then once more with it."""
    parser, commands = command_parser()
    try:
        return commands, parser.parse_args(argv)
    except ArgumentError as error:
        refused = error
    if "_metrics" in str(refused) and importlib.util.find_spec("torchmetrics"):
        parser, commands = command_parser(torchmetrics=True)
        try:
            return commands, parser.parse_args(argv)
        except ArgumentError as error:
            refused = error
    named = argv[0] if argv and argv[0] in commands else ""
    raise config_error(refused, commands.get(named, parser), named) from None


def _with_recorded_config(argv: list[str]) -> list[str]:
    """``evaluate`` or ``predict`` given a ``--checkpoint`` but no ``--config``: the config recorded in
    the checkpoint, if any, goes first, so it names the model and data and other options override it."""
    if not argv or argv[0] not in ("evaluate", "predict") or any(a.split("=")[0] == "--config" for a in argv):
        return argv
    for i, option in enumerate(argv):
        path = option.partition("=")[2] if option.startswith("--checkpoint=") else None
        if option == "--checkpoint" and i + 1 < len(argv):
            path = argv[i + 1]
        if path is not None and Path(path).is_file():
            try:
                recorded = recorded_config(path)
            except (ConfigError, CheckpointError):  # no config there: the usual errors name what is missing
                return argv
            log.info("fitforge %s: the config recorded in %s", argv[0], path)
            return [argv[0], "--config", json.dumps(recorded), *argv[1:]]
    return argv


def main(args: list[str] | None = None) -> int:
    """The console script ``fitforge``: a config error (or a run ``diff`` finds no manifest of) is printed, exit
    status 2; fitforge's own errors once the run is built are printed too (their messages name the fix), exit
    status 1, as two runs ``diff`` finds different; else 0."""
    if not getattr(sys.flags, "safe_path", False) and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # last: a file here never shadows an installed package
    try:
        result = run(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (FitforgeValueError, FitforgeTypeError) as error:
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 1 if isinstance(result, RunDiff) and not result.identical else 0


def recordable(parser: ArgumentParser, config: Namespace) -> dict[str, Any]:
    """The run's sections of ``config`` as plain JSON values: what the run records."""
    whole = json.loads(parser.dump(config, format="json", skip_unset=False, skip_validation=True))
    return {key: without_unserializable(whole.get(key), key) for key in RUN_SECTIONS}


_UNSERIALIZABLE = "Unable to serialize"  # what jsonargparse dumps for a value a config cannot hold


def without_unserializable(value: Any, key: str) -> Any:
    """``value`` without the entries jsonargparse could not write (a lambda...), each logged: recorded, they
    would come back as that text in a resumed run."""
    if isinstance(value, dict):
        kept = {}
        for name, item in value.items():
            if isinstance(item, str) and item.startswith(_UNSERIALIZABLE):
                log.warning(
                    "fitforge: %s.%s (%s) cannot be written in a config: it is not recorded, and a run started "
                    "from the recorded config takes its default; give it a type (a class path) to record it",
                    key,
                    name,
                    item.removeprefix(_UNSERIALIZABLE).strip(),
                )
                continue
            kept[name] = without_unserializable(item, f"{key}.{name}")
        return kept
    if isinstance(value, list):
        return [without_unserializable(item, f"{key}.{i}") for i, item in enumerate(value)]
    return value


def _check_data_arguments(config: Namespace, command: str) -> ArgumentParser:
    """Check ``data.args`` against the data function's signature and fill in its defaults."""
    data_parser = data_arguments(config)
    try:
        checked = data_parser.parse_object(dict(config.data.args))
    except ArgumentError as error:
        raise config_error(error, data_parser, command, prefix="data.args.") from None
    given = set(config.data.args)
    dumped = json.loads(data_parser.dump(checked, format="json", skip_unset=False))
    # a default the config cannot hold (a lambda) stays the function's own default
    config.data.args = {
        name: value
        for name, value in dumped.items()
        if name in given or not (isinstance(value, str) and value.startswith(_UNSERIALIZABLE))
    }
    return data_parser


def _diff(config: Namespace) -> RunDiff:
    try:
        compared = diff_runs(config.run_a, config.run_b)
    except FitforgeValueError as error:  # no manifest there: trouble, not a difference (diff's exit status 2)
        raise ConfigError(str(error)) from None
    print(compared.text(config.run_a, config.run_b))  # the command's result, on stdout
    return compared


def _fit(parser: ArgumentParser, data_parser: ArgumentParser, config: Namespace) -> Any:
    recorded = recordable(parser, config)  # the run's config as given: a resume sets resume_from_checkpoint itself
    if config.from_checkpoint is not None:
        resume_from(config, config.from_checkpoint)
    built = build(parser, data_parser, config)
    built.estimator.run_config = recorded
    if "train_data" not in built.data:
        raise ConfigError(
            f"fitforge fit needs train_data, but the data function returned {', '.join(built.data)} only; "
            "return a dict with 'train_data' (and 'val_data' to validate), or the training data alone"
        )
    try:
        return built.estimator.fit(
            built.data["train_data"],
            val_data=built.data.get("val_data"),
            event_handlers=built.handlers,
            **vars(config.fit),
        )
    except EarlierRunError as error:
        if not error.files or not isinstance(error.files[-1], Path):  # as it says (a store: no path to give)
            raise
        raise FitforgeValueError(
            f"{error.found}; this run starts from scratch and would replace them. To continue that run: fitforge "
            f"fit --config ... --from_checkpoint {error.files[-1]}; to replace its files: overwrite: true in the "
            "CheckpointHandler's init_args; to keep them: another model_dir or model_prefix"
        ) from None


def resume_from(config: Namespace, checkpoint: str) -> None:
    """``fit --from_checkpoint``: turn on ``resume_from_checkpoint`` in ``config``'s handlers that take it;
    one of them must save where ``checkpoint`` is, or the run would start again from scratch."""
    folder = Path(checkpoint).resolve().parent
    resuming = [spec for spec in config.handlers if _RESUME in parameters(spec.class_path)]
    if not resuming:
        raise ConfigError(
            f"--from_checkpoint {checkpoint}: the config has no handler that resumes (one taking {_RESUME}, "
            "a CheckpointHandler); add the run's CheckpointHandler to its handlers"
        )
    folders = [Path(spec.init_args.get("model_dir", ".")).resolve() for spec in resuming]
    if folder not in folders:
        raise ConfigError(
            f"--from_checkpoint {checkpoint}: the run's checkpoints go to {', '.join(map(str, folders))}, not to "
            f"{folder}; start the resume from the folder the run was started in (a relative model_dir is "
            "relative to it)"
        )
    for spec in resuming:
        spec.init_args[_RESUME] = True
    log.info("fitforge fit: resuming the run of %s from the newest checkpoint in %s", checkpoint, folder)


def _evaluate(parser: ArgumentParser, data_parser: ArgumentParser, config: Namespace) -> dict[str, float]:
    built = build(parser, data_parser, config, handlers=False)
    data = data_of(built, config.split, "evaluate", config.data.function)
    built.estimator.load_checkpoint(config.checkpoint, optimizers=False)
    metrics = built.estimator.evaluate(data, batch_size=config.fit.batch_size, prefix=config.split)
    text = json.dumps(metrics, indent=2)
    print(text)  # the command's result, on stdout for a shell to read (logs go to stderr)
    if config.output is not None:
        Path(config.output).parent.mkdir(parents=True, exist_ok=True)
        Path(config.output).write_text(text + "\n")
    return metrics


def _predict(parser: ArgumentParser, data_parser: ArgumentParser, config: Namespace) -> Any:
    built = build(parser, data_parser, config, handlers=False)
    data = from_pandas(data_of(built, config.split, "predict", config.data.function), "predict_data")
    if isinstance(data, tuple) and is_arrays(data):  # the (X, y) fit and evaluate take (a list: batches)
        data = data[0]
    built.estimator.load_checkpoint(config.checkpoint, optimizers=False)
    predictions = built.estimator.predict(data, batch_size=config.fit.batch_size)
    output = Path(config.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(predictions, output)  # a crash never leaves half a file under the name
    log.info("fitforge predict: wrote the predictions of %s to %s", config.checkpoint, output)
    return predictions

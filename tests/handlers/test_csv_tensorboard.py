"""CSVLoggerHandler (a row per epoch, flushed; a resumed run appends without duplicates; new keys
add columns) and TensorBoardHandler (history scalars per epoch; optional histograms and batch values)."""

import csv
import json
import sys
import threading

import pytest
import torch

from fitforge import TrainState
from fitforge.core.events import events_of
from fitforge.events import BatchEnd, Event
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError
from fitforge.handlers import CheckpointHandler, ValidationHandler
from fitforge.handlers.csv_logger import CSVLoggerHandler
from fitforge.handlers.lambda_handler import LambdaHandler
from fitforge.reporting.hparams import run_params
from fitforge.testing import HostReadCounter, linear_data, linear_problem


def read_csv(path):
    with open(path, newline="") as file:
        return list(csv.reader(file))


def as_numbers(lines):
    return [lines[0]] + [[float(cell) for cell in line] for line in lines[1:]]


def fit(handlers, epochs=3, validate=True, **kwargs):
    torch.manual_seed(0)
    estimator, train, val = linear_problem()
    return estimator.fit(train, val_data=val if validate else None, epochs=epochs, event_handlers=handlers, **kwargs)


# -- CSVLoggerHandler ----------------------------------------------------------------------------------


def test_one_row_per_epoch_equal_to_the_history(tmp_path):
    history = fit([CSVLoggerHandler(tmp_path / "log.csv")], check_access=True)
    lines = read_csv(tmp_path / "log.csv")
    assert lines[0] == ["epoch", *history]
    assert as_numbers(lines) == as_numbers(read_csv(history.to_csv(tmp_path / "history.csv")))
    assert [line[0] for line in lines[1:]] == ["1", "2", "3"]


def test_each_row_is_on_disk_when_its_epoch_ends(tmp_path):
    path = tmp_path / "sub" / "log.csv"  # the folder is created
    rows_seen = []
    probe = LambdaHandler(epoch_end=lambda state: rows_seen.append(len(read_csv(path)) - 1), priority=1500)
    fit([CSVLoggerHandler(path), probe])
    assert rows_seen == [1, 2, 3]


def test_validation_every_second_epoch_keeps_one_header_with_nan(tmp_path):
    history = fit(
        [CSVLoggerHandler(tmp_path / "log.csv"), ValidationHandler(linear_data(n=64, seed=1), epoch_period=2)],
        validate=False,
    )
    lines = read_csv(tmp_path / "log.csv")
    column = lines[0].index("val_loss")
    assert [line[column] for line in lines[1:]] == ["nan", repr(history["val_loss"][1]), "nan"]


def test_a_key_appearing_later_adds_a_column(tmp_path):
    late = LambdaHandler(epoch_end=lambda state: state.history.record("extra", 7.0) if state.epoch else None)
    fit([CSVLoggerHandler(tmp_path / "log.csv"), late])
    lines = read_csv(tmp_path / "log.csv")
    assert lines[0][-1] == "extra" and [line[-1] for line in lines[1:]] == ["nan", "7.0", "7.0"]
    assert all(len(line) == len(lines[0]) for line in lines)
    assert not (tmp_path / "log.csv.tmp").exists()


def test_a_fresh_run_overwrites_unless_append(tmp_path):
    path = tmp_path / "log.csv"
    fit([CSVLoggerHandler(path)], epochs=2)
    fit([CSVLoggerHandler(path)], epochs=1)
    assert [line[0] for line in read_csv(path)] == ["epoch", "1"]
    fit([CSVLoggerHandler(path, append=True)], epochs=2)
    assert [line[0] for line in read_csv(path)] == ["epoch", "1", "1", "2"]  # Keras's append: one header


def test_append_refuses_a_file_it_did_not_write(tmp_path):
    path = tmp_path / "notes.csv"
    path.write_text("name,value\nx,1\n")
    with pytest.raises(FitforgeValueError, match=r"notes.csv is not a log this handler can continue"):
        fit([CSVLoggerHandler(path, append=True)], epochs=1)


def run(tmp_path, epochs):
    """The same script each time: resumes from the newest checkpoint, logs to log.csv."""
    saver = CheckpointHandler(tmp_path / "ckpt", resume_from_checkpoint=True)
    return fit([saver, CSVLoggerHandler(tmp_path / "log.csv")], epochs=epochs)


def test_a_resumed_run_appends_without_duplicating_epochs(tmp_path):
    first = read_csv(run(tmp_path, 2).to_csv(tmp_path / "first.csv"))
    history = run(tmp_path, 4)
    lines = read_csv(tmp_path / "log.csv")
    assert [line[0] for line in lines] == ["epoch", "1", "2", "3", "4"]
    assert lines[:3] == first[:3]  # the first run's rows, untouched
    assert as_numbers(lines) == as_numbers(read_csv(history.to_csv(tmp_path / "history.csv")))


def test_a_resumed_run_fills_in_rows_a_crash_lost_and_drops_a_torn_line(tmp_path, caplog):
    run(tmp_path, 2)
    path = tmp_path / "log.csv"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][:9])  # row 2 cut short by a crash
    history = run(tmp_path, 3)
    assert "dropped an incomplete last line" in caplog.text
    assert as_numbers(read_csv(path)) == as_numbers(read_csv(history.to_csv(tmp_path / "history.csv")))


def test_an_epoch_the_file_already_has_is_not_written_again(tmp_path):
    run(tmp_path, 2)
    path = tmp_path / "log.csv"
    width = len(read_csv(path)[0])
    with path.open("a") as file:  # as if epoch 3 was logged but its checkpoint never written
        file.write(",".join(["3"] + ["0.5"] * (width - 1)) + "\n")
    run(tmp_path, 4)
    lines = read_csv(path)
    assert [line[0] for line in lines] == ["epoch", "1", "2", "3", "4"] and lines[3][1:] == ["0.5"] * (width - 1)


def test_only_whole_training_epochs_are_written(tmp_path):
    path = tmp_path / "log.csv"
    estimator, _, val = linear_problem()
    estimator.evaluate(val, event_handlers=[CSVLoggerHandler(path)])
    assert not path.exists()
    logger = CSVLoggerHandler(path)
    state = TrainState(estimator)
    logger.train_begin(state)
    state.history.new_epoch()
    state.run.preempted, state.num_batches, state.batch_idx = 15, 8, 3  # SIGTERM mid-epoch: it resumes later
    logger.epoch_end(state)
    assert not path.exists()


def test_the_run_params_are_in_a_json_file_beside_the_log(tmp_path):
    seen = []

    def at_train_begin(state):  # after the logger's train_begin: the file is there already
        seen.append((run_params(state), json.loads((tmp_path / "log.params.json").read_text())))

    logger = CSVLoggerHandler(tmp_path / "log.csv")
    assert logger.params_path == tmp_path / "log.params.json"
    fit([logger, LambdaHandler(train_begin=at_train_begin, priority=1500)], epochs=2)
    params, written = seen[0]
    assert written == params and written["model"] == "Linear" and written["epochs"] == 2
    assert read_csv(tmp_path / "log.csv")[0][0] == "epoch"  # the CSV holds rows only
    fit([CSVLoggerHandler(tmp_path / "log.csv", append=True)], epochs=1)  # each fit writes its own
    assert json.loads(logger.params_path.read_text())["epochs"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.csv", "log.params.json", "manifest.json"]
    assert CSVLoggerHandler(tmp_path / "runs" / "log").params_path == tmp_path / "runs" / "log.params.json"


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda tmp: CSVLoggerHandler(3), FitforgeTypeError, r"path must be a file path, got int 3"),
        (lambda tmp: CSVLoggerHandler(tmp / "a.csv", append="yes"), FitforgeTypeError, r"append must be True or False"),
    ],
)
def test_csv_argument_errors(tmp_path, make, error, message):
    with pytest.raises(error, match=message):
        make(tmp_path)


def test_a_folder_as_path_fails_at_fit_start(tmp_path):
    with pytest.raises(FitforgeValueError, match=r"is a folder; expected a file path"):
        fit([CSVLoggerHandler(tmp_path)], epochs=1)


# -- TensorBoardHandler --------------------------------------------------------------------------------


def test_a_missing_tensorboard_is_a_clear_import_error(tmp_path, monkeypatch):
    from fitforge.handlers.tensorboard import TensorBoardHandler

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install 'fitforge\[tensorboard\]'"):
        TensorBoardHandler(tmp_path)


def test_tensorboard_argument_errors(tmp_path):
    from fitforge.handlers.tensorboard import TensorBoardHandler

    with pytest.raises(FitforgeTypeError, match=r"log_dir must be a folder path, got int 3"):
        TensorBoardHandler(3)
    with pytest.raises(FitforgeTypeError, match=r"histograms must be True or False"):
        TensorBoardHandler(tmp_path, histograms=1)
    with pytest.raises(FitforgeValueError, match=r"log_every_n_batches must be a positive int or None, got 0"):
        TensorBoardHandler(tmp_path, log_every_n_batches=0)
    with pytest.raises(FitforgeValueError, match=r"TensorBoardHandler: flush_secs must be a positive number"):
        TensorBoardHandler(tmp_path, flush_secs=-1)


def events(log_dir):
    pytest.importorskip(
        "tensorboard", reason="TensorBoardHandler needs tensorboard (pip install 'fitforge[tensorboard]')"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


def tensorboard_handler(*args, **kwargs):
    pytest.importorskip(
        "tensorboard", reason="TensorBoardHandler needs tensorboard (pip install 'fitforge[tensorboard]')"
    )
    from fitforge.handlers.tensorboard import TensorBoardHandler

    return TensorBoardHandler(*args, **kwargs)


def test_every_history_value_becomes_a_scalar_per_epoch(tmp_path):
    board = tensorboard_handler(tmp_path / "tb")
    history = fit(
        [board, ValidationHandler(linear_data(n=64, seed=1), epoch_period=2)], validate=False, check_access=True
    )
    assert board.writer is None  # closed at train_end
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    scalars = events(tmp_path / "tb")
    assert set(scalars.Tags()["scalars"]) == set(history)
    for key in ("train_loss", "lr", "epoch_time"):
        written = scalars.Scalars(key)
        assert [e.step for e in written] == [1, 2, 3]
        assert [e.value for e in written] == pytest.approx(history[key], rel=1e-6)
    assert [(e.step, e.value) for e in scalars.Scalars("val_loss")] == [(2, pytest.approx(history["val_loss"][1]))]
    assert not scalars.Tags()["histograms"]


def test_a_second_fit_of_the_estimator_continues_the_epoch_steps(tmp_path):
    torch.manual_seed(0)
    estimator, train, _ = linear_problem()
    board = tensorboard_handler(tmp_path / "tb")
    estimator.fit(train, epochs=2, event_handlers=[board])
    estimator.fit(train, epochs=2, event_handlers=[board])
    assert [e.step for e in events(tmp_path / "tb").Scalars("train_loss")] == [1, 2, 3, 4]  # as the log: 3/4, 4/4


def test_a_resumed_fit_continues_the_folder_and_hides_what_the_cut_run_wrote_after_its_checkpoint(tmp_path):
    def run(epochs, **kwargs):  # the same script each time, resuming from the newest checkpoint
        saver = CheckpointHandler(tmp_path / "ckpt", resume_from_checkpoint=True)
        return fit([saver, tensorboard_handler(tmp_path / "tb", **kwargs)], epochs=epochs, validate=False)

    run(3)
    (tmp_path / "ckpt" / "model-epoch3batch24.pt").unlink()  # as if killed after epoch 3's values, before its save
    history = run(4)  # continues after epoch 2
    written = events(tmp_path / "tb").Scalars("train_loss")
    assert [e.step for e in written] == [1, 2, 3, 4]  # epoch 3 once: the cut run's (purge_step) is hidden
    assert [e.value for e in written] == pytest.approx(history["train_loss"], rel=1e-6)
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2  # one folder, a file per fit
    (tmp_path / "ckpt" / "model-epoch4batch32.pt").unlink()
    run(5, log_every_n_batches=4)  # with batch values (another step count) nothing is hidden
    assert [e.step for e in events(tmp_path / "tb").Scalars("train_loss")] == [1, 2, 3, 4, 4, 5]


def test_the_writes_are_off_the_training_thread(tmp_path, monkeypatch):
    board = tensorboard_handler(tmp_path, histograms=True, flush_secs=1000)  # written at train_end's close
    threads = set()
    original = type(board)._write

    def spy(self, records):
        threads.add(threading.get_ident())
        original(self, records)

    monkeypatch.setattr(type(board), "_write", spy)
    history = fit([board], epochs=2, validate=False)
    assert threads and threading.get_ident() not in threads
    written = events(tmp_path)
    assert [e.step for e in written.Scalars("train_loss")] == [1, 2]
    assert [e.value for e in written.Scalars("train_loss")] == pytest.approx(history["train_loss"], rel=1e-6)
    # the histograms are copies taken at each epoch end, not the weights as they were at the write
    assert (
        written.Histograms("weights/bias")[0].histogram_value.sum
        != written.Histograms("weights/bias")[1].histogram_value.sum
    )


def test_histograms_and_batch_values_when_asked(tmp_path):
    board = tensorboard_handler(tmp_path, histograms=True, log_every_n_batches=4)
    assert BatchEnd in type(board).__mro__ and isinstance(board, type(tensorboard_handler(tmp_path)))
    fit([board], epochs=2, validate=False)
    written = events(tmp_path)
    assert set(written.Tags()["histograms"]) == {"weights/weight", "weights/bias"}
    assert [e.step for e in written.Scalars("batch/train_loss")] == [4, 8, 12, 16]


def test_tensorboard_reads_nothing_per_batch_unless_asked(tmp_path):
    board = tensorboard_handler(tmp_path)
    assert Event.BATCH_END not in events_of(board) and events_of(board)  # not even called per batch

    def reads(batches, **kwargs):
        estimator, _, _ = linear_problem()
        with HostReadCounter() as counter:
            estimator.fit(
                linear_data(n=4 * batches, batch_size=4),
                epochs=1,
                event_handlers=[tensorboard_handler(tmp_path / str(batches), **kwargs)],
            )
        return counter.count

    assert reads(8) == reads(64)
    assert reads(64, log_every_n_batches=8) > reads(8, log_every_n_batches=8)  # a read every 8 batches
    assert (tmp_path / "8" / "manifest.json").is_file()  # the run's manifest, beside its event files


def test_a_throttled_logger_and_a_rerun_over_an_old_file_are_fresh_runs(tmp_path):
    from fitforge.handlers import throttle

    fit([throttle(CSVLoggerHandler(tmp_path / "log.csv"), every_n_epochs=2)], epochs=4)
    assert [line[0] for line in read_csv(tmp_path / "log.csv")] == ["epoch", "2", "4"]  # no made-up catch-up row
    fit([CSVLoggerHandler(tmp_path / "log.csv")], epochs=2)  # append=False: a fresh run starts the file again
    assert [line[0] for line in read_csv(tmp_path / "log.csv")] == ["epoch", "1", "2"]


def test_an_epoch_cut_short_is_written_once_a_resumed_run_completes_it(tmp_path):
    saver = CheckpointHandler(tmp_path / "ckpt", epoch_period=None, batch_period=1, resume_from_checkpoint=True)
    fit([saver, CSVLoggerHandler(tmp_path / "log.csv")], epochs=None, batches=12)  # 8 batches an epoch
    assert [line[0] for line in read_csv(tmp_path / "log.csv")] == ["epoch", "1"]
    saver = CheckpointHandler(tmp_path / "ckpt", epoch_period=None, batch_period=1, resume_from_checkpoint=True)
    history = fit([saver, CSVLoggerHandler(tmp_path / "log.csv")], epochs=3)
    lines = read_csv(tmp_path / "log.csv")
    assert [line[0] for line in lines] == ["epoch", "1", "2", "3"]
    assert float(lines[2][lines[0].index("train_loss")]) == history["train_loss"][1]  # the whole epoch's value


def test_an_evaluation_writes_no_event_file(tmp_path):
    board = tensorboard_handler(tmp_path / "tb")
    estimator, _, val = linear_problem()
    estimator.evaluate(val, event_handlers=[board])
    assert board.writer is None and not (tmp_path / "tb").exists()


def test_the_run_params_and_last_values_go_to_the_hparams_tab(tmp_path):
    seen = []
    board = tensorboard_handler(tmp_path / "tb")
    probe = LambdaHandler(train_begin=lambda state: seen.append(run_params(state)))
    history = fit([board, probe, ValidationHandler(linear_data(n=64, seed=1), epoch_period=2)], validate=False)
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    written = events(tmp_path / "tb")
    content = written.PluginTagToContent("hparams")
    experiment = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {info.name.tag for info in experiment.metric_infos} == set(history)  # the scalars' own tags
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    hparams = {key: getattr(value, value.WhichOneof("kind")) for key, value in start.hparams.items()}
    assert hparams == pytest.approx(seen[0])  # numbers as floats, strings as they are
    assert hparams["model"] == "Linear" and hparams["epochs"] == 3 and hparams["precision"] == "32-true"
    assert set(written.Tags()["scalars"]) == set(history)  # no scalar written twice, no stray tag
    assert [e.step for e in written.Scalars("val_loss")] == [2]

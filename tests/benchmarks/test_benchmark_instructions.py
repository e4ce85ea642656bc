"""benchmarks/instructions.py: the valgrind runs take minutes, so only its refusals are tested here;
the counts it printed are in docs/performance.md."""

from unittest import mock

import pytest

from helpers import load_benchmark

pytestmark = pytest.mark.integration  # runs the benchmarks


def load():
    return load_benchmark("instructions")


def test_missing_tools_are_named(tmp_path):
    module = load()
    with mock.patch.object(module.shutil, "which", return_value=None), pytest.raises(SystemExit) as exit_:
        module.build_helper(tmp_path)
    assert "needs valgrind and cc on PATH" in str(exit_.value)


def test_it_counts_the_variants_of_overhead_py():
    overhead = load().load_overhead()
    assert set(overhead.VARIANTS) == {"fit default", "hand + val", "fit lean", "hand"}


def test_every_piece_it_counts_runs():
    module = load()
    calls = module.pieces(module.load_overhead())
    assert "validation check before training" in calls
    for call in calls.values():
        call()  # what the valgrind process counts, uncounted here


def test_the_tracker_variants_run(tmp_path, monkeypatch):
    for extra in ("mlflow", "wandb", "tensorboard"):
        pytest.importorskip(extra, reason="--trackers needs the [mlflow], [wandb] and [tensorboard] extras")
    import wandb

    # The variant that opens the runs first sets MLflow's tracking URI for the process: put it back after,
    # as W&B's own set-up, so that later tests find neither.
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", None)
    module = load()
    for name, value in {**module.TRACKER_ENV, "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    overhead = module.load_overhead()
    module.mlflow_store(tmp_path / "mlflow.db")
    w = overhead.WORKLOADS["Z"]
    train, val = overhead.make_loaders(w, 1.0)
    for variant in (module.TRACKED, module.OPEN_TRACKED):
        after = []
        module.tracked(overhead, variant, w, train, val, tmp_path, after)()  # what the valgrind process counts
        assert len(after) == (2 if variant == module.OPEN_TRACKED else 0)
        for end in after:
            end()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
    wandb.teardown()


def test_the_idle_profiler_variant_traces_nothing(tmp_path):
    module = load()
    overhead = module.load_overhead()
    w = overhead.WORKLOADS["Z"]
    train, val = overhead.make_loaders(w, 1.0)
    module.idle_profiled(overhead, w, train, val, tmp_path)()  # what the valgrind process counts
    assert not (tmp_path / "profile").exists()  # its cycle would begin after the run's last step


def test_trackers_count_a_or_b_only(monkeypatch, capsys):
    module = load()
    monkeypatch.setattr(module.sys, "argv", ["instructions.py", "--trackers", "--workload", "Z"])
    with pytest.raises(SystemExit):
        module.main()
    assert "--trackers counts one fit of A or B" in capsys.readouterr().err

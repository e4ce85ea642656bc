"""``fitforge diff``'s comparison: two identical seeded runs are bitwise identical; a changed learning rate
is named; a data order that differs from step 37 on diverges at the first fingerprint from 37, no earlier;
without fingerprints the epochs' values (not their timings) decide; what a manifest must be."""

import json

import fsspec
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from fitforge import Estimator
from fitforge.exceptions import FitforgeValueError
from fitforge.handlers import CheckpointHandler, CSVLoggerHandler, FingerprintHandler
from fitforge.reporting.run_diff import compare, diff_runs, read_manifest
from fitforge.testing import linear_problem


def seeded_run(folder, lr=0.1, every=1, epochs=2, **fit):
    estimator, train, _ = linear_problem(lr=lr)  # seeds torch: the same net and data order each time
    handlers = [CheckpointHandler(folder)] + ([FingerprintHandler(every)] if every else [])
    estimator.fit(train, epochs=epochs, event_handlers=handlers, **fit)


def test_two_identical_seeded_runs_are_bitwise_identical(tmp_path):
    seeded_run(tmp_path / "a")
    seeded_run(tmp_path / "b")
    compared = diff_runs(tmp_path / "a", tmp_path / "b")
    assert compared.identical and compared.differences == [] and compared.order is None
    assert compared.divergence.startswith("bitwise identical: the 16 fingerprints")
    assert "bitwise identical" in compared.text("a", "b")
    seeded_run(tmp_path / "c", every=0)
    seeded_run(tmp_path / "d", every=0)  # without fingerprints the epochs' values decide, not their timings
    assert diff_runs(tmp_path / "c", tmp_path / "d").identical


def test_a_changed_learning_rate_is_named_and_the_runs_part_at_the_first_step(tmp_path):
    seeded_run(tmp_path / "a")
    seeded_run(tmp_path / "b", lr=0.05)
    compared = diff_runs(tmp_path / "a", tmp_path / "b")
    assert not compared.identical and compared.differences == ["arguments.lr: 0.1 -> 0.05"]
    assert compared.divergence.startswith("diverge at step 0") and "the parameters differ" in compared.divergence
    assert "differences (A -> B):\n  arguments.lr: 0.1 -> 0.05" in compared.text("a", "b")


class FromStep37(Sampler):
    """Samples 0 to 36 in order, then the others in an order drawn from ``seed``: batches of one differ
    from step 37 on."""

    def __init__(self, size, seed):
        self.size, self.seed = size, seed

    def __iter__(self):
        rest = torch.randperm(self.size - 37, generator=torch.Generator().manual_seed(self.seed)) + 37
        return iter([*range(37), *rest.tolist()])

    def __len__(self):
        return self.size


@pytest.mark.parametrize("every", [1, 4])
def test_a_data_order_changed_from_step_37_diverges_at_the_first_fingerprint_from_37(tmp_path, every):
    def run(folder, seed):
        torch.manual_seed(0)
        x = torch.linspace(-1, 1, 60).unsqueeze(1)
        net = nn.Linear(1, 1)
        estimator = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
        loader = DataLoader(TensorDataset(x, 2 * x + 3), batch_size=1, sampler=FromStep37(60, seed))  # its seed only
        estimator.fit(
            loader, epochs=1, event_handlers=[CSVLoggerHandler(folder / "log.csv"), FingerprintHandler(every)]
        )

    run(tmp_path / "a", seed=1)
    run(tmp_path / "b", seed=2)
    assert list(FromStep37(60, 1))[:37] == list(FromStep37(60, 2))[:37]  # the orders part at sample 37
    assert list(FromStep37(60, 1))[37] != list(FromStep37(60, 2))[37]
    compared = diff_runs(tmp_path / "a", tmp_path / "b")
    first = -(-37 // every) * every  # the first fingerprinted step from 37 on
    assert compared.divergence.startswith(f"diverge at step {first} ")
    assert compared.differences == []  # nothing recorded differs: the sampler's seed is its own
    assert compared.order == "data order: not recorded (a sampler of its own, or data keeping its own position)"


def manifest(**fields):
    return {"format": 1, "epochs": [], "metrics": {}, **fields}


def test_without_fingerprints_the_epochs_values_decide_and_timings_are_left_out():
    epochs = [{"epoch": 1, "step": 4, "order": "aa"}, {"epoch": 2, "step": 8, "order": "bb"}]
    a = manifest(epochs=epochs, metrics={"train_loss": [0.5, 0.25], "epoch_time": [1.0, 1.1], "train_mfu": [0.3, 0.3]})
    b = manifest(epochs=epochs, metrics={"train_loss": [0.5, 0.25], "epoch_time": [2.0, 2.5], "train_mfu": [0.1, 0.2]})
    same = compare(a, b)
    assert same.identical and same.divergence.startswith("the same values at each of the 2 epochs")
    b["metrics"]["train_loss"][1] = 0.5
    assert compare(a, b).divergence == "diverge at epoch 2: train_loss 0.25 -> 0.5"


def test_versions_seeds_and_data_orders_that_differ_are_named():
    a = manifest(
        environment={"torch": "2.4.0", "packages": {"numpy": "2.0"}},
        seeds={"torch": 0, "data": 7},
        repository={"root": "/a", "commit": "abc", "dirty": False},
        epochs=[{"epoch": 1, "step": 4, "order": "aa"}, {"epoch": 2, "step": 8, "order": "bb"}],
    )
    b = manifest(
        environment={"torch": "2.5.0", "packages": {}},
        seeds={"torch": 0, "data": 8},
        repository={"root": "/b", "commit": "abc", "dirty": True},
        epochs=[{"epoch": 1, "step": 4, "order": "aa"}, {"epoch": 2, "step": 8, "order": "cc"}],
    )
    compared = compare(a, b)
    assert compared.differences == [
        'environment.torch: "2.4.0" -> "2.5.0"',
        'environment.packages.numpy: "2.0" -> (absent)',
        "seeds.data: 7 -> 8",
        "repository.dirty: false -> true",
    ]
    assert compared.order == "data order: differs from epoch 2 on (1 of 2 epochs)" and not compared.identical


def test_fingerprints_of_other_steps_are_not_compared():
    a = manifest(fingerprints={"every": 2, "steps": [[0, 1.0, "00"], [2, 0.5, "01"]]})
    b = manifest(fingerprints={"every": 3, "steps": [[1, 1.0, "00"], [3, 0.5, "01"]]})
    assert compare(a, b).divergence == (
        "no step was fingerprinted in both runs (recorded every 2 and every 3 steps): not compared"
    )
    b["fingerprints"]["steps"] = [[0, 1.0, "00"], [2, 0.75, "01"], [4, 0.1, "02"]]
    assert compare(a, b).divergence == "diverge at step 2 (the first recorded step that differs): loss 0.5 -> 0.75"
    b["fingerprints"] = {"every": 4, "steps": [[0, 1.0, "00"], [4, 0.1, "02"]]}  # thinned: past its keep
    assert compare(a, b).divergence == (
        "bitwise identical: the fingerprint both runs recorded matches, step 0 (one run recorded more steps) "
        "(recorded every 2 and every 4 steps)"
    )


def test_a_config_value_naming_the_run_s_own_folder_is_no_difference(tmp_path):
    for run in ("a", "b"):
        (tmp_path / "runs" / run).mkdir(parents=True)
    config = {"trainer": {"model_dir": "runs/a", "log": "runs/a/log.csv", "lr": 0.1, "data": "data/a"}}
    a = manifest(cwd=str(tmp_path), config=config)
    b = manifest(cwd=str(tmp_path), config={"trainer": {"model_dir": "runs/b", "log": "runs/b/log.csv", "lr": 0.1,
                                                        "data": "data/b"}})  # fmt: skip
    folders = (tmp_path / "runs" / "a", tmp_path / "runs" / "b")
    assert compare(a, b, folders).differences == ['config.trainer.data: "data/a" -> "data/b"']
    assert len(compare(a, b).differences) == 3  # where the manifests were read is not known: every path differs


def test_a_run_is_a_folder_a_manifest_file_or_a_url(tmp_path):
    seeded_run(tmp_path / "a", every=0, epochs=1)
    assert read_manifest(tmp_path / "a") == read_manifest(tmp_path / "a" / "manifest.json")
    fsspec.filesystem("memory").pipe_file(
        "/diff-test/run/manifest.json", (tmp_path / "a" / "manifest.json").read_bytes()
    )
    assert read_manifest("memory://diff-test/run") == read_manifest(str(tmp_path / "a"))
    assert read_manifest("memory://diff-test/run/manifest.json")["format"] == 1


def test_what_is_no_runs_manifest_is_a_clear_error(tmp_path):
    with pytest.raises(FitforgeValueError, match=r"no manifest.json in .*nothing; a run writes one beside"):
        read_manifest(tmp_path / "nothing")
    (tmp_path / "torn.json").write_text('{"format": 1, "epo')
    with pytest.raises(FitforgeValueError, match="is not a run's manifest.json"):
        read_manifest(tmp_path / "torn.json")
    (tmp_path / "other.json").write_text(json.dumps([1, 2]))
    with pytest.raises(FitforgeValueError, match=r"is not a run's manifest.json \(no format\)"):
        read_manifest(tmp_path / "other.json")

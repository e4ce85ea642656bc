"""benchmarks/throughput.py trains the canonical models and reports samples/s (no timing is asserted)."""

import json
import sys

import pytest

from helpers import load_benchmark

pytestmark = pytest.mark.integration  # runs the benchmarks


@pytest.fixture(scope="module")
def throughput():
    return load_benchmark("throughput")


def test_throughput_reports_every_model_and_config(throughput):
    # translator and ssd_detection have their own batch processors; textcnn takes (ids, lengths) inputs
    models, configs = ["translator", "ssd_detection", "textcnn_sentiment"], ["eager-fp32", "eager-bf16"]
    report = throughput.measure(models, configs, ["cpu"], batches=2, warmup=1, batch_size=4)
    assert json.loads(json.dumps(report)) == report
    assert report["batches"] == 2 and report["warmup"] == 1 and report["threads"] >= 1
    cpu = report["devices"]["cpu"]
    assert cpu["name"] and list(cpu["models"]) == models
    for name, entry in cpu["models"].items():
        assert entry["batch_size"] == 4 and all(shape[0] == 4 for shape in entry["input_shapes"])
        assert list(entry["configs"]) == configs
        for config, result in entry["configs"].items():
            assert "error" not in result, (name, config, result)
            assert result["samples_per_s"] > 0 and result["seconds"] > 0 and result["batches"] == 2
        assert "speedup" not in entry["configs"]["eager-fp32"] and entry["configs"]["eager-bf16"]["speedup"] > 0


def test_hand_written_loops_run_beside_the_plain_step_models_only(throughput):
    models, configs = ["logistic_regression", "textcnn_sentiment", "translator"], ["eager-fp32", "eager-bf16"]
    report = throughput.measure(models, configs, ["cpu"], batches=2, warmup=1, batch_size=4, hand=True)
    plain, several_inputs, own_step = (report["devices"]["cpu"]["models"][name]["configs"] for name in models)
    for config in configs:
        for result in (plain[config], several_inputs[config]):  # TextCNN takes (ids, lengths)
            assert result["hand"]["samples_per_s"] > 0 and result["vs_hand"] > 0, result
        assert "hand" not in own_step[config] and "vs_hand" not in own_step[config]  # teacher forcing: fit only
    assert "x hand]" in throughput.table(report, configs)


def test_a_failing_hand_written_loop_is_shown_in_the_table(throughput, monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel\nmore")

    monkeypatch.setattr(throughput, "run_hand", broken)
    report = throughput.measure(["logistic_regression"], ["eager-fp32"], ["cpu"], batches=1, warmup=0, hand=True)
    result = report["devices"]["cpu"]["models"]["logistic_regression"]["configs"]["eager-fp32"]
    assert result["samples_per_s"] > 0 and result["hand"] == {"error": "RuntimeError: no kernel"}
    table = throughput.table(report, ["eager-fp32"])
    assert (
        "[hand: error]" in table and "- logistic_regression eager-fp32 (hand-written): RuntimeError: no kernel" in table
    )


def test_the_hand_written_loop_trains_as_fit_does(throughput):
    import torch

    w = throughput.workload("logistic_regression", 64)
    nets, starts = [], []

    def make_net(make=w.make_net):
        nets.append(make())
        starts.append(nets[-1].weight.detach().clone())
        return nets[-1]

    w = w._replace(make_net=make_net)
    batches = throughput.make_batches(w, 8, 3)
    throughput.run_hand(w, "eager-fp32", torch.device("cpu"), batches[:1], batches[1:], 8)
    throughput.run_config(w, "eager-fp32", torch.device("cpu"), batches[:1], batches[1:], 8)
    hand, fit = nets  # the same seeded start, three Adam steps each
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(hand.parameters(), fit.parameters()))
    assert torch.equal(starts[0], starts[1]) and not torch.equal(hand.weight, starts[0])


def test_text_batches_have_one_shape_so_a_compiled_net_compiles_once(throughput):
    w = throughput.workload("translator", 64)
    batches = throughput.make_batches(w, 8, 6)
    assert len({(tuple(b[0][0].shape), tuple(b[1].shape)) for b in batches}) == 1


def test_example_classes_resolve_to_an_imported_module(throughput):
    # torch.compile imports the module of each class it traces; an unregistered one makes it run eagerly
    net = throughput.workload("resnet18", 64).make_net()
    assert all(type(layer).__module__ in sys.modules for layer in net.modules())


def test_unknown_model_is_a_clear_error(throughput):
    with pytest.raises(ValueError, match=r"unknown model 'vgg'; known models: alexnet, resnet18, .*translator"):
        throughput.measure(["vgg"], ["eager-fp32"], ["cpu"])
    with pytest.raises(ValueError, match=r"unknown configuration 'eager-fp16'; known: eager-fp32"):
        throughput.measure(["alexnet"], ["eager-fp16"], ["cpu"])


def test_a_failing_config_is_recorded_not_raised(throughput, monkeypatch):
    run = throughput.run_config

    def bf16_breaks(w, config, *args):
        if config == "eager-bf16":
            raise RuntimeError("bfloat16 unsupported here\nmore detail")
        return run(w, config, *args)

    monkeypatch.setattr(throughput, "run_config", bf16_breaks)
    report = throughput.measure(["logistic_regression"], ["eager-fp32", "eager-bf16"], ["cpu"], batches=1, warmup=0)
    configs = report["devices"]["cpu"]["models"]["logistic_regression"]["configs"]
    assert configs["eager-bf16"] == {"error": "RuntimeError: bfloat16 unsupported here"}
    assert configs["eager-fp32"]["samples_per_s"] > 0
    assert "error" in throughput.table(report, ["eager-fp32", "eager-bf16"])


def test_command_line_rejects_an_unknown_model(throughput, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["throughput.py", "--models", "vgg"])
    with pytest.raises(SystemExit):
        throughput.main()
    assert "invalid choice: 'vgg'" in capsys.readouterr().err


def test_pairs_report_the_median_paired_ratio_and_its_range(throughput, monkeypatch):
    speeds = {"fit": iter([100.0, 300.0, 200.0]), "hand": iter([100.0, 100.0, 400.0])}

    def timed(which):
        return lambda *args: {"samples_per_s": next(speeds[which]), "seconds": 1.0, "batches": 1}

    monkeypatch.setattr(throughput, "run_config", timed("fit"))
    monkeypatch.setattr(throughput, "run_hand", timed("hand"))
    report = throughput.measure(["logistic_regression"], ["eager-fp32"], ["cpu"], 1, 0, hand=True, pairs=3)
    result = report["devices"]["cpu"]["models"]["logistic_regression"]["configs"]["eager-fp32"]
    # paired ratios 1.0, 3.0 and 0.5: their median, not the ratio of the medians (200 / 100)
    assert result["vs_hand"] == 1.0 and result["vs_hand_range"] == [0.5, 3.0]
    assert result["samples_per_s"] == 200.0 and result["hand"]["samples_per_s"] == 100.0
    assert report["pairs"] == 3 and "median of 3 paired runs" in throughput.table(report, ["eager-fp32"])
    with pytest.raises(ValueError, match="pairs"):
        throughput.measure(["logistic_regression"], ["eager-fp32"], ["cpu"], 1, 0, hand=True, pairs=0)

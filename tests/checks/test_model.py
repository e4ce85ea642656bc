"""The model before a run: a note, once per process, when bf16 autocast runs on a CPU that emulates
bfloat16 (the detection is forced here: this machine's CPU may have it)."""

import logging

import pytest

from fitforge.checks import model
from helpers import make_estimator, regression_batches

NOTE = "precision='bf16-mixed' on a CPU without bfloat16 instructions"


@pytest.mark.parametrize("has_bf16", [False, True])
def test_bf16_on_a_cpu_without_bf16_instructions_is_noted_once(monkeypatch, caplog, has_bf16):
    monkeypatch.setattr(model, "_NOTED", set())
    monkeypatch.setattr(model, "cpu_has_bf16", lambda: has_bf16)
    with caplog.at_level(logging.WARNING, logger="fitforge"):
        for _ in range(2):
            make_estimator(precision="bf16-mixed").fit(regression_batches(2), epochs=1)
        make_estimator().fit(regression_batches(2), epochs=1)
    notes = [r.getMessage() for r in caplog.records if NOTE in r.getMessage()]
    assert len(notes) == (0 if has_bf16 else 1)
    if notes:
        assert "several times slower than float32 (precision=None)" in notes[0]
        assert "torch.cpu._is_avx512_bf16_supported()" in notes[0]


@pytest.mark.parametrize(
    "machine, avx512_bf16, amx, expected",
    [
        ("x86_64", False, False, False),
        ("x86_64", True, False, True),
        ("AMD64", False, True, True),
        ("arm64", False, False, True),
    ],
)
def test_the_detection_asks_torch_on_x86_and_judges_no_other_cpu(monkeypatch, machine, avx512_bf16, amx, expected):
    monkeypatch.setattr(model.platform, "machine", lambda: machine)
    monkeypatch.setattr(model.torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(model.torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert model.cpu_has_bf16() is expected

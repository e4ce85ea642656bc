"""benchmarks/gpt_pretrain.py at its debug size on the CPU: every variant trains and is reported against the
hand-written loop (no timing is asserted; the GPU figures are in docs/performance.md)."""

import json

import pytest

from helpers import load_benchmark

pytestmark = pytest.mark.integration  # runs the benchmarks


def test_every_variant_runs_at_debug_size_and_is_compared_with_the_hand_written_loop():
    gpt = load_benchmark("gpt_pretrain")
    report = gpt.measure("debug", "cpu", batch_size=2, steps=2, warmup=1, pairs=1, precision=None, compile=False)
    assert json.loads(json.dumps(report)) == report
    assert list(report["variants"]) == list(gpt.VARIANTS)
    for variant, result in report["variants"].items():
        assert result["tokens_per_s"] > 0 and result["steps"] == 2 and result["peak_memory_gib"] is None
        assert ("vs_hand" in result) == (variant != "hand")
    assert "| fit-muon |" in gpt.table(report)


def test_the_flops_per_token_are_nanogpts_estimate():
    gpt = load_benchmark("gpt_pretrain")
    size = gpt.SIZES["small"]
    net = gpt.GPT(size)
    parameters = sum(p.numel() for p in net.parameters())
    assert 124_000_000 < parameters < 125_000_000  # GPT-2 small, its head tied to the embedding
    assert gpt.flops_per_token(net, size) == 6 * (parameters - 1024 * 768) + 12 * 12 * 768 * 1024

"""GPT pre-training: ``fit`` against a hand-written nanoGPT-style loop on the same device, in tokens/s, MFU
and peak memory; and ``fit`` with activation checkpointing and with Muon.

The model is nanoGPT's GPT in plain torch (learned positions, pre-norm blocks, causal attention through
``F.scaled_dot_product_attention``, a head tied to the embedding). ``--size small`` is GPT-2 small (124M:
12 layers, 12 heads, 768 wide, 1,024 tokens, vocabulary 50,304); ``--size debug`` a toy that runs on a CPU in
seconds (what ``make test`` runs). Batches of random tokens are made in memory beforehand: data loading is
not timed. Both sides train a fresh net from the same seed with AdamW (fused on CUDA), lr 6e-4, betas (0.9,
0.95), weight decay 0.1, under ``--precision`` (bf16 autocast) and optionally ``--compile``; the hand-written
loop is the one nanoGPT's train.py runs (forward and loss under autocast, backward, step,
``zero_grad(set_to_none=True)``). ``fit`` runs lean: ``default_handlers=False``, no metrics.

Variants (``--variants``):
  hand         the hand-written loop (the baseline of the ratios)
  fit          Estimator.fit, the same net, optimizer and precision
  fit-ac       fit with activation_checkpointing=Block (every block recomputed in the backward)
  fit-muon     fit with optimizer=fitforge.optim.muon(net) (Muon for the blocks' matrices, AdamW for the rest)

Each variant warms up (``--warmup`` steps, compiling if asked), then ``--steps`` steps are timed with the
device synchronised at both ends; fit and hand alternate in ``--pairs`` pairs and the median is reported.
MFU = tokens/s x FLOPs per token / the device's peak (nanoGPT's estimate: 6 N + 12 L H Q T per token,
N the parameters less the position embedding); peak memory is ``torch.cuda.max_memory_allocated`` (on a
CPU: not measured).

    python benchmarks/gpt_pretrain.py --size debug                     # CPU, seconds
    python benchmarks/gpt_pretrain.py --device cuda --size small --batch-size 16 --compile --precision bf16-mixed

Nothing is asserted: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fitforge import Estimator
from fitforge.optim import muon
from fitforge.reporting.peak_flops import peak_flops

SEED = 0
VARIANTS = ("hand", "fit", "fit-ac", "fit-muon")


class Size(NamedTuple):
    layers: int
    heads: int
    width: int
    context: int
    vocab: int


SIZES = {"small": Size(12, 12, 768, 1024, 50304), "debug": Size(2, 2, 32, 16, 128)}


class Block(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.heads = size.heads
        self.norm1, self.norm2 = nn.LayerNorm(size.width), nn.LayerNorm(size.width)
        self.qkv, self.proj = nn.Linear(size.width, 3 * size.width), nn.Linear(size.width, size.width)
        self.up, self.down = nn.Linear(size.width, 4 * size.width), nn.Linear(4 * size.width, size.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(size.vocab, size.width), nn.Embedding(size.context, size.width)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, size.vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as GPT-2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def flops_per_token(net: GPT, size: Size) -> float:
    parameters = sum(p.numel() for p in net.parameters()) - net.positions.weight.numel()
    return 6 * parameters + 12 * size.layers * size.heads * (size.width // size.heads) * size.context


def adamw(net: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(net.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(variant: str, size: Size, device: torch.device, batches: list, warmup: int, precision: str | None,
        compile: bool) -> dict[str, Any]:  # fmt: skip
    """Warm up, then time ``len(batches) - warmup`` steps of ``variant`` with a fresh seeded net."""
    torch.manual_seed(SEED)
    if compile:
        torch._dynamo.reset()
    net = GPT(size).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if variant == "hand":
        step = _hand_step(net, adamw(net, device), device, precision, compile)
        for ids, targets in batches[:warmup]:
            step(ids, targets)
        sync(device)
        started = time.perf_counter()
        for ids, targets in batches[warmup:]:
            step(ids, targets)
    else:
        optimizer: Any = muon(net, lr=6e-4) if variant == "fit-muon" else adamw(net, device)
        checkpointing = Block if variant == "fit-ac" else None
        estimator = Estimator(
            net, next_token_loss, optimizer=optimizer, device=device, precision=precision, compile=compile,
            activation_checkpointing=checkpointing,
        )  # fmt: skip
        lean: dict[str, Any] = {"default_handlers": False, "event_handlers": []}
        estimator.fit(batches[:warmup], batches=warmup, **lean)
        sync(device)
        started = time.perf_counter()
        estimator.fit(batches[warmup:], batches=len(batches) - warmup, **lean)
    sync(device)
    seconds = time.perf_counter() - started
    steps = len(batches) - warmup
    tokens = steps * batches[0][0].numel()
    result: dict[str, Any] = {"tokens_per_s": tokens / seconds, "seconds": seconds, "steps": steps}
    peak = peak_flops(device, torch.bfloat16 if precision == "bf16-mixed" else torch.float32)
    result["mfu"] = None if peak is None else result["tokens_per_s"] * flops_per_token(net, size) / peak
    result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return result


def _hand_step(net: GPT, optimizer: torch.optim.Optimizer, device: torch.device, precision: str | None,
               compile: bool) -> Any:  # fmt: skip
    model = torch.compile(net) if compile else net
    autocast = precision == "bf16-mixed"

    def step(ids: torch.Tensor, targets: torch.Tensor) -> None:
        ids, targets = ids.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = next_token_loss(model(ids), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(size_name: str, device_name: str, batch_size: int, steps: int, warmup: int, pairs: int,
            precision: str | None, compile: bool, variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:  # fmt: skip
    """Every variant's median run over ``pairs`` (fit and hand alternating), and each fit's ratio to hand."""
    size, device = SIZES[size_name], torch.device(device_name)
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, size.vocab, (warmup + steps, batch_size, size.context + 1), generator=generator)
    batches = [(row[:, :-1].contiguous(), row[:, 1:].contiguous()) for row in tokens]
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    for pair in range(pairs):
        order = variants if pair % 2 == 0 else tuple(reversed(variants))
        for variant in order:
            runs[variant].append(run(variant, size, device, batches, warmup, precision, compile))
    report: dict[str, Any] = {
        "size": size_name, "device": device_name, "batch_size": batch_size, "context": size.context,
        "steps": steps, "warmup": warmup, "pairs": pairs, "precision": precision, "compile": compile, "variants": {},
    }  # fmt: skip
    if device.type == "cuda":
        report["device_name"] = torch.cuda.get_device_name(device)
    for variant, results in runs.items():
        median = sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2]
        report["variants"][variant] = dict(median)
    hand = report["variants"].get("hand")
    for variant, result in report["variants"].items():
        if hand is not None and variant != "hand":
            ratios = [f["tokens_per_s"] / h["tokens_per_s"] for f, h in zip(runs[variant], runs["hand"])]
            result["vs_hand"] = statistics.median(ratios)
    return report


def table(report: dict[str, Any]) -> str:
    lines = [
        f"GPT {report['size']} on {report.get('device_name', report['device'])}, batch {report['batch_size']} x "
        f"{report['context']} tokens, {report['steps']} steps, precision {report['precision']}, "
        f"compile {report['compile']} (median of {report['pairs']} pairs)",
        "",
        "| variant | tokens/s | vs hand | MFU | peak memory (GiB) |",
        "|---|---|---|---|---|",
    ]
    for variant, r in report["variants"].items():
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        memory = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        ratio = f"{r['vs_hand']:.3f}x" if "vs_hand" in r else "-"
        lines.append(f"| {variant} | {r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {memory} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="debug")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--precision", choices=["bf16-mixed"], default=None)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if min(args.batch_size, args.steps, args.warmup, args.pairs) < 1:
        parser.error("--batch-size, --steps, --warmup and --pairs must be at least 1")
    report = measure(args.size, args.device, args.batch_size, args.steps, args.warmup, args.pairs, args.precision,
                     args.compile, tuple(args.variants))  # fmt: skip
    print(json.dumps(report, indent=2) if args.json else table(report))


if __name__ == "__main__":
    main()

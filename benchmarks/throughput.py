"""Training throughput of the canonical models in samples/s: eager vs compiled, float32 vs bfloat16.

Each model of ``examples/`` is trained as its script builds it (the same net, loss and batch
processor; Adam, lr 1e-3, for all) on batches from its own generator in ``examples/data.py``, in
four configurations of ``Estimator``:
  eager-fp32     precision=None,         compile=False  (the baseline)
  eager-bf16     precision="bf16-mixed", compile=False
  compiled-fp32  precision=None,         compile=True
  compiled-bf16  precision="bf16-mixed", compile=True
Every configuration gets a fresh net from the same seed and runs the lean loop,
``fit(..., batches=N, default_handlers=False, event_handlers=[])``: forward, loss, backward and
optimizer step, with no metrics, logging or validation. A first fit over ``--warmup`` batches is not
timed (torch.compile compiles there: about 30 s per model and configuration on a CPU); then a fit
over ``--batches`` batches is timed with ``time.perf_counter`` (CUDA synchronised at both ends).
The batches are built in memory beforehand, so data loading is not timed. Text batches are padded
to the dataset's longest sequence (the examples pad per batch): one shape, so a compiled net
compiles once, in the warm-up.

    python benchmarks/throughput.py                  # all models, 4 configs: CPU, and CUDA when present
    python benchmarks/throughput.py --quick          # eager only, 1 warm-up and 2 timed batches
    python benchmarks/throughput.py --models alexnet translator --configs eager-fp32 compiled-fp32 --table

Reading the output (JSON, or a markdown table with ``--table``): per device, model and configuration,
``samples_per_s`` = timed batches x batch size / ``seconds``, and ``speedup`` = samples/s over the
same model's eager-fp32 (above 1: faster). A configuration that failed has an ``error`` instead; one
whose net could not compile (fitforge then runs it eagerly) lists that under ``warnings``. Figures
use ``--threads`` CPU threads (default 1, comparable across machines); the models are small, so on a
GPU they mostly measure per-step overhead. A run is one sample of ``--batches`` batches: on a busy
machine the figures move by 10-20% between runs, so raise ``--batches`` for steadier ones. Inductor
caches compiled kernels on disk, so a second run spends far less time compiling (not in the figures).

``--hand`` also times a hand-written loop in each configuration, right before or after the fit (the
order alternates between configurations), for the models trained by a plain step (one loss, no batch
processor: the CNNs, TextCNN, logistic regression): the same fresh seeded net and Adam, each batch
copied to the device without blocking, forward and loss under ``torch.autocast`` for bf16, the net
through ``torch.compile`` when compiled, then backward, step and ``zero_grad(set_to_none=True)``.
Its result is under ``hand`` and ``vs_hand`` = fit's samples/s over the hand-written loop's (1.0:
no cost; the target is at least 0.98). One pair of such short runs moves by up to 25% on a GPU (a
clock or allocator moment falls on one side), so ``--pairs N`` times N pairs per configuration and
reports the median run of each side, ``vs_hand`` the median of the N paired ratios and
``vs_hand_range`` their spread.

Nothing is asserted: this is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import logging
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fitforge import BatchProcessor, Estimator

SEED = 0
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIGS = {
    "eager-fp32": (None, False),
    "eager-bf16": ("bf16-mixed", False),
    "compiled-fp32": (None, True),
    "compiled-bf16": ("bf16-mixed", True),
}  # name: (precision, compile)
BASELINE = "eager-fp32"
MODELS = (
    "alexnet",
    "resnet18",
    "fcn_segmentation",
    "ssd_detection",
    "birnn_sentiment",
    "textcnn_sentiment",
    "translator",
    "logistic_regression",
)
log = logging.getLogger("throughput")


class Workload(NamedTuple):
    make_net: Callable[[], nn.Module]
    loss: Any
    make_processor: Callable[[], BatchProcessor | None]
    dataset: Dataset
    collate: Callable | None
    batch_size: int  # the example's own default


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py``; its folder goes on sys.path so it finds ``common`` and ``data``.

    The module is registered in ``sys.modules``: torch.compile imports the module of every class it
    traces (ResNet-18's ``BasicBlock``), and an unregistered one makes it fall back to eager.
    """
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    module_name = f"throughput_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


def fixed_padding(data: ModuleType, dataset: Any) -> Callable:
    """``data.pad_sequences``, then padded further to the dataset's longest source (and target)."""
    source = max(len(s) for s in dataset.sequences)
    target = max(label.numel() for label in dataset.labels)

    def collate(samples: list) -> tuple:
        (ids, lengths), labels = data.pad_sequences(samples)
        if labels.dim() == 2:  # target sequences (translator); class labels stay (N,)
            labels = F.pad(labels, (0, target - labels.shape[1]), value=data.PAD)
        return (F.pad(ids, (0, source - ids.shape[1]), value=data.PAD), lengths), labels

    return collate


def workload(name: str, samples: int) -> Workload:
    """The example's net, loss, processor and training set (generated with about ``samples`` samples)."""
    ex = load_example(name)
    data, n = ex.data, min(max(samples, 64), 4096)  # beyond 4096, batches repeat (make_batches cycles)
    plain, ce = (lambda: None), nn.CrossEntropyLoss()
    if name in ("alexnet", "resnet18"):
        make = ex.alexnet if name == "alexnet" else ex.resnet18
        return Workload(make, ce, plain, data.digits(size=ex.IMAGE_SIZE, seed=SEED)[0], None, 32)
    if name == "fcn_segmentation":
        train = data.shapes_segmentation(n_train=n, n_val=1, seed=SEED)[0]
        return Workload(lambda: ex.FCN(ex.NUM_CLASSES), ce, plain, train, None, 16)
    if name == "ssd_detection":
        train = data.shape_detection(n_train=n, n_val=1, size=ex.IMAGE_SIZE, seed=SEED)[0]
        return Workload(
            lambda: ex.SSD(ex.NUM_CLASSES),
            [ex.class_loss, ex.box_loss],
            lambda: ex.SSDProcessor(ex.make_anchors()),
            train,
            ex.pad_boxes,
            16,
        )
    if name in ("birnn_sentiment", "textcnn_sentiment"):
        train, _, vocab = data.sentiment(n_train=n, n_val=1, seed=SEED)
        if name == "birnn_sentiment":  # the lengths stay on the CPU, as in the example
            return Workload(
                lambda: ex.BiRNNClassifier(len(vocab)),
                ce,
                lambda: BatchProcessor(host_inputs=(1,)),
                train,
                fixed_padding(data, train),
                64,
            )
        return Workload(lambda: ex.TextCNN(len(vocab)), ce, plain, train, fixed_padding(data, train), 64)
    if name == "translator":
        train, _, vocab = data.dates(n_train=n, n_val=1, seed=SEED)
        return Workload(
            lambda: ex.Translator(len(vocab), len(data.DATE_TARGET)),
            nn.CrossEntropyLoss(ignore_index=data.PAD),
            lambda: ex.TeacherForcing(host_inputs=(1,)),
            train,
            fixed_padding(data, train),
            64,
        )
    if name == "logistic_regression":
        return Workload(
            lambda: nn.Linear(30, 1), nn.BCEWithLogitsLoss(), plain, data.breast_cancer(seed=SEED)[0], None, 32
        )
    raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")


def make_batches(w: Workload, batch_size: int, count: int) -> list:
    """``count`` full batches from a seeded shuffle of the dataset, cycled when it holds fewer."""
    loader = DataLoader(
        w.dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=w.collate,
        generator=torch.Generator().manual_seed(SEED),
    )
    pool = list(loader)
    if not pool:
        raise ValueError(f"batch size {batch_size} exceeds the {len(w.dataset)} samples of the dataset")  # type: ignore[arg-type]
    return list(itertools.islice(itertools.cycle(pool), count))


def sync(device: torch.device) -> None:
    if device.type == "cuda":  # CUDA runs asynchronously: wait until the queued steps are done
        torch.cuda.synchronize(device)


def run_config(w: Workload, config: str, device: torch.device, warm: list, timed: list, batch_size: int) -> dict:
    """Warm up, then time ``len(timed)`` batches of one configuration with a fresh seeded net."""
    precision, compiled = CONFIGS[config]
    if compiled:
        torch._dynamo.reset()  # each compiled configuration compiles from scratch, as in a new process
    torch.manual_seed(SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimator = Estimator(
            w.make_net(),
            w.loss,
            optimizer="adam",
            device=device,
            precision=precision,
            compile=compiled,
            batch_processor=w.make_processor(),
        )
        if warm:
            estimator.fit(warm, batches=len(warm), default_handlers=False, event_handlers=[])
        sync(device)
        started = time.perf_counter()
        estimator.fit(timed, batches=len(timed), default_handlers=False, event_handlers=[])
        sync(device)
        seconds = time.perf_counter() - started
    result: dict[str, Any] = {
        "samples_per_s": round(len(timed) * batch_size / seconds, 1),
        "seconds": round(seconds, 6),
        "batches": len(timed),
    }
    # torch's own deprecation notices during compilation say nothing about this configuration
    notes = sorted(
        {
            str(c.message).splitlines()[0][:200]
            for c in caught
            if not issubclass(c.category, (DeprecationWarning, FutureWarning))
        }
    )
    if notes:
        result["warnings"] = notes
    return result


def hand_written(w: Workload) -> bool:
    """Whether the model trains by a plain step a hand-written loop can repeat: one loss, no processor."""
    return w.make_processor() is None and not isinstance(w.loss, (list, tuple, dict))


def run_hand(w: Workload, config: str, device: torch.device, warm: list, timed: list, batch_size: int) -> dict:
    """:func:`run_config`'s measurement of a hand-written loop doing the same training."""
    precision, compiled = CONFIGS[config]
    if compiled:
        torch._dynamo.reset()
    torch.manual_seed(SEED)
    net = w.make_net().to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)  # fit's "adam"
    model = torch.compile(net) if compiled else net
    blocking = device.type != "cuda"

    def train(batches: list) -> None:
        model.train()
        for x, y in batches:
            inputs = [t.to(device, non_blocking=not blocking) for t in (x if isinstance(x, (tuple, list)) else (x,))]
            y = y.to(device, non_blocking=not blocking)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = w.loss(model(*inputs), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    train(warm)
    sync(device)
    started = time.perf_counter()
    train(timed)
    sync(device)
    seconds = time.perf_counter() - started
    return {"samples_per_s": round(len(timed) * batch_size / seconds, 1), "seconds": round(seconds, 6)}


def input_shapes(batch: tuple) -> list[list[int]]:
    inputs = batch[0] if isinstance(batch[0], (tuple, list)) else (batch[0],)
    return [list(x.shape) for x in inputs]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # platform.processor() is often empty or just the architecture on Linux
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_run(runs: list[dict]) -> dict:
    """The run with the median samples/s (the first error when every run failed)."""
    done = sorted((r for r in runs if "samples_per_s" in r), key=lambda r: r["samples_per_s"])
    return dict(done[(len(done) - 1) // 2]) if done else dict(runs[0])


def measure_model(
    name: str,
    configs: Sequence[str],
    device: torch.device,
    batches: int,
    warmup: int,
    batch_size: int | None,
    hand: bool = False,
    pairs: int = 1,
) -> dict:
    """One model's batch size, input shapes and result per configuration, with speedups (and with
    ``hand``, the hand-written loop's result and fit's ratio to it, the median of ``pairs`` pairs)."""
    w = workload(name, (warmup + batches) * (batch_size or 64))
    size = batch_size or w.batch_size
    pool = make_batches(w, size, warmup + batches)
    results: dict[str, dict] = {}
    for i, config in enumerate(configs):
        log.info("%s %s %s", device, name, config)
        runs = {"fit": run_config, "hand": run_hand} if hand and hand_written(w) else {"fit": run_config}
        tries: dict[str, list[dict]] = {which: [] for which in runs}
        for pair in range(pairs if len(runs) > 1 else 1):
            order = list(runs) if (i + pair) % 2 == 0 else list(runs)[::-1]  # paired; who goes first alternates
            for which in order:
                try:
                    tries[which].append(runs[which](w, config, device, pool[:warmup], pool[warmup:], size))
                except Exception as error:  # one failing configuration must not lose the others' figures
                    first_line = (str(error).strip().splitlines() or [""])[0][:300]
                    tries[which].append({"error": f"{type(error).__name__}: {first_line}"})
        results[config] = median_run(tries["fit"])
        if "hand" in tries:
            results[config]["hand"] = median_run(tries["hand"])
            ratios = [
                f["samples_per_s"] / h["samples_per_s"]
                for f, h in zip(tries["fit"], tries["hand"])
                if "samples_per_s" in f and "samples_per_s" in h
            ]
            if ratios:  # the median of paired ratios: a slow moment of the machine hits one pair, not the result
                results[config]["vs_hand"] = round(statistics.median(ratios), 3)
                if len(ratios) > 1:
                    results[config]["vs_hand_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    base = results.get(BASELINE, {}).get("samples_per_s")
    for config, result in results.items():
        if config != BASELINE and base and "samples_per_s" in result:
            result["speedup"] = round(result["samples_per_s"] / base, 3)
    return {"batch_size": size, "input_shapes": input_shapes(pool[0]), "configs": results}


def measure(
    models: Sequence[str],
    configs: Sequence[str],
    devices: Sequence[str],
    batches: int = 20,
    warmup: int = 3,
    batch_size: int | None = None,
    hand: bool = False,
    pairs: int = 1,
) -> dict:
    """Samples/s of each model in each configuration on each device (see the module docstring).

    Raises:
        ValueError: an unknown model or configuration name, or a count below 1 (``warmup`` below 0).
    """
    for name in models:
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    for config in configs:
        if config not in CONFIGS:
            raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")
    if batches < 1 or pairs < 1 or warmup < 0 or (batch_size is not None and batch_size < 1):
        raise ValueError(
            f"batches, pairs and batch_size must be >= 1 and warmup >= 0, got {batches}, {pairs}, {batch_size}"
            f" and {warmup}"
        )
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "warmup": warmup,
        "batches": batches,
        "pairs": pairs if hand else 1,
        "devices": {},
    }
    for device in map(torch.device, devices):
        models_report = {
            name: measure_model(name, configs, device, batches, warmup, batch_size, hand, pairs) for name in models
        }
        report["devices"][str(device)] = {"name": device_name(device), "models": models_report}
    return report


def cell(result: dict) -> str:
    """``1,234 (1.10x)``; ``error``; ``(eager fallback)`` marks a net that ran uncompiled."""
    if "error" in result:
        return "error"
    text = f"{result['samples_per_s']:,.0f}" + (f" ({result['speedup']:.2f}x)" if "speedup" in result else "")
    if "vs_hand" in result:
        text += f" [{result['vs_hand']:.3f}x hand]"
    elif "error" in result.get("hand", {}):
        text += " [hand: error]"
    fell_back = any("could not compile" in note for note in result.get("warnings", ()))
    return text + (" (eager fallback)" if fell_back else "")


def table(report: dict, configs: Sequence[str]) -> str:
    """The report as one markdown table per device, failed configurations listed under it."""
    lines = []
    for device, result in report["devices"].items():
        paired = f", median of {report['pairs']} paired runs" if report["pairs"] > 1 else ""
        title = (
            f"**{device}** ({result['name']}), torch {report['torch']}, {report['threads']} thread(s), "
            f"{report['warmup']} warm-up + {report['batches']} timed batches; samples/s (speedup vs {BASELINE})"
            f" [fit / hand-written loop{paired}]"
        )
        lines += [title, "", "| model | batch | " + " | ".join(configs) + " |", "|---|---:|" + "---:|" * len(configs)]
        for name, entry in result["models"].items():
            cells = " | ".join(cell(entry["configs"][config]) for config in configs)
            lines.append(f"| {name} | {entry['batch_size']} | {cells} |")
        lines += [
            f"- {name} {config}{which}: {r['error']}"
            for name, entry in result["models"].items()
            for config, fit in entry["configs"].items()
            for which, r in (("", fit), (" (hand-written)", fit.get("hand", {})))
            if "error" in r
        ]
        lines.append("")
    return "\n".join(lines)


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None, help="default: all four")
    parser.add_argument("--batches", type=count(1), default=None, help="timed batches per configuration (default 20)")
    parser.add_argument("--warmup", type=count(0), default=None, help="untimed batches before them (default 3)")
    parser.add_argument("--batch-size", type=count(1), default=None, help="default: each example's own")
    parser.add_argument("--device", default=None, help="default: cpu, and cuda too when available")
    parser.add_argument("--threads", type=count(1), default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: eager configs, 1 warm-up + 2 timed batches")
    parser.add_argument("--table", action="store_true", help="print a markdown table instead of JSON")
    parser.add_argument("--hand", action="store_true", help="also time a hand-written loop (plain-step models)")
    parser.add_argument(
        "--pairs", type=count(1), default=1, help="with --hand: fit/loop pairs per configuration, median (default 1)"
    )
    args = parser.parse_args()
    configs = args.configs or (["eager-fp32", "eager-bf16"] if args.quick else list(CONFIGS))
    batches = args.batches or (2 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    devices = [args.device] if args.device else ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    torch.set_num_threads(args.threads)
    logging.basicConfig(format="%(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)  # progress on stderr; stdout carries only the result
    report = measure(args.models, configs, devices, batches, warmup, args.batch_size, args.hand, args.pairs)
    print(table(report, configs) if args.table else json.dumps(report))


if __name__ == "__main__":
    main()

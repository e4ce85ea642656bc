"""Instructions executed per training step by ``fit()`` and by the hand-written loop (valgrind).

Wall-clock ratios on a shared machine wobble by more than fitforge's overhead; counted instructions
do not move with the load: runs of this script agree within about 0.2% of a step. It runs the variants and
workloads of ``benchmarks/overhead.py`` (fit default, hand + val, fit lean, hand), each in its own
process under ``valgrind --tool=callgrind`` with counting off, and switches counting on around one
whole run (``fit(...)`` or the loop; every epoch, validation and the fit's set-up included) after an
uncounted warm-up run, through callgrind's client requests from a tiny C helper compiled on the fly.

    python benchmarks/instructions.py                  # workload A, all four variants (~5 min)
    python benchmarks/instructions.py --workload B --fraction 0.25
    python benchmarks/instructions.py --workload Z     # the fixed cost of a fit: 20 fits of one step counted
    python benchmarks/instructions.py --json

It prints instructions per training step for each variant, the ratios fit/hand of the same pairs
as overhead.py and the extra instructions per step. Instructions are a proxy for time, not time:
they ignore cache misses and how fast each instruction runs, but they count every Python bytecode
and every torch dispatch fitforge adds. Needs Linux, valgrind with its headers
(``valgrind/callgrind.h``) and a C compiler; says so and exits otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

HELPER_C = """#include <valgrind/callgrind.h>
void count_on(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void count_off(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""


COUNTED_RUNS = {"Z": 20}  # counted runs per process (one for A and B, whose runs are long)


def load_overhead():
    """benchmarks/overhead.py as a module: the workloads and variants are its own."""
    spec = importlib.util.spec_from_file_location("overhead_benchmark", Path(__file__).with_name("overhead.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_helper(folder: Path) -> Path:
    """Compile the counting switch; exit with the reason when the tools are missing."""
    missing = [tool for tool in ("valgrind", "cc") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"instructions.py needs {' and '.join(missing)} on PATH (e.g. apt install valgrind gcc)")
    source, library = folder / "count.c", folder / "libcount.so"
    source.write_text(HELPER_C)
    built = subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source)], capture_output=True, text=True, check=False
    )
    if built.returncode != 0:
        sys.exit(f"could not build the callgrind switch (are valgrind's headers installed?):\n{built.stderr}")
    return library


def child(variant: str, workload: str, fraction: float, library: str) -> None:
    """Inside valgrind: a warm-up run, then one counted run of ``variant``."""
    import torch

    import fitforge.handlers.defaults

    overhead = load_overhead()
    torch.set_num_threads(1)
    logging.getLogger("fitforge").setLevel(logging.WARNING)
    switch = ctypes.CDLL(library)
    w = overhead.WORKLOADS[workload]
    train, val = overhead.make_loaders(w, fraction)
    with mock.patch.object(fitforge.handlers.defaults, "interactive", lambda: False):
        overhead.prepare(variant, w, train, val)()  # lazy initialisations (kernels, pools) are not counted
        # A fit of Z is short: several are counted so that one garbage collection, wherever it falls,
        # moves the mean little (collected before counting, too).
        runs = [overhead.prepare(variant, w, train, val) for _ in range(COUNTED_RUNS.get(workload, 1))]
        gc.collect()
        switch.count_on()
        for run in runs:
            run()
        switch.count_off()
    print(json.dumps({"steps": len(runs) * w.epochs * len(train)}))


def count(variant: str, workload: str, fraction: float, library: Path, folder: Path) -> dict:
    """Instructions of one counted run of ``variant``, from its own valgrind process."""
    out = folder / ("callgrind." + variant.replace(" ", "_").replace("+", "plus"))
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        __file__,
        "--child",
        variant,
        "--workload",
        workload,
        "--fraction",
        str(fraction),
        "--library",
        str(library),
    ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"},
    )
    dump = Path(f"{out}.1")
    if done.returncode != 0 or not dump.exists():
        raise RuntimeError(f"{variant}: valgrind run failed:\n{done.stderr[-2000:]}")
    totals = next(line for line in dump.read_text().splitlines() if line.startswith("totals:"))
    steps = json.loads(done.stdout.strip().splitlines()[-1])["steps"]
    return {"instructions": int(totals.split()[1]), "steps": steps}


def measure(workload: str, fraction: float, jobs: int) -> dict:
    overhead = load_overhead()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        library = build_helper(folder)
        with ThreadPoolExecutor(jobs) as pool:  # counts do not depend on load: run variants side by side
            futures = {v: pool.submit(count, v, workload, fraction, library, folder) for v in overhead.VARIANTS}
            runs = {v: f.result() for v, f in futures.items()}
    per_step = {v: r["instructions"] / r["steps"] for v, r in runs.items()}
    pairs = {
        f"{fit} / {hand}": {"ratio": per_step[fit] / per_step[hand], "extra_per_step": per_step[fit] - per_step[hand]}
        for fit, hand in overhead.PAIRS
    }
    return {
        "workload": workload,
        "title": overhead.WORKLOADS[workload].title,
        "fraction": fraction,
        "steps": runs["hand"]["steps"],
        "instructions_per_step": per_step,
        "pairs": pairs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["A", "B", "Z"], default="A")
    parser.add_argument("--fraction", type=float, default=1.0, help="share of the workload's data (default 1)")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind processes at once (default 2)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the variant a valgrind process runs
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 < args.fraction <= 1:
        parser.error("--fraction must be in (0, 1]")
    if args.child:
        child(args.child, args.workload, args.fraction, args.library)
        return
    result = measure(args.workload, args.fraction, args.jobs)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"Workload {result['workload']}: {result['title']}, {result['steps']} training steps "
        f"(fraction {result['fraction']}), instructions per training step, whole run counted:"
    )
    for variant, n in result["instructions_per_step"].items():
        print(f"  {variant:<12} {n:12,.0f}")
    for pair, c in result["pairs"].items():
        print(f"  {pair:<24} {c['ratio']:.4f}x  ({c['extra_per_step']:+,.0f} instructions per step)")


if __name__ == "__main__":
    main()

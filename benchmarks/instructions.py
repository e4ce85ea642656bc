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
    python benchmarks/instructions.py --pieces         # where a fit of Z goes: each piece, per call
    python benchmarks/instructions.py --workload Z --sample-reads  # fit reads batches as the hand loop
    python benchmarks/instructions.py --trackers       # and fit default with MLflow, TensorBoard and W&B on
    python benchmarks/instructions.py --profiler       # and fit default with a ProfilerHandler between cycles
    python benchmarks/instructions.py --json

``--trackers`` adds two variants: fit default with MLflowHandler (a SQLite store), TensorBoardHandler
and WandbHandler (offline) on, whose runs they start and end ("fit + trackers"), and the same with
the MLflow and W&B runs started before and ended after the counted fit, as a user who starts them
does ("fit + open trackers": what the handlers add, without the trackers' own start-up); both are
compared with fit default (needs the [mlflow], [tensorboard] and [wandb] extras).

``--profiler`` adds fit default with a ProfilerHandler whose first cycle would begin after the run's last
step ("fit + idle profiler"): what the handler costs outside its cycles, every step of a long run but a few.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from unittest import mock

HELPER_C = """#include <valgrind/callgrind.h>
void count_on(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void count_off(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""


COUNTED_RUNS = {"Z": 20}  # counted runs per process (one for A and B, whose runs are long)
TRACKED, OPEN_TRACKED = "fit + trackers", "fit + open trackers"
TRACKER_PAIRS = ((TRACKED, "fit default"), (OPEN_TRACKED, "fit default"))
IDLE_PROFILED = "fit + idle profiler"
PROFILER_PAIRS = ((IDLE_PROFILED, "fit default"),)
TRACKER_ENV = {  # offline, quiet, every file in the run's folder; W&B's start-up slowed by valgrind is no timeout
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",
    "WANDB_INIT_TIMEOUT": "600",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}


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


def tracked(overhead, variant: str, w, train, val, folder: Path, after: list[Callable[[], object]]) -> Callable:
    """A fresh run of fit default with the three trackers; for ``OPEN_TRACKED`` the MLflow and W&B runs
    start here and end in ``after``, outside the count. Their files go to ``folder``."""
    import mlflow
    import wandb

    from fitforge import Estimator
    from fitforge.handlers import MLflowHandler, TensorBoardHandler, WandbHandler

    net, opt, criterion = overhead.fresh_model(w)
    est = Estimator(net, criterion, train_metrics="accuracy", optimizer=opt)
    uri = f"sqlite:///{folder}/mlflow.db"
    trackers = [MLflowHandler(uri), TensorBoardHandler(folder / "tb"), WandbHandler(dir=str(folder))]
    if variant == OPEN_TRACKED:
        mlflow.set_tracking_uri(uri)
        mlflow.start_run()
        wandb.init(dir=str(folder))
        after.extend([wandb.finish, mlflow.end_run])
    return lambda: est.fit(train, val_data=val, epochs=w.epochs, event_handlers=trackers)["train_loss"][-1]


def idle_profiled(overhead, w, train, val, folder: Path) -> Callable:
    """A fresh run of fit default with a ProfilerHandler that waits past the run's last step."""
    from fitforge import Estimator
    from fitforge.handlers import ProfilerHandler

    net, opt, criterion = overhead.fresh_model(w)
    est = Estimator(net, criterion, train_metrics="accuracy", optimizer=opt)
    tracer = ProfilerHandler(wait=w.epochs * len(train), log_dir=folder / "profile")
    return lambda: est.fit(train, val_data=val, epochs=w.epochs, event_handlers=[tracer])["train_loss"][-1]


def child(variant: str, workload: str, fraction: float, library: str, sample_reads: bool) -> None:
    """Inside valgrind: a warm-up run, then one counted run of ``variant``."""
    import torch

    import fitforge.handlers.defaults

    overhead = load_overhead()
    torch.set_num_threads(1)
    logging.getLogger("fitforge").setLevel(logging.WARNING)
    switch = ctypes.CDLL(library)
    w = overhead.WORKLOADS[workload]
    train, val = overhead.make_loaders(w, fraction, sample_reads=sample_reads)
    after: list[Callable[[], object]] = []  # what ends a run's trackers, uncounted
    if variant in (TRACKED, OPEN_TRACKED):
        folder = Path(library).with_name(variant.replace(" ", "_").replace("+", "plus"))
        folder.mkdir()
        shutil.copy(Path(library).with_name("mlflow.db"), folder / "mlflow.db")

        def prepare(*args):
            return tracked(overhead, variant, *args, folder, after)
    elif variant == IDLE_PROFILED:

        def prepare(*args):
            return idle_profiled(overhead, *args, Path(library).parent)
    else:

        def prepare(*args):
            return overhead.prepare(variant, *args)

    def end_trackers() -> None:
        while after:
            after.pop(0)()

    with mock.patch.object(fitforge.handlers.defaults, "interactive", lambda: False):
        prepare(w, train, val)()  # lazy initialisations (kernels, pools) are not counted
        end_trackers()
        # A fit of Z is short: several are counted so that one garbage collection, wherever it falls,
        # moves the mean little (collected before counting, too).
        runs = [prepare(w, train, val) for _ in range(COUNTED_RUNS.get(workload, 1))]
        gc.collect()
        switch.count_on()
        for run in runs:
            run()
        switch.count_off()
        end_trackers()
    print(json.dumps({"steps": len(runs) * w.epochs * len(train)}))


PIECE_CALLS = 20  # calls of each piece counted together


def pieces(overhead) -> dict:
    """The pieces of a fit of workload Z, as calls on one estimator that has fitted once (each piece
    as fit runs it; the names say what each does), and the check before training on workload B's
    CNN beside its forward. Built inside the valgrind process."""
    import torch

    from fitforge import Estimator
    from fitforge.checks.first_batch import check_handlers, explained_step
    from fitforge.checks.model import check_placement, check_trainable
    from fitforge.checks.validation import check_first_val_batch, first_samples
    from fitforge.core.batches import check_finite
    from fitforge.core.dispatch import Dispatcher
    from fitforge.core.modules import set_training
    from fitforge.core.rng import torch_rng_kept
    from fitforge.core.run import inference
    from fitforge.core.state import TrainState
    from fitforge.handlers.defaults import fit_handlers
    from fitforge.inputs.order import DataOrder

    w = overhead.WORKLOADS["Z"]
    train, val = overhead.make_loaders(w, 1.0)
    net, opt, criterion = overhead.fresh_model(w)
    est = Estimator(net, criterion, train_metrics="accuracy", optimizer=opt)
    est.fit(train, val_data=val, epochs=1)
    evaluation = est.evaluation(val, [])
    batch = first_samples(val)
    state = TrainState(est, "validate", batch_idx=0, batch=batch)
    state.output = evaluation.step(state, batch)
    checks = evaluation.services.first_batch_checks  # the evaluation's handlers' first-batch checks

    def armed_step() -> None:
        est.losses.validate.arm_checks()
        explained_step(state, evaluation.step, batch)

    def block(context: AbstractContextManager) -> None:
        with context:  # entered and left, as the check does around its step
            pass

    def in_inference_mode(step: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():  # as the check runs its step: no autograd graph recorded
                step()

        return run

    # The check on workload B's CNN, whose forward costs more than the checks around it.
    cnn = overhead.WORKLOADS["B"]
    _, cnn_val = overhead.make_loaders(cnn, 1.0)
    cnn_net, cnn_opt, cnn_criterion = overhead.fresh_model(cnn)
    cnn_est = Estimator(cnn_net, cnn_criterion, train_metrics="accuracy", optimizer=cnn_opt)
    cnn_evaluation = cnn_est.evaluation(cnn_val, [])
    cnn_batch = first_samples(cnn_val)
    cnn_state = TrainState(cnn_est, "validate", batch_idx=0, batch=cnn_batch)

    checked = est.evaluation(val, [], checked=True)
    return {
        "fit, default handlers (this estimator again)": lambda: est.fit(train, val_data=val, epochs=1),
        "hand-written loop + validation": lambda: overhead.hand_loop(net, opt, criterion, train, val, 1),
        "validation check before training": lambda: check_first_val_batch(
            est, val, "val_data", checks, evaluation.step
        ),
        "  its step: forward and loss of 2 samples": lambda: evaluation.step(state, batch),
        "  its step under inference_mode (as the check runs it)": in_inference_mode(
            lambda: evaluation.step(state, batch)
        ),
        "  its step with the loss's first-call checks": armed_step,
        "  its first 2 samples": lambda: first_samples(val),
        "  its nan/inf check": lambda: check_finite(batch, "val_data"),
        "  its metric trials (handlers' check_first_batch)": lambda: check_handlers(state, checks),
        "  its kept random state (a torch_rng_kept block)": lambda: block(torch_rng_kept(est.device)),
        "  its eval mode and inference_mode (an inference block)": lambda: block(inference(est.val_net)),
        "B's CNN: validation check before training": lambda: check_first_val_batch(
            cnn_est, cnn_val, "val_data", cnn_evaluation.services.first_batch_checks, cnn_evaluation.step
        ),
        "  its step under inference_mode": in_inference_mode(lambda: cnn_evaluation.step(cnn_state, cnn_batch)),
        "validation set-up (Estimator.evaluation)": lambda: est.evaluation(val, []),
        "validation pass (checked before)": checked,
        "default handlers built": lambda: fit_handlers(None, val, True),
        "default handlers ordered (Dispatcher)": lambda: Dispatcher(fit_handlers(None, val, True)),
        "placement check (net, val_net)": lambda: check_placement(est, "net", "val_net"),
        "trainable-parameter check": lambda: check_trainable(est),
        "data order (DataOrder)": lambda: DataOrder(train),
        "train mode, fitforge (set_training)": lambda: set_training(net, True),
        "train mode, torch (net.train())": lambda: net.train(),
    }


def pieces_child(library: str) -> None:
    """Inside valgrind: each piece called PIECE_CALLS times with counting on, one dump per piece."""
    import torch

    import fitforge.handlers.defaults

    overhead = load_overhead()
    torch.set_num_threads(1)
    logging.getLogger("fitforge").setLevel(logging.WARNING)
    switch = ctypes.CDLL(library)
    with mock.patch.object(fitforge.handlers.defaults, "interactive", lambda: False):
        calls = pieces(overhead)
        for call in calls.values():
            call()  # warm-up, uncounted
            gc.collect()
            switch.count_on()
            for _ in range(PIECE_CALLS):
                call()
            switch.count_off()
    print(json.dumps(list(calls)))


def under_valgrind(out: Path, what: str, *arguments: str) -> str:
    """Run this script with ``arguments`` under callgrind (counting only where the child switches it
    on), its dumps at ``out.1``, ``out.2``...; returns the child's stdout. ``what`` names it in errors."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        __file__,
        *arguments,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", **TRACKER_ENV}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0 or not Path(f"{out}.1").exists():
        raise RuntimeError(f"{what}: valgrind run failed:\n{done.stderr[-2000:]}")
    return done.stdout


def counted(dump: Path) -> int:
    """The instructions one callgrind dump counted."""
    return int(next(line for line in dump.read_text().splitlines() if line.startswith("totals:")).split()[1])


def count_pieces(library: Path, folder: Path) -> dict[str, float]:
    """Instructions per call of each piece of :func:`pieces`, from one valgrind process."""
    out = folder / "callgrind.pieces"
    stdout = under_valgrind(out, "pieces", "--pieces-child", "--library", str(library))
    names = json.loads(stdout.strip().splitlines()[-1])
    return {name: counted(Path(f"{out}.{i}")) / PIECE_CALLS for i, name in enumerate(names, 1)}


def count(variant: str, workload: str, fraction: float, library: Path, folder: Path, sample_reads: bool) -> dict:
    """Instructions of one counted run of ``variant``, from its own valgrind process."""
    out = folder / ("callgrind." + variant.replace(" ", "_").replace("+", "plus"))
    arguments = ["--child", variant, "--workload", workload, "--fraction", str(fraction), "--library", str(library)]
    arguments += ["--sample-reads"] if sample_reads else []
    stdout = under_valgrind(out, variant, *arguments)
    steps = json.loads(stdout.strip().splitlines()[-1])["steps"]
    return {"instructions": counted(Path(f"{out}.1")), "steps": steps}


def mlflow_store(path: Path) -> None:
    """Create MLflow's SQLite store at ``path`` outside valgrind: its schema migrations take minutes there."""
    import mlflow

    with mock.patch.dict(os.environ, TRACKER_ENV):
        mlflow.MlflowClient(f"sqlite:///{path}").search_experiments()


def measure(
    workload: str,
    fraction: float,
    jobs: int,
    sample_reads: bool = False,
    trackers: bool = False,
    profiler: bool = False,
) -> dict:
    overhead = load_overhead()
    extra_pairs = (TRACKER_PAIRS if trackers else ()) + (PROFILER_PAIRS if profiler else ())
    variants = overhead.VARIANTS + tuple(fit for fit, _ in extra_pairs)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        library = build_helper(folder)
        if trackers:
            mlflow_store(folder / "mlflow.db")
        with ThreadPoolExecutor(jobs) as pool:  # counts do not depend on load: run variants side by side
            futures = {v: pool.submit(count, v, workload, fraction, library, folder, sample_reads) for v in variants}
            runs = {v: f.result() for v, f in futures.items()}
    per_step = {v: r["instructions"] / r["steps"] for v, r in runs.items()}
    pairs = {
        f"{fit} / {hand}": {"ratio": per_step[fit] / per_step[hand], "extra_per_step": per_step[fit] - per_step[hand]}
        for fit, hand in overhead.PAIRS + extra_pairs
    }
    return {
        "workload": workload,
        "title": overhead.WORKLOADS[workload].title,
        "fraction": fraction,
        "sample_reads": sample_reads,
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
    parser.add_argument(
        "--sample-reads", action="store_true", help="fit reads the batches sample by sample, as the hand loop"
    )
    parser.add_argument(
        "--pieces", action="store_true", help="instructions per call of each piece of a fit of workload Z"
    )
    parser.add_argument(
        "--trackers",
        action="store_true",
        help="also fit default with MLflow, TensorBoard and W&B (offline) on, compared with fit default (A or B)",
    )
    parser.add_argument(
        "--profiler",
        action="store_true",
        help="also fit default with a ProfilerHandler between its cycles, compared with fit default",
    )
    parser.add_argument("--pieces-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the variant a valgrind process runs
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 < args.fraction <= 1:
        parser.error("--fraction must be in (0, 1]")
    if args.trackers and args.workload == "Z":
        parser.error("--trackers counts one fit of A or B (Z counts 20 fits, each a tracker run)")
    if args.child:
        child(args.child, args.workload, args.fraction, args.library, args.sample_reads)
        return
    if args.pieces_child:
        pieces_child(args.library)
        return
    if args.pieces:
        with tempfile.TemporaryDirectory() as tmp:
            counts = count_pieces(build_helper(Path(tmp)), Path(tmp))
        if args.json:
            print(json.dumps(counts, indent=2))
            return
        print(f"Workload Z, instructions per call of each piece ({PIECE_CALLS} calls counted):")
        for name, n in counts.items():
            print(f"  {name:<52} {n:12,.0f}")
        return
    result = measure(args.workload, args.fraction, args.jobs, args.sample_reads, args.trackers, args.profiler)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"Workload {result['workload']}: {result['title']}, {result['steps']} training steps "
        f"(fraction {result['fraction']}), instructions per training step, whole run counted"
        + (", fit reading batches sample by sample:" if result["sample_reads"] else ":")
    )
    for variant, n in result["instructions_per_step"].items():
        print(f"  {variant:<19} {n:12,.0f}")
    for pair, c in result["pairs"].items():
        print(f"  {pair:<33} {c['ratio']:.4f}x  ({c['extra_per_step']:+,.0f} instructions per step)")


if __name__ == "__main__":
    main()

"""A compiled net's warm start: what ``torch.compile`` built, kept beside the checkpoints and put back before a
resumed or re-run fit's first step, so that a restart does not compile again.

Two parts, in ``<checkpoint folder>/compile-cache/``: ``artifacts.bin``, torch's own portable cache
(``torch.compiler.save_cache_artifacts``: the FX graphs, autotuning), and ``inductor.tar``, the Inductor cache
folder's files (the C++ and Triton kernels it built, which the artifacts alone do not hold: on a CPU they would
all be built again). A restart on the same machine finds them in Inductor's folder anyway; one on another
machine (a fresh ``TORCHINDUCTOR_CACHE_DIR``) gets them from here, with the same torch and compiler.
"""

from __future__ import annotations

import logging
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("fitforge")
FOLDER = "compile-cache"


def save_compile_cache(folder: Path) -> None:
    """Write what this process compiled into ``folder/compile-cache`` (each file replaced whole)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    target = folder / FOLDER
    target.mkdir(parents=True, exist_ok=True)
    saved = torch.compiler.save_cache_artifacts()
    if saved is not None:
        _replace(target / "artifacts.bin", lambda path: path.write_bytes(saved[0]))

    def pack(path: Path) -> None:
        with tarfile.open(path, "w") as tar:
            tar.add(cache_dir(), arcname=".")

    _replace(target / "inductor.tar", pack)


def load_compile_cache(folder: Path) -> bool:
    """Put ``folder/compile-cache`` back into Inductor's cache folder and torch's caches; whether there was one.
    A cache that cannot be read is a warning: the net then compiles as it would have."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    source = folder / FOLDER
    if not (source / "inductor.tar").is_file():
        return False
    try:
        with tarfile.open(source / "inductor.tar") as tar:
            tar.extractall(cache_dir(), filter="data")
        if (source / "artifacts.bin").is_file():
            torch.compiler.load_cache_artifacts((source / "artifacts.bin").read_bytes())
    except Exception as err:  # a cache of another torch, a torn file: compiling again is the worst case
        log.warning("compile cache in %s not used (%s: %s); the net compiles again", source, type(err).__name__, err)
        return False
    log.info("compile cache: loaded what an earlier run compiled from %s", source)
    return True


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    os.replace(temporary, path)

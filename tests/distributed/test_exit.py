"""fitforge's wait at exit for gloo's worker threads (``parallel.settle_gloo_workers``), in one process:
stand-in threads take the name torch gives the workers, and block, need the GIL, or end."""

import ctypes
import sys
import threading
import time

import pytest

from fitforge.distributed import process_group as parallel

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the threads are seen through /proc")


def worker(body, *args) -> threading.Thread:
    """A thread named as a gloo worker, running ``body(*args)``; started once it has its name."""
    named = threading.Event()

    def run():
        ctypes.CDLL(None).prctl(15, parallel._GLOO_WORKER.encode(), 0, 0, 0)  # 15: PR_SET_NAME
        named.set()
        body(*args)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    named.wait()
    return thread


def spin(seconds: float) -> None:  # Python bytecode all along: it needs the GIL, as a worker freeing tensors does
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_blocked_worker_is_idle_at_once():
    release = threading.Event()
    thread = worker(release.wait)  # an untimed wait, as gloo's idle worker waits for work
    started = time.monotonic()
    try:
        assert parallel.settle_gloo_workers(timeout=2.0)
        assert time.monotonic() - started < 1.0
    finally:
        release.set()
        thread.join()


def test_a_worker_that_needs_the_gil_is_waited_for_until_it_is_done():
    thread = worker(spin, 0.3)
    started = time.monotonic()
    assert parallel.settle_gloo_workers(timeout=5.0)
    assert time.monotonic() - started >= 0.25 and not thread.is_alive()


def test_the_wait_ends_after_the_timeout():
    thread = worker(spin, 2.0)
    started = time.monotonic()
    assert not parallel.settle_gloo_workers(timeout=0.2)
    assert time.monotonic() - started < 1.5
    thread.join()

"""The fast tier's promise, kept by conftest.py: a test not marked ``integration`` starts no process and no
server. ``install()`` wraps the calls that start one; while ``guarding()`` is on, such a call raises
``StartsProcessError`` in the test's thread. A call from another thread (a server's own thread) goes
through, since an error there would not reach the test and could leave it waiting, and is reported by
``started_elsewhere()`` for conftest.py to fail the test."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.process
import os
import platform
import socket
import subprocess
import threading

import torch.distributed as dist


class StartsProcessError(RuntimeError):
    """A test not marked integration started a process or a server."""


_MARK_IT = "mark it @pytest.mark.integration (tests/conftest.py)"
_test_thread: int | None = None  # the guarded test's thread; None while nothing is guarded
_elsewhere: list[str] = []


def _starting(what: str) -> None:
    if _test_thread is None:
        return
    if threading.get_ident() == _test_thread:
        raise StartsProcessError(f"this test starts {what}: {_MARK_IT}")
    _elsewhere.append(f"this test starts {what} from another thread: {_MARK_IT}")


def _wrap(owner, name: str, describe) -> None:
    original = getattr(owner, name, None)
    if original is None:  # os.posix_spawn and friends are missing on some platforms
        return

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        _starting(describe(*args, **kwargs))
        return original(*args, **kwargs)

    setattr(owner, name, guarded)


def _address(sock: socket.socket) -> str:
    try:
        return repr(sock.getsockname())
    except OSError:
        return "an unbound socket"


def install() -> None:
    """Wrap the process and server starts once per session; they pass through while nothing is guarded."""
    # The stdlib runs ``uname -p`` once per process, the first time anything asks for the platform
    # (mlflow does at import): asked now, that is not charged to whichever test happens to import first.
    platform.processor()
    # Popen's _execute_child is where every subprocess helper (run, check_output, Popen) starts the child.
    _wrap(subprocess.Popen, "_execute_child", lambda self, args, *rest: f"a process (subprocess {args!r})")
    _wrap(os, "system", lambda command: f"a process (os.system {command!r})")
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        _wrap(os, name, lambda *args, name=name, **kwargs: f"a process (os.{name})")
    # Process.start covers multiprocessing, DataLoader workers (num_workers > 0) and process pools.
    _wrap(multiprocessing.process.BaseProcess, "start", lambda self: f"a process (multiprocessing {self.name})")
    _wrap(socket.socket, "listen", lambda self, *args: f"a server (a socket listening on {_address(self)})")
    # TCPStore listens from C++, out of the socket module's sight: env:// and tcp:// process groups.
    _wrap(dist.TCPStore, "__init__", lambda self, *args, **kwargs: "a server (torch.distributed.TCPStore)")


@contextlib.contextmanager
def guarding(on: bool):
    """Refuse process and server starts from the calling thread while the block runs (when ``on``); the
    guard before it, and what it had seen, come back after."""
    global _test_thread
    outer, seen = _test_thread, _elsewhere[:]
    _test_thread = threading.get_ident() if on else None
    _elsewhere.clear()
    try:
        yield
    finally:
        _test_thread = outer
        _elsewhere[:] = seen


def started_elsewhere() -> list[str]:
    """The starts made from another thread while the last block guarded, each as its error message."""
    return list(_elsewhere)

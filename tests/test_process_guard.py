"""The fast tier's guard (conftest.py): a test not marked integration that starts a process or a server
gets ``StartsProcessError``; one marked integration may. A server started from another thread fails the
test at its teardown instead."""

import multiprocessing
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

import process_guard
from process_guard import StartsProcessError


def test_a_subprocess_is_refused():
    with pytest.raises(StartsProcessError, match=r"starts a process \(subprocess .*mark it @pytest.mark.integration"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_fork_is_refused():
    with pytest.raises(StartsProcessError, match=r"os.fork"):
        if os.fork() == 0:  # reached only without the guard: the child leaves at once
            os._exit(0)


def test_a_multiprocessing_process_is_refused():
    with pytest.raises(StartsProcessError, match=r"multiprocessing"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_listening_socket_is_refused():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        with pytest.raises(StartsProcessError, match=r"a server \(a socket listening on \('127.0.0.1', \d+\)\)"):
            server.listen()


needs_distributed = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


@needs_distributed
def test_a_tcp_store_is_refused():
    with pytest.raises(StartsProcessError, match=r"TCPStore"):
        dist.TCPStore("127.0.0.1", 0, 1, is_master=True)


@needs_distributed
def test_an_in_process_store_passes():
    dist.HashStore().set("key", "value")


@pytest.mark.integration
def test_an_integration_test_may_start_a_process():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


def test_a_server_from_another_thread_is_let_through_and_reported():
    def serve():
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()

    with process_guard.guarding(True):
        thread = threading.Thread(target=serve)
        thread.start()
        thread.join()
        [started] = process_guard.started_elsewhere()
    assert started.startswith("this test starts a server (a socket listening on ('127.0.0.1', ")
    assert started.endswith(") from another thread: mark it @pytest.mark.integration (tests/conftest.py)")
    assert not process_guard.started_elsewhere()  # the test's own guard is back, with nothing seen

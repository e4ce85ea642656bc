"""Fixtures shared by the CLI tests."""

import sys
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _stub_search_in_this_process(monkeypatch):
    # jsonargparse's stub resolver asks typeshed_client for a search context, which starts a Python
    # to read its sys.path; given this process's path, the in-process CLI tests start no process.
    try:
        import typeshed_client
    except ImportError:
        return
    search = typeshed_client.get_search_context
    path = [Path(entry) for entry in sys.path if entry]
    monkeypatch.setattr(typeshed_client, "get_search_context", lambda **kwargs: search(search_path=path, **kwargs))

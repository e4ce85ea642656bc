"""Shared by the object-storage tests (importable as ``objectstore``): a short training run whose
checkpoints go to a URL, and a real S3-compatible server (moto's server mode) on the loopback."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator

import fsspec
import torch
from moto.server import ThreadedMotoServer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fitforge import Estimator
from fitforge.handlers import CheckpointHandler

_g = torch.Generator().manual_seed(0)
X, Y = torch.randn(48, 6, generator=_g), torch.randint(0, 3, (48,), generator=_g)  # 6 batches of 8


def train(model_dir: str, epochs: int, seed: int = 0, **saver_kwargs) -> tuple[dict, CheckpointHandler]:
    """A fresh net and Adam from ``seed``, shuffled data and dropout (every random draw matters),
    saving every 4 batches and at each epoch's end to ``model_dir``; the final weights and the saver."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    estimator = Estimator(
        net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01), device="cpu"
    )
    data = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)
    saver_kwargs.setdefault("batch_period", 4)
    saver = CheckpointHandler(model_dir, **saver_kwargs)
    estimator.fit(data, epochs=epochs, event_handlers=[saver])
    return net.state_dict(), saver


def assert_same(weights: dict, expected: dict) -> None:
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected), "weights differ from the uninterrupted run"


def listing(fs, folder: str) -> list[str]:
    """The object names in ``folder``, sorted, listed afresh; the run's ``manifest.json`` aside."""
    fs.invalidate_cache()
    names = (entry.rsplit("/", 1)[-1] for entry in fs.ls(folder, detail=False))
    return sorted(name for name in names if name != "manifest.json")


def s3_environment(endpoint: str) -> dict[str, str]:
    """What a process needs to reach the local server through botocore's own variables: its
    address and dummy credentials (moto accepts any)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


@contextlib.contextmanager
def local_s3(buckets: tuple[str, ...] = ("bucket",)) -> Iterator[str]:
    """An S3-compatible server on 127.0.0.1 (a free port), holding ``buckets``; yields its endpoint
    URL and stops it afterwards."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        # moto keeps its buckets in the process, across servers: start from none.
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
        fs = s3(endpoint)
        for bucket in buckets:
            fs.mkdir(bucket)
        yield endpoint
    finally:
        server.stop()


def s3(endpoint: str):
    """An s3fs filesystem on the local server (a fresh instance: fsspec caches them by options)."""
    return fsspec.filesystem("s3", skip_instance_cache=True, **storage_options(endpoint))


def storage_options(endpoint: str) -> dict:
    """s3fs's options for the local server, as a CheckpointHandler's ``storage_options``."""
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}

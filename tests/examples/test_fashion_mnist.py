"""examples/idx.py reads IDX files (and refuses broken ones); examples/fashion_mnist.py runs end to end.

The IDX files are written here, byte by byte from the format's description, so the reader is not
checked against a writer of its own. The example runs on tiny fake data sets in tmp_path, and on
the real Fashion-MNIST only where Debian's dataset-fashion-mnist is installed.
"""

import gzip
import math
import re
import struct

import numpy as np
import pytest
import torch

from helpers import load_example

pytestmark = pytest.mark.integration  # trains the examples

idx = load_example("idx")
fashion_mnist = load_example("fashion_mnist")

CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of ``array``: 00 00 <type> <ndim>, big-endian uint32 dims, big-endian values."""
    header = bytes([0, 0, CODES[array.dtype.type], array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write(path, content: bytes, gz: bool = False):
    path.write_bytes(gzip.compress(content) if gz else content)
    return path


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "raw"])
def test_reads_ubyte_images_and_labels(tmp_path, gz):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4) * 10
    labels = np.array([7, 0], dtype=np.uint8)
    got = idx.read_idx(write(tmp_path / "images", idx_bytes(images), gz))
    assert got.dtype == np.uint8 and got.shape == (2, 3, 4) and np.array_equal(got, images)
    assert np.array_equal(idx.read_idx(write(tmp_path / "labels", idx_bytes(labels), gz)), labels)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.float32, np.float64])
def test_reads_every_type_big_endian_into_native_order(tmp_path, dtype):
    values = np.array([[-3, 1, 2], [1000 if dtype != np.int8 else 100, -7, 0]], dtype=dtype)
    got = idx.read_idx(write(tmp_path / "values.idx", idx_bytes(values)))
    assert got.dtype == np.dtype(dtype) and got.dtype.isnative and np.array_equal(got, values)
    assert torch.from_numpy(got).tolist() == values.tolist()  # writable and native: torch takes it as is


def test_gzip_is_told_by_content_not_name(tmp_path):
    labels = np.array([1, 2, 3], dtype=np.uint8)
    plain_named_gz = write(tmp_path / "labels.gz", idx_bytes(labels))
    gzip_without_suffix = write(tmp_path / "labels", idx_bytes(labels), gz=True)
    assert np.array_equal(idx.read_idx(plain_named_gz), labels)
    assert np.array_equal(idx.read_idx(gzip_without_suffix), labels)


GOOD = idx_bytes(np.zeros((2, 2, 2), dtype=np.uint8))  # 00 00 08 03, dims 2 2 2, 8 values: 24 bytes

BROKEN = [
    ("bad magic", b"\x12\x34" + GOOD[2:], r"not an IDX file: magic number 12 34 08 03"),
    ("unknown type", GOOD[:2] + b"\x07" + GOOD[3:], r"not an IDX file: magic number 00 00 07 03"),
    ("too short", GOOD[:3], r"truncated: 3 bytes, too short for the 4-byte IDX magic"),
    ("cut header", GOOD[:10], r"truncated: the header of 3 dimensions needs 16 bytes, the file has 10"),
    ("cut data", GOOD[:-1], r"truncated: shape \(2, 2, 2\) of uint8 needs 24 bytes, the file has 23"),
    ("extra data", GOOD + b"\x00", r"trailing bytes: shape \(2, 2, 2\) of uint8 needs 24 bytes, the file has 25"),
]


@pytest.mark.parametrize("content, message", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "raw"])
def test_broken_files_are_refused_with_the_reason(tmp_path, content, message, gz):
    path = write(tmp_path / "broken", content, gz)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + message):
        idx.read_idx(path)


def test_a_cut_gzip_download_is_refused(tmp_path):
    path = write(tmp_path / "cut.gz", gzip.compress(GOOD)[:-6])
    with pytest.raises(ValueError, match=r"cut\.gz: damaged gzip data"):
        idx.read_idx(path)


def test_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        idx.read_idx(tmp_path / "absent.gz")


# --- the example -----------------------------------------------------------------------------------


def fake_fashion_mnist(folder, n_train=96, n_test=40, seed=0):
    """The four files with random 28x28 images and labels, gzip'd like Zalando's."""
    rng = np.random.default_rng(seed)
    for images, labels in fashion_mnist.FILES.values():
        n = n_train if images.startswith("train") else n_test
        write(folder / images, idx_bytes(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)), gz=True)
        write(folder / labels, idx_bytes(rng.integers(0, 10, n, dtype=np.uint8)), gz=True)
    return folder


def printed_test_accuracy(out: str) -> tuple[float, int]:
    found = re.search(r"test accuracy: ([\d.]+) on (\d+) test images", out)
    return float(found.group(1)), int(found.group(2))


@pytest.mark.parametrize("model", fashion_mnist.MODELS)
def test_smoke_runs_on_fake_files(model, tmp_path, capsys):
    data, checkpoints = fake_fashion_mnist(tmp_path), tmp_path / "checkpoints"
    argv = ["--smoke", "--model", model, "--data-dir", str(data), "--val-size", "16"]
    argv += ["--checkpoint-dir", str(checkpoints)]
    history = fashion_mnist.main(argv)
    assert history.epochs == 1 and math.isfinite(history.last("train_loss"))
    accuracy, tested = printed_test_accuracy(capsys.readouterr().out)
    assert 0 <= accuracy <= 1 and tested == 40  # the fake test file's 40 images (under the smoke limit of 64)
    assert (checkpoints / f"fmnist-{model}-best.pt").is_file()


@pytest.mark.parametrize("model", fashion_mnist.MODELS)
def test_every_model_trains_on_batches_of_one_image(model, tmp_path):
    argv = ["--model", model, "--data-dir", str(fake_fashion_mnist(tmp_path)), "--val-size", "16"]
    history = fashion_mnist.main(argv + ["--batch-size", "1", "--limit", "3", "--epochs", "1"])
    assert math.isfinite(history.last("train_loss"))


def test_unpacked_files_are_read_too(tmp_path, capsys):
    data = fake_fashion_mnist(tmp_path)
    for path in data.glob("*.gz"):
        path.with_suffix("").write_bytes(gzip.decompress(path.read_bytes()))
        path.unlink()
    fashion_mnist.main(["--smoke", "--model", "lenet", "--data-dir", str(data), "--val-size", "16"])
    assert printed_test_accuracy(capsys.readouterr().out)[1] == 40


def test_missing_files_say_which_and_how_to_get_them(tmp_path):
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"")  # one of four present: the other three are named
    with pytest.raises(FileNotFoundError) as info:
        fashion_mnist.main(["--smoke", "--data-dir", str(tmp_path)])
    message = str(info.value)
    assert (
        f"not in {tmp_path}: train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz missing"
        in message
    )
    assert "apt-get install dataset-fashion-mnist" in message and "zalandoresearch/fashion-mnist" in message


def test_val_size_must_leave_training_images(tmp_path, capsys):
    with pytest.raises(SystemExit):
        fashion_mnist.main(["--smoke", "--data-dir", str(fake_fashion_mnist(tmp_path)), "--val-size", "96"])
    assert "--val-size must be between 1 and 95" in capsys.readouterr().err


def test_augmentation_shifts_and_mirrors_whole_images_and_validation_gets_none():
    images = torch.zeros(64, 28, 28, dtype=torch.uint8)
    images[:, 8:20, 6:14] = torch.randint(1, 256, (64, 12, 8), dtype=torch.uint8)  # away from the border
    labels = torch.arange(64) % 10
    train = fashion_mnist.Batches(images, labels, mean=0.0, std=1.0, pad=2, seed=0)
    batch, got_labels = train[list(range(64))]
    assert batch.shape == (64, 1, 28, 28) and batch.dtype == torch.float32 and torch.equal(got_labels, labels)
    for original, moved in zip(images.float(), batch[:, 0]):
        candidates = [original, original.flip(1)]
        shifts = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)]
        assert any(torch.equal(torch.roll(c, s, (0, 1)), moved) for c in candidates for s in shifts)
    assert not torch.equal(batch[:, 0], images.float())  # 64 images, 50 outcomes each: some moved
    again = fashion_mnist.Batches(images, labels, mean=0.0, std=1.0, pad=2, seed=0)[list(range(64))][0]
    assert torch.equal(again, batch)  # seeded
    plain = fashion_mnist.Batches(images, labels, mean=10.0, std=2.0)[[3, 5]][0]
    assert torch.equal(plain[:, 0], (images[[3, 5]].float() - 10) / 2)


@pytest.mark.skipif(
    any(fashion_mnist.find(fashion_mnist.DATA_DIR, n) is None for pair in fashion_mnist.FILES.values() for n in pair),
    reason="the real Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)",
)
def test_smoke_runs_on_the_real_files(tmp_path, capsys):
    history = fashion_mnist.main(["--smoke", "--checkpoint-dir", str(tmp_path)])
    assert history.epochs == 1 and math.isfinite(history.last("train_loss"))
    out = capsys.readouterr().out
    assert "data: 64 training, 64 validation, 64 test images" in out
    assert printed_test_accuracy(out)[1] == 64

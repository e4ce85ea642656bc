"""examples/idx.py reads IDX files (and refuses broken ones).

The IDX files are written here, byte by byte from the format's description, so the reader is not
checked against a writer of its own.
"""

import gzip
import re
import struct

import numpy as np
import pytest
import torch

from helpers import load_example

idx = load_example("idx")

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

"""Read IDX files, the format of MNIST and Fashion-MNIST, gzip'd or plain.

An IDX file is a 4-byte magic number, one big-endian uint32 per dimension, then the values in C
order, big-endian. The magic is two zero bytes, a type code (``DTYPES``) and the number of
dimensions: ``00 00 08 03`` is unsigned bytes in 3 dimensions (images), ``00 00 08 01`` unsigned
bytes in 1 (labels). See http://yann.lecun.com/exdb/mnist/ (the format is described at the end).
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

# IDX type code -> big-endian numpy dtype
DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str | Path) -> np.ndarray:
    """The array stored in the IDX file ``path`` (gzip'd or not: told by its first bytes, not its
    name), in native byte order, e.g. uint8 (60000, 28, 28) for Fashion-MNIST's training images.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not IDX (bad magic number, unknown type code), is truncated, has
            bytes after its data, or is a damaged gzip stream. The message names the file.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as error:  # a cut-off or corrupted download
            raise ValueError(f"{path}: damaged gzip data ({error})") from error
    if len(raw) < 4:
        raise ValueError(f"{path}: truncated: {len(raw)} bytes, too short for the 4-byte IDX magic number")
    zeros, code, ndim = raw[:2], raw[2], raw[3]
    if zeros != b"\x00\x00" or code not in DTYPES:
        codes = ", ".join(f"0x{c:02X}" for c in DTYPES)
        raise ValueError(
            f"{path}: not an IDX file: magic number {raw[:4].hex(' ')}, expected 00 00 <type> <ndim> "
            f"with type one of {codes}"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(
            f"{path}: truncated: the header of {ndim} dimensions needs {header} bytes, the file has {len(raw)}"
        )
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(DTYPES[code])
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        problem = "truncated" if len(raw) < expected else "trailing bytes"
        raise ValueError(
            f"{path}: {problem}: shape {shape} of {dtype.name} needs {expected} bytes, the file has {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))

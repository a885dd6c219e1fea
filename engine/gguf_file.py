"""Open a GGUF file: its metadata as plain Python values, its tensors as numpy views.

A GGUF file is a header (key/value metadata, then one record per tensor: name, ggml
type, dimensions, offset) followed by the tensor data. `gguf.GGUFReader` memory-maps
the file and parses the tensor records (we read the key/value metadata ourselves,
see `_Reader`); we check what it found and turn every way a file can be wrong into a
`ModelFileError` (or `UnsupportedModelError` for a valid file we cannot run) that
names the file and the problem.

Tensor data is never copied here: `Tensor.data` is a view onto the memory map, so
opening a file costs little memory until the weights are read.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField

from engine.errors import ModelFileError, UnsupportedModelError

# The ggml tensor types the engine can compute with (engine/quants.py has a loader for each).
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16",
        "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)


def release_pages(data: np.ndarray) -> None:
    """Let the OS drop the file pages under `data` from this process's resident memory.

    Once a quantized tensor is unpacked, its bytes in the map are not read again, but
    the pages stay counted in our resident set. They are clean pages of a read-only
    file mapping, so dropping them loses nothing: a later read faults them back in.
    Arrays that are not views of a read-only `np.memmap` are left alone (dropping
    anonymous memory would zero it).
    """
    base = data
    while not isinstance(base, np.memmap) and isinstance(base.base, np.ndarray):
        base = base.base
    if not isinstance(base, np.memmap) or base.mode != "r" or _madvise is None or data.nbytes == 0:
        return
    start = data.ctypes.data & ~(mmap.PAGESIZE - 1)
    _madvise(ctypes.c_void_p(start), ctypes.c_size_t(data.ctypes.data + data.nbytes - start),
             mmap.MADV_DONTNEED)


def _libc_madvise():
    """libc's madvise, where the platform has one (Linux, macOS)."""
    if not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None


_madvise = _libc_madvise()


# numpy dtypes of the GGUF scalar value types
_SCALARS = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.UINT64: np.dtype("<u8"), GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype("?"),
}


def _uint(buf: memoryview, offs: int, size: int) -> int:
    """A little-endian unsigned integer of `size` bytes at `offs`."""
    if offs + size > len(buf):
        raise ValueError("the metadata runs past the end of the file")
    return int.from_bytes(buf[offs : offs + size], "little")


def _read_value(buf: memoryview, offs: int, vtype: int) -> tuple[Any, int]:
    """The metadata value of GGUF type `vtype` at `offs` -> (plain Python value, end offset)."""
    if vtype == GGUFValueType.STRING:
        end = offs + 8 + _uint(buf, offs, 8)
        if end > len(buf):
            raise ValueError("a metadata string runs past the end of the file")
        return str(buf[offs + 8 : end], "utf-8"), end
    if vtype == GGUFValueType.ARRAY:
        item_type, n = _uint(buf, offs, 4), _uint(buf, offs + 4, 8)
        offs += 12
        dtype = _SCALARS.get(item_type)
        if dtype is not None:  # a whole array of numbers in one read
            end = offs + n * dtype.itemsize
            if end > len(buf):
                raise ValueError("a metadata array runs past the end of the file")
            return np.frombuffer(buf, dtype, n, offs).tolist(), end
        if item_type == GGUFValueType.STRING:  # a vocabulary: the one loop worth writing out
            return _read_strings(buf, offs, n)
        items = []
        for _ in range(n):
            item, offs = _read_value(buf, offs, item_type)
            items.append(item)
        return items, offs
    dtype = _SCALARS.get(vtype)
    if dtype is None:
        raise ValueError(f"unknown metadata value type {vtype}")
    if offs + dtype.itemsize > len(buf):
        raise ValueError("the metadata runs past the end of the file")
    return np.frombuffer(buf, dtype, 1, offs).tolist()[0], offs + dtype.itemsize


def _read_strings(buf: memoryview, offs: int, n: int) -> tuple[list[str], int]:
    """n GGUF strings (u64 length, UTF-8 bytes) from `offs` -> (the strings, end offset)."""
    strings, end = [], len(buf)
    for _ in range(n):
        start = offs + 8
        offs = start + int.from_bytes(buf[offs:start], "little")
        if offs > end:  # also when the length itself was cut off: then start > end
            raise ValueError("a metadata string runs past the end of the file")
        strings.append(str(buf[start:offs], "utf-8"))
    return strings, offs


class _Reader(GGUFReader):
    """GGUFReader with a faster key/value section, read straight into Python values.

    GGUFReader keeps every metadata item as numpy views (two per string: a vocabulary
    of 262144 tokens makes a million small arrays): slow to build, and the heap they
    leave behind stays fragmented (100 MiB more resident memory for Gemma 3). We read
    the key/value section ourselves; the tensor records and data are GGUFReader's.
    """

    metadata: dict[str, Any]

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I":
            raise UnsupportedModelError("big-endian GGUF files are not supported")
        buf = memoryview(self.data)
        self.metadata = {}
        for _ in range(count):
            key, offs = _read_value(buf, offs, GGUFValueType.STRING)
            vtype = _uint(buf, offs, 4)
            if key in self.metadata:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.metadata[key], offs = _read_value(buf, offs + 4, vtype)
            if key == "general.alignment":  # GGUFReader places the tensor data by it
                if vtype != GGUFValueType.UINT32:
                    raise ValueError("general.alignment is not a uint32")
                alignment = np.array([self.metadata[key]], np.uint32)
                self.fields[key] = ReaderField(offs, key, [alignment], [0], [GGUFValueType.UINT32])
        return offs


@dataclass(frozen=True)
class Tensor:
    """One tensor of a GGUF file.

    `shape` is numpy's row-major order, the reverse of ggml's `ne`: a weight matrix
    mapping `n_in` features to `n_out` is `(n_out, n_in)`, one row per output.
    `data` is a view onto the file: float32 / float16 arrays of `shape` for F32 / F16,
    otherwise the raw bytes as uint8 `(rows, bytes_per_row)` (the ggml blocks of a row).
    """

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class GGUFFile:
    """A memory-mapped GGUF file: `.metadata`, `.tensors`, `.architecture`."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: no such model file")
        try:
            reader = _Reader(self.path)
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
            raise self._reader_error(e) from e
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot read the file ({e})") from e
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{self.path}: {e}") from e
        self.metadata: dict[str, Any] = reader.metadata

        self.tensors: dict[str, Tensor] = {}
        for t in reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, "
                    f"which the engine does not support (supported: "
                    f"{', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            data = t.data.view(np.ndarray)  # plain views: slicing an np.memmap runs Python code
            self.tensors[t.name] = Tensor(t.name, t.tensor_type, shape, data)
        release_pages(reader.data[: reader.data_offset])  # the header, now parsed

    def _reader_error(self, e: Exception) -> Exception:
        """Translate a GGUFReader failure into the engine's exception for it."""
        message = str(e)
        if "GGMLQuantizationType" in message:
            return UnsupportedModelError(f"{self.path}: unknown tensor type ({message})")
        if "magic" in message:
            return ModelFileError(f"{self.path}: not a GGUF file (bad magic number)")
        if "version" in message:
            return ModelFileError(f"{self.path}: unsupported GGUF version ({message})")
        if "mmap" in message and "empty" in message:
            return ModelFileError(f"{self.path}: the file is empty")
        if "reshape" in message:  # the reader found fewer bytes than a tensor needs
            return ModelFileError(f"{self.path}: tensor data lies past the end of the file (truncated?)")
        if "not a multiple of" in message:
            return ModelFileError(f"{self.path}: a tensor's row is not a whole number of blocks ({message})")
        return ModelFileError(
            f"{self.path}: truncated or corrupt GGUF file ({type(e).__name__}: {message})"
        )

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key`, or `default` when the file does not have it."""
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path}: metadata key 'general.architecture' is missing")
        return arch

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {len(self.tensors)} tensors)"

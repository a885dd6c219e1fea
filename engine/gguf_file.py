"""Open a GGUF file: its metadata as plain Python values, its tensors as numpy views.

The header (the metadata and one record per tensor: name, shape, ggml type,
offset) is read by engine/gguf_header.py, which also explains the layout; this
module adds what needs numpy: it memory-maps the file, checks each tensor's type
and that its bytes lie within the file, and turns every way a file can be wrong
into a `ModelFileError` (or `UnsupportedModelError` for a valid file we cannot
run) that names the file and the problem.

Tensor data is never copied here: `Tensor.data` is a view onto the memory map, so
opening a file costs little memory until the weights are read.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import ModelFileError, UnsupportedModelError
from engine.gguf_header import GGUFHeader, GGUFHeaderError, TensorRecord, UnsupportedGGUFError, read_header

# The ggml tensor types the engine can compute with (engine/quants.py has a loader for each).
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16",
        "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)
# The types whose data is numbers numpy has a dtype for; the others are blocks of bytes.
_FLOAT_TYPES = {GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2")}


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
    """A memory-mapped GGUF file: `.metadata`, `.tensors`, `.architecture` (and `.header`)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: no such model file")
        try:
            self.header: GGUFHeader = read_header(self.path, arrays=True)
            data = np.memmap(self.path, mode="r")  # (not empty: the header was read from it)
        except UnsupportedGGUFError as e:
            raise UnsupportedModelError(f"{self.path}: {e}") from e
        except GGUFHeaderError as e:
            raise ModelFileError(f"{self.path}: {e}") from e
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot read the file ({e})") from e
        self.metadata: dict[str, Any] = self.header.metadata
        whole = data.view(np.ndarray)  # plain views: slicing an np.memmap runs Python code
        self.tensors: dict[str, Tensor] = {t.name: self._tensor(t, whole) for t in self.header.tensors}

    def _tensor(self, record: TensorRecord, data: np.ndarray) -> Tensor:
        """The tensor of `record`, a view onto the file's bytes `data`, once its type and size are checked."""
        try:
            ggml_type = GGMLQuantizationType(record.type)
        except ValueError:
            raise UnsupportedModelError(f"{self.path}: unknown tensor type {record.type} "
                                        f"of tensor {record.name!r}") from None
        if ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"{self.path}: tensor {record.name!r} has type {ggml_type.name}, "
                f"which the engine does not support (supported: "
                f"{', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
            )
        block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
        shape = record.shape
        row_length = shape[-1] if shape else 1
        if row_length % block_size:
            raise ModelFileError(f"{self.path}: tensor {record.name!r}'s rows of {row_length} values "
                                 f"are not a whole number of {ggml_type.name} blocks of {block_size}")
        row_bytes = row_length // block_size * block_bytes
        end = record.offset + math.prod(shape[:-1]) * row_bytes
        if end > len(data):
            raise ModelFileError(f"{self.path}: tensor {record.name!r}'s data lies past the end of the file "
                                 f"(truncated?)")
        raw = data[record.offset : end]
        if ggml_type in _FLOAT_TYPES:  # F32, F16: numbers of the tensor's shape
            return Tensor(record.name, ggml_type, shape, raw.view(_FLOAT_TYPES[ggml_type]).reshape(shape))
        return Tensor(record.name, ggml_type, shape, raw.reshape(*shape[:-1], row_bytes))  # (rows..., bytes of a row)

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

"""Open a GGUF file: its metadata as plain Python values, its tensors as numpy views.

A GGUF file is a header (key/value metadata, then one record per tensor: name, ggml
type, dimensions, offset) followed by the tensor data. `gguf.GGUFReader` memory-maps
the file and parses the header; we check what it found and turn every way a file can
be wrong into a `ModelFileError` (or `UnsupportedModelError` for a valid file we cannot
run) that names the file and the problem.

Tensor data is never copied here: `Tensor.data` is a view onto the memory map, so
opening a file costs little memory until the weights are read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

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


class _Reader(GGUFReader):
    """GGUFReader reading through a plain ndarray view of its memory map.

    The reader slices its map a few times per metadata string (a vocabulary has
    tens of thousands); slicing an `np.memmap` runs Python code each time, slicing
    an ndarray over the same memory does not: opening a file gets 3-4x faster.
    """

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._mapped = mapped.view(np.ndarray)


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
        if reader.byte_order != "I":
            raise UnsupportedModelError(f"{self.path}: big-endian GGUF files are not supported")

        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):  # the header's own counters, not metadata
                continue
            try:
                self.metadata[key] = field.contents()
            except (UnicodeDecodeError, IndexError, ValueError) as e:
                raise ModelFileError(f"{self.path}: metadata key {key!r} is corrupt ({e})") from e

        self.tensors: dict[str, Tensor] = {}
        for t in reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, "
                    f"which the engine does not support (supported: "
                    f"{', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = Tensor(t.name, t.tensor_type, shape, t.data)

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

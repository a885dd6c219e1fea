"""Read a GGUF file's header with the standard library: its metadata and tensor records.

A GGUF file is a header, then the tensor data. All numbers are little-endian; a
string is a u64 byte count and that many bytes of UTF-8 (no terminator):

    magic         4 bytes   b"GGUF"
    version       u32       2 or 3 (version 1 had 32-bit counts; it is not read)
    n_tensors     u64
    n_kv          u64
    n_kv times, the key/value metadata:
        key       string    e.g. "general.architecture", "llama.context_length"
        type      u32       a value type (UINT8 ... FLOAT64 below)
        value               a number, a bool (1 byte), a string, or an array:
                            item type u32, count u64, the items one after another
                            (an array may hold arrays: each then has its own item type)
    n_tensors times, a tensor record:
        name      string    e.g. "blk.0.attn_q.weight"
        n_dims    u32       1 to 4
        ne        u64 x n_dims   ggml's order: ne[0] varies fastest (the length of a row)
        type      u32       the ggml tensor type (F32, Q4_K, ...: engine/describe.py names them)
        offset    u64       where its data starts, counted from the data section
    zero padding up to a multiple of `general.alignment` (a u32 key; 32 when absent)
    the data section: each tensor's bytes at its offset

Two readers need the header. The model listing (lmsp_min/registry.py) reads it to
describe a model without loading it, and must stay fast and free of numpy: with
`arrays=False` an array is skipped, not decoded (Gemma 3's vocabulary alone is
262,144 strings). The engine (engine/gguf_file.py) reads the arrays too (the
vocabulary, the merges, the scores) and maps the tensor data with numpy.

Every length is checked against the end of the file: a cut-off or corrupt header
raises GGUFHeaderError saying what is wrong, never a bare IndexError.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS

# The metadata value types: the u32 in front of each value.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
# struct codes of the fixed-size ones
_SCALAR_CODES = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i",
                 FLOAT32: "f", BOOL: "?", UINT64: "Q", INT64: "q", FLOAT64: "d"}
_SCALARS = {vtype: struct.Struct("<" + code) for vtype, code in _SCALAR_CODES.items()}
_U32, _U64 = _SCALARS[UINT32], _SCALARS[UINT64]
# How deep arrays of arrays may nest: deeper is a corrupt header. Each level is one more
# recursion of the reader, and a few thousand levels (12 bytes each) would exhaust Python's.
MAX_ARRAY_DEPTH = 16


class GGUFHeaderError(Exception):
    """The file is not a GGUF file whose header we can read (the message says why)."""


class UnsupportedGGUFError(GGUFHeaderError):
    """A well-formed GGUF file this reader does not read (big-endian)."""


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor is and what it holds; the bytes themselves are not read here.

    `shape` is numpy's row-major order, the reverse of ggml's `ne`: a weight matrix
    mapping `n_in` features to `n_out` is `(n_out, n_in)`, one row per output.
    """

    name: str
    shape: tuple[int, ...]
    type: int    # the ggml tensor type number (engine/describe.py TENSOR_TYPES names it)
    offset: int  # where its data starts, from the start of the file

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFHeader:
    """Everything before the tensor data: what the file says of itself, and where each tensor is."""

    version: int
    # key -> int | float | bool | str | list; with arrays=False an array is replaced by its length
    metadata: dict[str, Any]
    tensors: tuple[TensorRecord, ...]  # in file order
    alignment: int
    data_offset: int  # where the data section starts (a multiple of `alignment`)

    @property
    def n_parameters(self) -> int:
        """The number of weights: every tensor's element count, summed."""
        return sum(t.n_elements for t in self.tensors)


def read_header(path: str | os.PathLike[str], arrays: bool = False) -> GGUFHeader:
    """The header of the GGUF file at `path`; array values are read only with `arrays`.

    The file is memory-mapped for the time of the call: only the pages of the header
    are read, and none stay mapped afterwards (the values are copies).
    """
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            raise GGUFHeaderError("the file is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            try:
                return _parse(view, arrays)
            except (struct.error, UnicodeDecodeError) as exc:  # a field the file ends inside, bad UTF-8
                raise GGUFHeaderError(f"truncated or corrupt GGUF header ({exc})") from None


def _parse(buf: mmap.mmap | bytes, arrays: bool) -> GGUFHeader:
    """The header at the start of `buf` (slicing `buf` gives bytes: no view of it outlives the call)."""
    if buf[:4] != MAGIC:
        raise GGUFHeaderError("not a GGUF file (bad magic number)")
    version = _U32.unpack_from(buf, 4)[0]
    if version not in VERSIONS:
        if version & 0xFFFF == 0 and int.from_bytes(buf[4:8], "big") in VERSIONS:
            raise UnsupportedGGUFError("big-endian GGUF files are not supported")
        raise GGUFHeaderError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = _U64.unpack_from(buf, 8)[0], _U64.unpack_from(buf, 16)[0]
    offs = 24

    metadata: dict[str, Any] = {}
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, offs = _string(buf, offs)
        vtype = _U32.unpack_from(buf, offs)[0]
        if key in metadata:
            raise GGUFHeaderError(f"duplicate metadata key {key!r}")
        metadata[key], offs = _value(buf, offs + 4, vtype, arrays)
        if key == "general.alignment":  # it places the data section: check it here
            alignment = metadata[key]
            if vtype != UINT32 or alignment == 0 or alignment & (alignment - 1):
                raise GGUFHeaderError("general.alignment is not a power of two stored as a uint32")

    records = []  # (name, shape, type, offset in the data section)
    names = set()
    for _ in range(n_tensors):
        name, offs = _string(buf, offs)
        if name in names:
            raise GGUFHeaderError(f"duplicate tensor name {name!r}")
        names.add(name)
        n_dims = _U32.unpack_from(buf, offs)[0]
        if n_dims > MAX_DIMS:
            raise GGUFHeaderError(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        ne = struct.unpack_from(f"<{n_dims}Q", buf, offs + 4)
        offs += 4 + 8 * n_dims
        ggml_type, data_offs = _U32.unpack_from(buf, offs)[0], _U64.unpack_from(buf, offs + 4)[0]
        offs += 12
        records.append((name, tuple(reversed(ne)), ggml_type, data_offs))
    data_offset = offs + -offs % alignment  # rounded up to a multiple of the alignment
    tensors = tuple(TensorRecord(name, shape, ggml_type, data_offset + data_offs)
                    for name, shape, ggml_type, data_offs in records)
    return GGUFHeader(version, metadata, tensors, alignment, data_offset)


def _string(buf, offs: int) -> tuple[str, int]:
    """The string at `offs` -> (its text, the offset after it)."""
    start = offs + 8
    end = start + _U64.unpack_from(buf, offs)[0]
    if end > len(buf):
        raise GGUFHeaderError("a string runs past the end of the file")
    return buf[start:end].decode(), end


def _value(buf, offs: int, vtype: int, arrays: bool, depth: int = 0) -> tuple[Any, int]:
    """The value of type `vtype` at `offs` -> (a plain Python value, the offset after it)."""
    scalar = _SCALARS.get(vtype)
    if scalar is not None:
        return scalar.unpack_from(buf, offs)[0], offs + scalar.size
    if vtype == STRING:
        return _string(buf, offs)
    if vtype != ARRAY:
        raise GGUFHeaderError(f"unknown metadata value type {vtype}")
    item_type, n = _U32.unpack_from(buf, offs)[0], _U64.unpack_from(buf, offs + 4)[0]
    offs += 12
    if item_type in _SCALARS:  # numbers: one read for the whole array, or one addition to skip it
        end = offs + n * _SCALARS[item_type].size
        if end > len(buf):
            raise GGUFHeaderError("an array runs past the end of the file")
        return (list(struct.unpack_from(f"<{n}{_SCALAR_CODES[item_type]}", buf, offs)) if arrays else n), end
    if item_type == STRING:  # a vocabulary: the one loop worth writing out
        return _strings(buf, offs, n, arrays)
    if item_type != ARRAY:
        raise GGUFHeaderError(f"unknown metadata value type {item_type}")
    if depth == MAX_ARRAY_DEPTH:
        raise GGUFHeaderError("arrays nested too deeply")
    items = []
    for _ in range(n):  # each inner array is at least 12 bytes: a count past the file ends in an error
        item, offs = _value(buf, offs, ARRAY, arrays, depth + 1)
        items.append(item)
    return (items if arrays else n), offs


def _strings(buf, offs: int, n: int, arrays: bool) -> tuple[list[str] | int, int]:
    """n strings one after another from `offs` -> (the strings, or n when skipped; the offset after).

    Written out rather than a call of `_string` per item: this is most of the header's
    time (Gemma 3: 262,144 tokens).
    """
    length_at = _U64.unpack_from
    end = len(buf)
    if not arrays:
        for _ in range(n):
            offs += 8 + length_at(buf, offs)[0]
            if offs > end:
                raise GGUFHeaderError("a string runs past the end of the file")
        return n, offs
    strings = []
    append = strings.append
    for _ in range(n):
        start = offs + 8
        offs = start + length_at(buf, offs)[0]
        if offs > end:
            raise GGUFHeaderError("a string runs past the end of the file")
        append(buf[start:offs].decode())
    return strings, offs

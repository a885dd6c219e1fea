"""Weight matrices kept quantized in memory, and the matmul kernels that use them.

Every quantized ggml format stores a row as blocks: a few scale bytes followed by
packed small integers ("codes"). The blocks differ (bits per code, 32 or 256 values
per block, 6-bit sub-block scales, ...), but once unpacked they all say the same
thing: `w = code * scale + min`, with one scale (and, for some formats, one min) per
group of `g` consecutive values of a row. So at load time each format is unpacked
ONCE into one uniform representation, and one pair of kernels serves every format:

    codes  int8     (n_tiles, in, tile_rows)  W.T cut into tiles of rows (see QuantWeight)
    scales float32  (in // g, out)   one per group: ggml's d (K-quants: d * sub-block scale)
    mins   float32  (in // g, out)   formats with an offset only (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)

(scales and mins are stored group-major, so they broadcast along the same contiguous
`out` axis as the transposed codes). Resident bytes per weight:

    g = 32, no min  (Q8_0, Q4_0, Q5_0):        1 + 4/32  = 1.125
    g = 32, min     (Q4_1, Q5_1, Q4_K, Q5_K):  1 + 8/32  = 1.25
    g = 16, no min  (Q3_K, Q6_K):              1 + 4/16  = 1.25
    g = 16, min     (Q2_K):                    1 + 8/16  = 1.5
    F32: 4 (the memory-mapped file), F16 / BF16: 2 (kept half-size, converted per tile)

against 0.33 (Q2_K) to 1.06 (Q8_0) bytes per weight in the file: 1.06x the file for
Q8_0, 2.0x for Q4_0 and Q4_1, 2.2x for Q4_K, 2.9x for Q3_K and 4.6x for Q2_K. No
float32 copy of a quantized matrix is ever kept.

The kernels, for `y = x @ W.T` with x float32 (n, in):
- few rows (decode): W's codes are converted to float32 one cache-sized tile of rows
  at a time, then BLAS computes the per-group partial dot products
  P[k, r] = x[group k] . codes[group k, r], and y[r] = sum_k scales[k, r] * P[k, r]
  (+ sum_k mins[k, r] * sum(x[group k])): no pass multiplies the weights by scales.
- many rows (prefill): a few tiles at a time are dequantized (codes * scales + mins)
  into a float32 buffer and multiplied with one BLAS GEMM, so the dequantization cost
  is shared by all n rows of x.
They run on the calling thread, and several threads may call them at once (every
thread has its own scratch buffers, kept between calls: `scratch`). Both work tile by
tile through `_decode_tiles` and `_prefill_tiles`, which compute any range of tiles
on its own: the acceleration layer (engine/accel) shares a matmul's tiles out
between threads and a helper process through them, and gets the same floats. Their
sizes (TILE_VALUES, DECODE_MAX_ROWS, ...) are in engine/tuning.py's table.

The unpackers read the block layouts as numpy views, the way gguf-py's quants.py
does; `gguf.quants.dequantize` is the reference the tests compare against.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from engine import tuning
from engine.errors import UnsupportedModelError
from engine.gguf_file import Tensor, release_pages


# ---------------------------------------------------------------------------------------
# Weights


class Weight(ABC):
    """A (out, in) weight matrix: `y = x @ W.T` without a float32 copy of W."""

    shape: tuple[int, int]

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this weight keeps in memory."""

    @abstractmethod
    def _dequantize(self, rows: slice | np.ndarray, out: np.ndarray) -> None:
        """Write W[rows] as float32 into out (n_rows, in); rows is a slice or an index array."""

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x float32 (n, in) -> x @ W.T float32 (n, out)."""
        x = self._input(x)
        y = np.empty((x.shape[0], self.shape[0]), np.float32)
        if y.size:
            self._matmul_rows(x, y, 0, self.shape[0])
        return y

    def _input(self, x: np.ndarray) -> np.ndarray:
        """x checked to be (n, in), as contiguous float32."""
        if x.ndim != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"matmul of a {self.shape} weight with x of shape {x.shape}")
        return np.ascontiguousarray(x, dtype=np.float32)

    def _matmul_rows(self, x: np.ndarray, y: np.ndarray, r0: int, r1: int) -> None:
        """y[:, r0:r1] = x @ W[r0:r1].T, W's rows converted to float32 a tile at a time
        (bigger tiles for many rows of x: one GEMM per tile)."""
        n_in = self.shape[1]
        decode = x.shape[0] <= tuning.DECODE_MAX_ROWS
        tile_values = tuning.TILE_VALUES if decode else tuning.PREFILL_TILE_VALUES
        tile_rows = max(1, tile_values // n_in)
        buf = np.empty(min(tile_rows, r1 - r0) * n_in, np.float32)
        for t0 in range(r0, r1, tile_rows):
            t1 = min(t0 + tile_rows, r1)
            w = buf[: (t1 - t0) * n_in].reshape(t1 - t0, n_in)  # (rows, in) float32
            self._dequantize(slice(t0, t1), w)
            np.matmul(x, w.T, out=y[:, t0:t1])

    def rows(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """W[ids] as float32 (len(ids), in): an embedding lookup."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"row ids out of range for a weight of {self.shape[0]} rows")
        out = np.empty((ids.size, self.shape[1]), np.float32)
        self._dequantize(ids, out)
        return out

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 (out, in) (tests and small tensors)."""
        out = np.empty(self.shape, np.float32)
        self._dequantize(slice(None), out)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, nbytes={self.nbytes})"


class DenseWeight(Weight):
    """F32, F16 or BF16 data (out, in), kept as in the file and converted per tile.

    BF16 is held as its uint16 bit patterns: a bfloat16 is the top half of a float32.
    """

    def __init__(self, data: np.ndarray, kind: T):
        self.data = data  # (out, in) float32 | float16 | uint16 (BF16 bits)
        self.kind = kind
        self.shape = (int(data.shape[0]), int(data.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def _dequantize(self, rows: slice | np.ndarray, out: np.ndarray) -> None:
        if self.kind == T.BF16:
            bits = out.view(np.uint32)
            np.copyto(bits, self.data[rows])
            np.left_shift(bits, 16, out=bits)
        else:
            np.copyto(out, self.data[rows])

    def _matmul_rows(self, x: np.ndarray, y: np.ndarray, r0: int, r1: int) -> None:
        if self.kind == T.F32:  # BLAS reads float32 weights as they are
            np.matmul(x, self.data[r0:r1].T, out=y[:, r0:r1])
        else:
            super()._matmul_rows(x, y, r0, r1)


def _tile_rows(n_out: int, n_in: int) -> int:
    """Rows per stored tile: about TILE_VALUES codes, dividing n_out if a size near that does.

    Otherwise the tiles are as equal as they can be and the last one is zero-padded
    (by fewer rows than there are tiles).
    """
    most = max(1, tuning.TILE_VALUES // n_in)
    for rows in range(min(most, n_out), most // 2, -1):
        if n_out % rows == 0:
            return rows
    n_tiles = -(-n_out // most)
    return -(-n_out // n_tiles)


class QuantWeight(Weight):
    """A quantized matrix unpacked to int8 codes plus per-group float32 scales (and mins).

    The codes are stored transposed and cut into tiles of `tile_rows` rows:
    codes[b] is W[b * tile_rows : (b + 1) * tile_rows].T (in, tile_rows), one
    contiguous block of about TILE_VALUES bytes (the last tile zero-padded). Both
    kernels work tile by tile, on (in // g, g, tile_rows) views whose long inner axis
    is the contiguous one:
    - decode: P[k] = x[:, group k] @ codes[group k] is one batched matmul of small but
      BLAS-friendly shapes, then P is scaled by scales[k] and summed over k along
      that inner axis;
    - prefill: a dequantized tile (in, rows) is already the right operand of x @ W.T,
      and scales and mins broadcast along the inner axis.
    (Row-major codes would need a transposing copy of every tile, and a plain
    transposed (in, out) array makes a tile of a wide matrix hundreds of short runs
    far apart.)
    """

    def __init__(self, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, n_out: int):
        self.codes = codes  # (n_tiles, in, tile_rows) int8: W's codes, transposed, tile by tile
        self.scales = scales  # (in // g, n_tiles * tile_rows) float32 (padding: 0)
        self.mins = mins  # (in // g, n_tiles * tile_rows) float32, or None
        self.n_tiles, n_in, self.tile_rows = codes.shape
        self.shape = (int(n_out), int(n_in))
        self.group = n_in // scales.shape[0]

    @classmethod
    def from_rows(cls, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> QuantWeight:
        """From row-major codes (out, in) and scales, mins (in // g, out)."""
        n_out, n_in = codes.shape
        rows = _tile_rows(n_out, n_in)
        n_tiles = -(-n_out // rows)
        tiles = np.zeros((n_tiles, n_in, rows), np.int8)
        _store_tiles(tiles, 0, codes)
        return cls(tiles, _pad_columns(scales, n_tiles * rows),
                   None if mins is None else _pad_columns(mins, n_tiles * rows), n_out)

    def codes_rows(self) -> np.ndarray:
        """The codes row-major, (out, in) int8 (a copy)."""
        return self.codes.transpose(0, 2, 1).reshape(-1, self.shape[1])[: self.shape[0]]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    def _dequantize(self, rows: slice | np.ndarray, out: np.ndarray) -> None:
        ids = _row_ids(rows, self.shape[0])
        out_t = out.T  # (in, n_rows)
        np.copyto(out_t, self.codes[ids // self.tile_rows, :, ids % self.tile_rows].T)
        self._scale(out_t, ids)

    def _scale(self, w_t: np.ndarray, rows: slice | np.ndarray) -> None:
        """Codes -> weights in place: w_t (in, n_rows) float32 holds W[rows].T's codes."""
        w = w_t.reshape(self.scales.shape[0], self.group, w_t.shape[1])  # (groups, g, rows)
        np.multiply(w, self.scales[:, None, rows], out=w)
        if self.mins is not None:
            np.add(w, self.mins[:, None, rows], out=w)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        x = self._input(x)
        n = x.shape[0]
        y = self.padded_output(n)
        if 0 < n <= tuning.DECODE_MAX_ROWS:
            self._decode_tiles(x, y, 0, self.n_tiles)
            mins_part = self._mins_part(x)
            if mins_part is not None:
                y += mins_part
        elif n > tuning.DECODE_MAX_ROWS:
            self._prefill_tiles(x, y, 0, self.n_tiles)
        return y[:, : self.shape[0]]

    def padded_output(self, n: int) -> np.ndarray:
        """An uninitialized y (n, n_tiles * tile_rows): the kernels write whole tiles."""
        return np.empty((n, self.n_tiles * self.tile_rows), np.float32)

    def _prefill_tiles(self, x: np.ndarray, y: np.ndarray, b0: int, b1: int) -> None:
        """y[:, tiles b0:b1] = x @ W[those rows].T: each tile dequantized, then one GEMM over it.

        One GEMM a tile, never one over several: BLAS picks its kernels by a product's
        shape, and a column's sum may come out another way in a wider one (OpenBLAS's
        Haswell kernels on a Zen 5 did), so a tile's floats would depend on the tiles
        computed beside it, which is how the threads share the work out.
        """
        n_in, rows = self.shape[1], self.tile_rows
        w = scratch("prefill", (n_in, rows))  # (in, rows): one tile of W.T, as float32
        for b in range(b0, b1):
            r0, r1 = b * rows, (b + 1) * rows
            np.copyto(w, self.codes[b])
            self._scale(w, slice(r0, r1))
            np.matmul(x, w, out=y[:, r0:r1])

    def _decode_tiles(self, x: np.ndarray, y: np.ndarray, b0: int, b1: int) -> None:
        """y[:, tiles b0:b1] = x @ W[those rows].T for a few rows of x, without dequantizing
        (formats with mins: but for their part, `_mins_part`).

        Each tile's codes are converted to float32 and multiplied with x group by group;
        the partial sums of a span of tiles are then scaled and summed in one pass. The
        loop over tiles is two numpy calls on views prepared before it: when several
        threads share the work, each return from numpy waits for the GIL, so Python work
        between the calls would cost twice.
        """
        xg, span, partials = self._decode_buffers(x, b1 - b0)
        tile = scratch("tile", (self.shape[1], self.tile_rows))  # one tile's codes as float32
        tile_groups = tile.reshape(xg.shape[0], self.group, self.tile_rows)  # (groups, g, rows)
        for s0 in range(b0, b1, span):
            m = min(span, b1 - s0)
            for j in range(m):
                np.copyto(tile, self.codes[s0 + j])
                np.matmul(xg, tile_groups, out=partials[j])  # [k, :, r] = x[:, group k] . codes[group k, r]
            self._scale_and_sum(partials[:m], y, s0)

    def _decode_buffers(self, x: np.ndarray, n_tiles: int) -> tuple[np.ndarray, int, np.ndarray]:
        """What the decode kernel needs for n_tiles tiles: x by groups (groups, n, g), the
        span of tiles whose partial sums are summed at once, and a buffer for them
        (span, groups, n, tile_rows)."""
        n, n_in = x.shape
        n_groups = n_in // self.group
        xg = np.ascontiguousarray(x.reshape(n, n_groups, self.group).transpose(1, 0, 2))
        span = max(1, min(n_tiles, tuning.PARTIAL_VALUES // (n_groups * n * self.tile_rows)))
        return xg, span, scratch("partials", (span, n_groups, n, self.tile_rows))

    def _scale_and_sum(self, partials: np.ndarray, y: np.ndarray, s0: int) -> None:
        """y[:, r] = sum_k scales[k, r] * partials[j, k, :, r] for the span of tiles from s0
        (partials (m, groups, n, tile_rows)), in one pass over them."""
        m, n_groups, n, rows = partials.shape
        r0, r1 = s0 * rows, (s0 + m) * rows
        scales = self.scales[:, r0:r1].reshape(n_groups, m, rows).transpose(1, 0, 2)  # (m, groups, rows)
        np.einsum("mknr,mkr->mnr", partials, scales, out=y[:, r0:r1].reshape(n, m, rows).transpose(1, 0, 2))

    def _mins_part(self, x: np.ndarray) -> np.ndarray | None:
        """The decode kernel's last part (formats with mins), to add to y once every tile
        is done: sum_k mins[k, r] * sum(x[:, group k]), (n, padded out); None without mins.

        One product over all of y's (padded) columns, never per range of tiles: BLAS may
        give a column other floats depending on where in the product it falls, so the
        floats would move with how the tiles were shared out.
        """
        if self.mins is None:
            return None
        n, n_in = x.shape
        x_sums = x.reshape(n, n_in // self.group, self.group).sum(axis=2)  # (n, groups)
        return x_sums @ self.mins


def _row_ids(rows: slice | np.ndarray, n_rows: int) -> np.ndarray:
    """The rows of a matrix of n_rows as an index array (an embedding lookup: without
    building all n_rows indices to pick a few)."""
    return np.arange(*rows.indices(n_rows)) if isinstance(rows, slice) else np.asarray(rows)


def _store_tiles(tiles: np.ndarray, first: int, codes: np.ndarray) -> None:
    """Write row-major codes (k, in) into tiles (n_tiles, in, rows) from tile `first` on."""
    rows = tiles.shape[2]
    for b in range(-(-len(codes) // rows)):
        part = codes[b * rows: (b + 1) * rows]
        tiles[first + b, :, : len(part)] = part.T


def _pad_columns(a: np.ndarray, n: int) -> np.ndarray:
    """a (k, m) with zero columns appended up to (k, n)."""
    if a.shape[1] == n:
        return np.ascontiguousarray(a)
    out = np.zeros((a.shape[0], n), a.dtype)
    out[:, : a.shape[1]] = a
    return out


# ---------------------------------------------------------------------------------------
# Scratch buffers

_scratch = threading.local()  # per thread: name -> a flat float32 buffer, grown as needed


def scratch(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialized float32 array of this shape: this thread's buffer `name`, reused.

    A kernel's temporaries (a tile as float32, the partial sums) are megabytes at
    many rows. Allocated afresh at every call, glibc may hand their pages back to
    the OS between calls (it trims the heap's free top past a threshold that moves
    with its allocations) and the next call first-touches them again: a helper
    process took 16,800-23,600 page faults per 32-row step that way. So each thread
    keeps one buffer per name, for the whole life of the thread: the caller must
    be done with it before it asks for the same name again.
    """
    size = math.prod(shape)
    buffer = getattr(_scratch, name, None)
    if buffer is None or buffer.size < size:
        buffer = np.empty(size, np.float32)
        setattr(_scratch, name, buffer)
    return buffer[:size].reshape(shape)


# ---------------------------------------------------------------------------------------
# Unpacking the ggml block formats
#
# Each unpacker takes the raw bytes of some rows, uint8 (rows, bytes_per_row), and
# returns (codes int8 (rows, in), scales float32 (rows, in // g), mins float32 or None);
# load_weight stores scales and mins transposed.


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (..., 2) holding an IEEE half -> float32 (...)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes (..., m) -> their low nibbles then their high nibbles, (..., 2, m) uint8."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def _bits(b: np.ndarray) -> np.ndarray:
    """Bytes (..., m) -> their bits, least significant first, (..., 8 * m) uint8 0/1."""
    return np.unpackbits(b, axis=-1, bitorder="little")


def _blocks(raw: np.ndarray, qtype: T) -> np.ndarray:
    """uint8 (rows, bytes_per_row) -> (rows, blocks_per_row, bytes_per_block)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    return raw.reshape(raw.shape[0], -1, type_size)


def _flat(a: np.ndarray) -> np.ndarray:
    """(rows, ...) -> (rows, -1)."""
    return a.reshape(a.shape[0], -1)


def _unpack_q8_0(raw):
    # block: d f16 | 32 x int8
    b = _blocks(raw, T.Q8_0)
    return _flat(b[..., 2:].view(np.int8)), _f16(b[..., 0:2]), None


def _unpack_q4_0(raw):
    # block: d f16 | 16 bytes: values 0..15 in the low nibbles, 16..31 in the high; w = d * (q - 8)
    b = _blocks(raw, T.Q4_0)
    q = _nibbles(b[..., 2:]).astype(np.int8) - 8
    return _flat(q), _f16(b[..., 0:2]), None


def _unpack_q4_1(raw):
    # block: d f16 | m f16 | 16 bytes of nibbles; w = d * q + m
    b = _blocks(raw, T.Q4_1)
    q = _nibbles(b[..., 4:]).astype(np.int8)
    return _flat(q), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """32 five-bit values: bit j of qh (4 bytes) is the high bit of value j -> (..., 32) int8."""
    low = _nibbles(qs).reshape(*qs.shape[:-1], 32)
    return (low | (_bits(qh) << 4)).astype(np.int8)


def _unpack_q5_0(raw):
    # block: d f16 | qh 4 bytes | 16 bytes of nibbles; w = d * (q - 16)
    b = _blocks(raw, T.Q5_0)
    return _flat(_q5(b[..., 2:6], b[..., 6:]) - 16), _f16(b[..., 0:2]), None


def _unpack_q5_1(raw):
    # block: d f16 | m f16 | qh 4 bytes | 16 bytes of nibbles; w = d * q + m
    b = _blocks(raw, T.Q5_1)
    return _flat(_q5(b[..., 4:8], b[..., 8:])), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _unpack_q2_k(raw):
    # super-block of 256: 16 scale bytes (low nibble: scale, high: min of a 16-value
    # sub-block) | 64 bytes of 2-bit values | d f16 | dmin f16; w = d*sc * q - dmin*m.
    # Each 128-value half is 32 bytes read 4 times at shifts 0, 2, 4, 6.
    b = _blocks(raw, T.Q2_K)
    sc, qs = b[..., 0:16], b[..., 16:80]
    d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    q = (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3  # (rows, blocks, half, shift, 32)
    scales = d[..., None] * (sc & 0x0F).astype(np.float32)
    mins = -(dmin[..., None] * (sc >> 4).astype(np.float32))
    return _flat(q.astype(np.int8)), _flat(scales), _flat(mins)


def _unpack_q3_k(raw):
    # super-block of 256: hmask 32 bytes (bit k of byte l: high bit of value 32k + l) |
    # 64 bytes of 2-bit values (as Q2_K) | 12 bytes of sixteen 6-bit scales | d f16.
    # w = d * (scale - 32) * (q - 4 * (1 - high bit)).
    b = _blocks(raw, T.Q3_K)
    hmask, qs, packed, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    low = (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3  # (rows, blocks, half, shift, 32)
    high = _bits(hmask[..., :, None]).reshape(*hmask.shape[:-1], 32, 8)  # [l, k]: bit k of hmask[l]
    high = high.swapaxes(-1, -2).reshape(low.shape)  # value 32k + l
    q = low.astype(np.int8) - ((1 - high) << 2).astype(np.int8)
    # scales: low 4 bits from packed[0:8] (low nibbles for 0-7, high for 8-15),
    # top 2 bits from packed[8:12] (2 bits per scale, in groups of 4)
    lo = _nibbles(packed[..., 0:8]).reshape(*packed.shape[:-1], 16)
    hi = (packed[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    sc = (lo | (hi.reshape(lo.shape) << 4)).astype(np.int8) - 32
    return _flat(q), _flat(d[..., None] * sc.astype(np.float32)), None


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of eight 6-bit scales and eight 6-bit mins of Q4_K / Q5_K -> (..., 8) each.

    Bytes 0-3: scales 0-3 (low 6 bits) + top bits of scales 4-7; bytes 4-7: mins 0-3 +
    top bits of mins 4-7; bytes 8-11: low nibble = scales 4-7, high nibble = mins 4-7.
    """
    s, m, sm = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([s & 0x3F, (sm & 0x0F) | ((s >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (sm >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _unpack_q4_k(raw):
    # super-block of 256: d f16 | dmin f16 | 12 bytes of scales/mins | 128 bytes of nibbles:
    # each 32 bytes hold sub-block 2i (low nibbles) and 2i + 1 (high). w = d*sc * q - dmin*m.
    b = _blocks(raw, T.Q4_K)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales_mins(b[..., 4:16])
    qs = b[..., 16:144]
    q = _nibbles(qs.reshape(*qs.shape[:-1], 4, 32))  # (rows, blocks, 4, 2, 32)
    return _flat(q.astype(np.int8)), _flat(d[..., None] * sc), _flat(-(dmin[..., None] * m))


def _unpack_q5_k(raw):
    # as Q4_K plus qh 32 bytes before the nibbles: bit k of qh[l] is the high bit of value 32k + l
    b = _blocks(raw, T.Q5_K)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales_mins(b[..., 4:16])
    qh, qs = b[..., 16:48], b[..., 48:176]
    low = _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 8, 32)
    high = _bits(qh[..., :, None]).reshape(*qh.shape[:-1], 32, 8).swapaxes(-1, -2)  # (.., 8, 32)
    q = (low | (high << 4)).astype(np.int8)
    return _flat(q), _flat(d[..., None] * sc), _flat(-(dmin[..., None] * m))


def _unpack_q6_k(raw):
    # super-block of 256: ql 128 bytes (low 4 bits) | qh 64 bytes (high 2 bits) |
    # 16 int8 scales of 16-value sub-blocks | d f16; w = d * scale * (q - 32).
    # Each 128-value half: value 32s + l takes ql[l + 32 (s % 2)] nibble s // 2 and
    # bits 2s, 2s+1 of qh[l].
    b = _blocks(raw, T.Q6_K)
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc, d = b[..., 192:208].view(np.int8), _f16(b[..., 208:210])
    low = _nibbles(ql.reshape(*ql.shape[:-1], 2, 64))  # (rows, blocks, half, nibble, 64)
    low = low.reshape(*ql.shape[:-1], 2, 4, 32)
    high = (qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    q = (low | (high << 4)).astype(np.int8) - 32
    return _flat(q), _flat(d[..., None] * sc.astype(np.float32)), None


_UNPACKERS = {
    T.Q8_0: _unpack_q8_0,
    T.Q4_0: _unpack_q4_0,
    T.Q4_1: _unpack_q4_1,
    T.Q5_0: _unpack_q5_0,
    T.Q5_1: _unpack_q5_1,
    T.Q2_K: _unpack_q2_k,
    T.Q3_K: _unpack_q3_k,
    T.Q4_K: _unpack_q4_k,
    T.Q5_K: _unpack_q5_k,
    T.Q6_K: _unpack_q6_k,
}

# values per scale in our unpacked form
_GROUP = {T.Q2_K: 16, T.Q3_K: 16, T.Q6_K: 16}
_HAS_MIN = {T.Q4_1, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K}


def load_weight(tensor: Tensor) -> Weight:
    """A 2-D tensor of a GGUF file as a Weight (out, in) we can multiply with."""
    if len(tensor.shape) != 2:
        raise ValueError(f"tensor {tensor.name!r} of shape {tensor.shape} is not a matrix")
    n_out, n_in = tensor.shape
    if tensor.type in (T.F32, T.F16):
        return DenseWeight(tensor.data.reshape(n_out, n_in), tensor.type)
    if tensor.type == T.BF16:
        return DenseWeight(tensor.data.view(np.uint16).reshape(n_out, n_in), T.BF16)
    unpack = _UNPACKERS.get(tensor.type)
    if unpack is None:
        raise UnsupportedModelError(
            f"tensor {tensor.name!r}: type {tensor.type.name} is not supported"
        )
    g = _GROUP.get(tensor.type, 32)
    raw = tensor.data.reshape(n_out, -1)
    rows = _tile_rows(n_out, n_in)
    n_tiles = -(-n_out // rows)
    codes = np.zeros((n_tiles, n_in, rows), np.int8)
    scales = np.zeros((n_in // g, n_tiles * rows), np.float32)
    mins = np.zeros((n_in // g, n_tiles * rows), np.float32) if tensor.type in _HAS_MIN else None
    step = max(1, tuning.UNPACK_ROWS // rows)  # tiles unpacked at once
    for c0 in range(0, n_tiles, step):
        c1 = min(c0 + step, n_tiles)
        r0, r1 = c0 * rows, min(c1 * rows, n_out)
        c, s, m = unpack(raw[r0:r1])  # (r1 - r0, in), (r1 - r0, in // g) x 2
        _store_tiles(codes, c0, c)
        scales[:, r0:r1] = s.T
        if mins is not None:
            mins[:, r0:r1] = m.T
    release_pages(tensor.data)  # unpacked: the file's bytes are not needed in memory
    return QuantWeight(codes, scales, mins, n_out)


def concat_weights(weights: Sequence[Weight]) -> Weight:
    """Stack weights with the same `in` along `out` (merged QKV, gate/up projections)."""
    if not weights:
        raise ValueError("concat_weights needs at least one weight")
    n_in = weights[0].shape[1]
    if any(w.shape[1] != n_in for w in weights):
        raise ValueError(f"cannot concatenate weights of shapes {[w.shape for w in weights]}")
    if all(isinstance(w, QuantWeight) for w in weights):
        g = min(w.group for w in weights)

        def per_group(a: np.ndarray, w: QuantWeight) -> np.ndarray:
            return np.repeat(a, w.group // g, axis=0)  # (in // g, out)

        codes = np.concatenate([w.codes_rows() for w in weights])
        scales = np.concatenate([per_group(w.scales[:, : w.shape[0]], w) for w in weights], axis=1)
        mins = None
        if any(w.mins is not None for w in weights):
            mins = np.concatenate([
                per_group(w.mins[:, : w.shape[0]], w) if w.mins is not None
                else np.zeros((n_in // g, w.shape[0]), np.float32)
                for w in weights
            ], axis=1)
        return QuantWeight.from_rows(codes, scales, mins)
    kinds = {w.kind for w in weights if isinstance(w, DenseWeight)}
    if all(isinstance(w, DenseWeight) for w in weights) and len(kinds) == 1:
        return DenseWeight(np.concatenate([w.data for w in weights]), kinds.pop())
    return StackedWeight(list(weights))


def reorder_rows(w: Weight, order: np.ndarray) -> Weight:
    """W[order]: the same rows in another order (a NEOX model's Q and K, see
    engine/architectures.py neox_pairs_order)."""
    if isinstance(w, QuantWeight):
        return QuantWeight.from_rows(w.codes_rows()[order], w.scales[:, order],
                                     None if w.mins is None else w.mins[:, order])
    if isinstance(w, DenseWeight):
        return DenseWeight(w.data[order], w.kind)
    raise TypeError(f"cannot reorder the rows of {w!r}")


class StackedWeight(Weight):
    """Weights of different kinds (say F16 and Q4_K) stacked along `out`, each kept as it is."""

    def __init__(self, parts: list[Weight]):
        self.parts = parts
        self.shape = (sum(w.shape[0] for w in parts), parts[0].shape[1])
        self.starts = np.cumsum([0] + [w.shape[0] for w in parts])  # first row of each part

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.parts)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        return np.concatenate([w.matmul(x) for w in self.parts], axis=1)

    def _dequantize(self, rows: slice | np.ndarray, out: np.ndarray) -> None:
        ids = _row_ids(rows, self.shape[0])  # whichever part they are in
        part = np.searchsorted(self.starts, ids, side="right") - 1
        for i, w in enumerate(self.parts):
            mine = part == i
            if mine.any():
                out[mine] = w.rows(ids[mine] - self.starts[i])

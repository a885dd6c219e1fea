"""Weights that share a plain kernel's work out: the wrappers `Accelerator.wrap` installs.

Each wraps one weight of engine/quants.py and has the same interface (a Weight), so the
model's code does not know it is there. Its matmul cuts the plain kernel's work into
ranges (of rows, or of tiles) through the kernel's own range entry points, hands them to
the worker threads (and, for decode matmuls of quantized weights, to the helper
process), and otherwise does what the plain matmul does. A quantized weight's unit is
its stored tile, which every side computes with the same numpy calls, so its floats do
not depend on how the work was shared; a dense weight's rows are shared out as ranges,
which BLAS may sum in another order (a last-bit difference).
"""

from __future__ import annotations

import numpy as np

from engine import tuning
from engine.quants import QuantWeight, Weight

from .helper import Helper
from .threads import WorkerPool


class Accelerated(Weight):
    """A weight whose matmul is shared out; everything else is the plain weight's."""

    def __init__(self, plain: Weight, pool: WorkerPool):
        self.plain = plain
        self.pool = pool
        self.shape = plain.shape

    @property
    def nbytes(self) -> int:
        return self.plain.nbytes

    def _dequantize(self, rows: slice | np.ndarray, out: np.ndarray) -> None:
        self.plain._dequantize(rows, out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.plain!r})"


class SplitRows(Accelerated):
    """A dense (or any row-wise) weight: rows of W shared out over the threads."""

    def matmul(self, x: np.ndarray) -> np.ndarray:
        w = self.plain
        x = w._input(x)
        n_out, n_in = w.shape
        y = np.empty((x.shape[0], n_out), np.float32)
        if y.size:
            min_work = tuning.DECODE_PARALLEL_MIN_WORK // x.shape[0] if x.shape[0] <= tuning.DECODE_MAX_ROWS else None
            self.pool.parallel_for(lambda r0, r1: w._matmul_rows(x, y, r0, r1), n_out, n_out * n_in, min_work)
        return y


class SplitTiles(Accelerated):
    """A quantized weight: its tiles shared out over the threads, and for decode matmuls
    with the helper process (weight number `index` there) when there is one that is free."""

    def __init__(self, plain: QuantWeight, pool: WorkerPool, helper: Helper | None = None, index: int = -1):
        super().__init__(plain, pool)
        self.helper = helper
        self.index = index

    def matmul(self, x: np.ndarray) -> np.ndarray:
        w = self.plain
        x = w._input(x)
        n = x.shape[0]
        n_out, n_in = w.shape
        if n == 0:
            return w.matmul(x)
        if n <= tuning.DECODE_MAX_ROWS:
            if self.helper is not None and w.n_tiles > 1 and n_out * n_in * n >= tuning.HELPER_MIN_WORK:
                y = self.helper.matmul(self.index, x)
                if y is not None:  # else the helper is busy, resting or gone: computed here
                    return y
            y = w.padded_output(n)
            self.pool.parallel_for(lambda b0, b1: w._decode_tiles(x, y, b0, b1), w.n_tiles, n_out * n_in,
                                   tuning.DECODE_PARALLEL_MIN_WORK // n)
            mins_part = w._mins_part(x)
            if mins_part is not None:
                y += mins_part
        else:
            y = w.padded_output(n)
            self.pool.parallel_for(lambda b0, b1: w._prefill_tiles(x, y, b0, b1), w.n_tiles, n_out * n_in,
                                   items_per_chunk=max(1, tuning.PREFILL_CHUNK_VALUES // (n_in * w.tile_rows)))
        return y[:, :n_out]

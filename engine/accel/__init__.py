"""Acceleration: the plain kernels of engine/quants.py shared out over threads and a helper process.

A layer on top of the engine, which reads first without it: engine/quants.py's kernels
and engine/architectures.py's forward run on the calling thread and import nothing of
what is here. At load time (`load_model`, engine/model.py, the one place that imports
this package), `install` swaps each matrix of a model's `Weights` for a wrapper weight
(engine/accel/weights.py) with the same interface, whose matmul shares the plain
kernel's tiles out, hands the forward's work between the matmuls to the threads too
(`architectures.share_work_with`), and returns the `Accelerator` that owns what they
share it with:

- threads.py: a pool of worker threads (`WorkerPool`, `parallel_for`), and the process
  settings they rely on (BLAS on one thread, set by `single_threaded_blas`);
- helper.py: a second process that computes part of every decode matmul, since
  threads sharing many short numpy calls mostly hand each other the GIL;
- halves.py: for a decoder, the same process stepping some of a batch's sequences
  whole, their KV caches in memory both processes map: `Accelerator.forward` stands in
  for architectures.forward, and `allocate_kv` gives the caches their storage.

Their constants are in engine/tuning.py, the engine's one table. `model.accel` is the
accelerator (None with one thread). Its `close()` stops the helper process and joins
the threads; the model keeps working, on its calling thread.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine import architectures
from engine.architectures import Batch, BertWeights, Hyperparameters, Weights
from engine.kv_cache import private_zeros
from engine.quants import DenseWeight, QuantWeight, StackedWeight, Weight

from . import helper as _helper
from .halves import Halves
from .helper import Helper
from .threads import (WorkerPool, blas_kernel, blas_kernel_below_cpu, num_threads, parallel_for,
                      release_freed_memory, single_threaded_blas)
from .weights import Accelerated, SplitRows, SplitTiles

__all__ = ["install", "Accelerator", "Accelerated", "quantized_matrices", "num_threads", "blas_kernel",
           "blas_kernel_below_cpu", "single_threaded_blas", "parallel_for", "release_freed_memory",
           "WorkerPool", "Helper"]


class Accelerator:
    """A model's worker threads and helper process (if any): what its wrapper weights share
    their work with. `close()` stops both; idempotent."""

    def __init__(self, n_threads: int, helper: Helper | None = None, halves: Halves | None = None):
        self.pool = WorkerPool(n_threads)
        self.helper = helper
        self.halves = halves
        self._helper_index = {id(w): i for i, w in enumerate(helper.weights)} if helper else {}

    def forward(self, hp: Hyperparameters, weights: Weights, batch: Batch, all_logits: bool = False,
                abandon=None) -> list[np.ndarray]:
        """architectures.forward, a decode step halved with the helper where it can be (halves.py)."""
        if self.halves is None:
            return architectures.forward(hp, weights, batch, all_logits, abandon)
        return self.halves.forward(hp, weights, batch, all_logits, abandon)

    def allocate_kv(self, n_values: int) -> np.ndarray:
        """A KV cache's storage (engine/kv_cache.py): shared with the helper when it steps sequences."""
        return self.halves.blocks.allocate(n_values) if self.halves is not None else private_zeros(n_values)

    @property
    def n_threads(self) -> int:
        return self.pool.n_threads

    def wrap(self, weight: Weight) -> Weight:
        """The weight with its matmul shared out (StackedWeight: each part's)."""
        if isinstance(weight, Accelerated):
            return weight
        if isinstance(weight, StackedWeight):
            return StackedWeight([self.wrap(part) for part in weight.parts])
        if isinstance(weight, QuantWeight):
            index = self._helper_index.get(id(weight))
            return SplitTiles(weight, self.pool, self.helper if index is not None else None,
                              -1 if index is None else index)
        if isinstance(weight, DenseWeight):
            return SplitRows(weight, self.pool)
        return weight

    def close(self) -> None:
        if self.helper is not None:
            self.helper.close()
        self.pool.close()

    def __enter__(self) -> Accelerator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Accelerator(n_threads={self.n_threads}, helper={'yes' if self.helper else 'no'})"


def install(hp: Hyperparameters, weights: Weights | BertWeights, n_threads: int) -> Accelerator | None:
    """Share the matmuls of a model's weights out over n_threads threads (and a helper
    process, for big models: see helper.start, which steps some sequences of a decoder's
    batches too): every matrix of `weights` is replaced, in place, by its wrapper, and the
    forward's other work goes to the threads too. None (and the weights left as they
    are) with one thread."""
    if n_threads < 2:
        return None
    plain = _plain_copy(weights) if isinstance(weights, Weights) and hp.causal else None
    helper = _helper.start(quantized_matrices(weights), n_threads, None if plain is None else (hp, plain))
    accelerator = Accelerator(n_threads, helper, Halves(helper, plain) if helper and plain else None)
    architectures.share_work_with(parallel_for)  # on the latest pool still open (this one), else the calling thread
    wrapped: dict[int, Weight] = {}

    def wrap(weight: Weight) -> Weight:  # once per matrix: the output may be the embeddings
        if id(weight) not in wrapped:
            wrapped[id(weight)] = accelerator.wrap(weight)
        return wrapped[id(weight)]

    for holder in (weights, *weights.blocks):
        for name, value in list(vars(holder).items()):
            if isinstance(value, Weight):
                setattr(holder, name, wrap(value))
    return accelerator


def _plain_copy(weights: Weights) -> Weights:
    """The weights' tree copied (not their arrays): the matrices as they are, before `install`
    wraps those of the original."""
    return dataclasses.replace(weights, blocks=[dataclasses.replace(block) for block in weights.blocks])


def quantized_matrices(weights: Weights | BertWeights) -> list[QuantWeight]:
    """Every quantized matrix of a model's weights, once each (the output matrix may be the
    embeddings), the plain ones behind wrappers included."""
    found: dict[int, QuantWeight] = {}
    matrices = [value for holder in (weights, *weights.blocks) for value in vars(holder).values()
                if isinstance(value, Weight)]
    for m in matrices:
        for part in (m.parts if isinstance(m, StackedWeight) else [m]):
            part = part.plain if isinstance(part, Accelerated) else part
            if isinstance(part, QuantWeight):
                found[id(part)] = part
    return list(found.values())

"""A decode step in two halves: the helper process steps some of a batch's sequences, the
model's process the others, each through all the layers.

Why: sharing each matmul's tiles with the helper (helper.py) costs two hand-overs per
matmul, ~150 a step, and leaves the work between the matmuls (attention, norms, RoPE:
a fifth of a 32-row step) to the model's process alone. Two processes that each run
the layers over their own rows hand over once a step. But each then converts every
tile's codes for itself, which one split of the tiles does once: halves pay from a
dozen rows on (docs/performance.md, "A step in two halves"), and the LM head, the
biggest matrix, still runs once over all the rows, its tiles shared.

What it takes: the helper maps the weights (it unpickles a plain `Weights` tree over
the shared memory when it starts, helper.py) and the KV caches. A model with a helper
gives each cache a block of memory of its own, a memfd (`SharedBlocks`, the caches'
`allocate`), which the helper maps as soon as it exists. A step (`Halves.forward`, in
place of architectures.forward):

    model's process                               helper process
    makes room in every cache
    picks the helper's sequences: from the
      end of the batch, its share of the rows
    their part of the batch -> pipe ->            the same Batch over its mappings
    runs the layers over its own part             runs the layers over its part, the
      (the plain weights: one core)                 final states into the shared area
    waits for the answer                 <-       writes one byte
    advances the helper's caches
    the LM head over all the rows, its tiles shared with the helper

The share follows what happens, as the tiles' share does: when the helper's answer is
there as the model's half ends, it gets more rows next time, otherwise fewer. A
sequence's floats are the plain forward's over the rows of its half, as they would be
in a smaller batch. When the helper dies mid-step, or is late (it gets as long again
as the model's half took: helper.py `Helper.step_beside`), the model computes its half
itself, over copies of its sequences' caches, which a late helper may still write.
Only decode steps are halved (a prompt's chunk would leave one side idle); the others
share tiles as before. The helper's side is helper.py's `HelperSteps`; the constants
are in engine/tuning.py.
"""

from __future__ import annotations

import itertools
import mmap
import os
import weakref
from typing import Callable

import numpy as np

from engine import architectures, tuning
from engine.architectures import Batch, Hyperparameters, Weights
from engine.kv_cache import private_zeros

from .helper import Helper

# blocks shared at once, at most: each holds a descriptor in both processes (a mapping
# keeps its own), which a server's connections need too; past it a cache is private
MAX_SHARED_BLOCKS = 256


class SharedBlocks:
    """The storage of a model's KV caches in memory the helper maps too: a memfd per block.

    `allocate` is the caches' allocator (engine/kv_cache.py). Each block has a number,
    by which the helper knows it; a block that could not be shared (MAX_SHARED_BLOCKS
    are, or no descriptor is left) is private memory, and its cache stays in the model's half.
    """

    def __init__(self, helper: Helper):
        self.helper = helper
        self._numbers: dict[int, int] = {}  # id(block) -> its number
        self._next = itertools.count()

    def allocate(self, n_values: int) -> np.ndarray:
        """n_values float32 zeros, in a new memfd the helper is told to map."""
        if len(self._numbers) >= MAX_SHARED_BLOCKS:
            return private_zeros(n_values)
        size = 4 * max(1, n_values)
        try:
            fd = os.memfd_create("lmsp-kv")
        except OSError:
            return private_zeros(n_values)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
            number = next(self._next)
            self.helper.map_block(number, fd, size)
        except OSError:
            return private_zeros(n_values)
        finally:
            os.close(fd)  # the mappings keep the memory
        block = np.frombuffer(memory, np.float32, n_values)
        self._numbers[id(block)] = number
        weakref.finalize(block, self._free, id(block), number).atexit = False  # (the helper ends with us)
        return block

    def number(self, block: np.ndarray) -> int | None:
        """The number of a block `allocate` made, or None."""
        return self._numbers.get(id(block))

    def _free(self, key: int, number: int) -> None:
        self._numbers.pop(key, None)
        self.helper.forget_block(number)


class Halves:
    """The model's side of the halved step: `forward` stands in for architectures.forward."""

    def __init__(self, helper: Helper, plain: Weights):
        self.helper = helper
        self.plain = plain        # the weights not wrapped: the model's half runs on one core
        self.blocks = SharedBlocks(helper)
        self.share = tuning.HALVES_SHARE  # of each step's rows, stepped by the helper
        self.halved = 0                   # steps halved so far (tests watch it)

    def forward(self, hp: Hyperparameters, weights: Weights, batch: Batch, all_logits: bool = False,
                abandon: Callable[[], bool] | None = None) -> list[np.ndarray]:
        """architectures.forward, its decode steps halved with the helper when it is free."""
        theirs = None if all_logits else self._their_sequences(batch)
        if not theirs:
            return architectures.forward(hp, weights, batch, all_logits, abandon)
        own = [i for i in range(len(batch.sequences)) if i not in theirs]
        own_batch, their_batch = batch.subset(own), batch.subset(theirs)
        done = self.helper.step_beside(
            self._spec(their_batch),
            lambda: architectures.hidden_states(hp, self.plain, own_batch, all_rows=False, abandon=abandon))
        if done is None:  # the helper is busy, resting or gone
            return architectures.forward(hp, weights, batch, all_logits, abandon)
        own_x, answered, early = done                            # (m_own, d)
        self.halved += 1
        self._follow(early)
        if answered:
            their_x = self._their_states(their_batch)             # (m_theirs, d)
        else:  # dead or late: its half here (to the end: our half's caches have advanced), over
            for seq in their_batch.sequences:  # copies of its caches, which a late helper may still write
                seq.cache = seq.cache.copy_prefix(seq.cache.length)
            their_x = architectures.hidden_states(hp, weights, their_batch, all_rows=False)
        states = [None] * len(batch.sequences)  # each sequence's final states, in the batch's order
        for i, x in zip(own + theirs, architectures.per_sequence(own_batch, own_x)
                        + architectures.per_sequence(their_batch, their_x)):
            states[i] = x
        # the LM head once over all the rows, its tiles shared: the biggest matrix is not
        # converted twice, once for each half
        return architectures.per_sequence(batch, architectures.lm_head(hp, weights, np.concatenate(states)))

    def _spec(self, batch: Batch) -> dict:
        """The helper's part of the step as it is sent: each cache's block, capacity and
        start, and the batch's tokens, positions, spans and wanted rows."""
        return {"caches": [(self.blocks.number(seq.cache.storage), seq.cache.capacity, start)
                           for seq, start in zip(batch.sequences, batch.starts)],
                "tokens": batch.tokens, "positions": batch.positions,
                "spans": [(s.start, s.stop) for s in batch.spans], "wanted": batch.wanted}

    def _follow(self, early: bool) -> None:
        """More rows for the helper next time when its answer was there as our half ended, else fewer."""
        low, high = tuning.SHARE_BOUNDS
        step = tuning.HALVES_SHARE_STEP if early else -tuning.HALVES_SHARE_STEP
        self.share = min(high, max(low, self.share + step))

    def _their_sequences(self, batch: Batch) -> list[int]:
        """The helper's sequences for this step, from the end of the batch: its share of the
        rows, of those whose caches it maps; none for a step that is not a decode step.
        Every cache is made room in first (as the forward would): a cache that grows
        gets a new block, whose number is the one the helper must be sent."""
        if (len(batch.sequences) < tuning.HALVES_MIN_SEQUENCES
                or batch.tokens.size > tuning.HALVES_MAX_ROWS or not self.helper.alive):
            return []
        for seq, span, start in zip(batch.sequences, batch.spans, batch.starts):
            seq.cache.reserve(start + span.stop - span.start)  # (a new block: before its number is read)
        theirs, rows = [], 0
        for i in reversed(range(len(batch.sequences))):
            span = batch.spans[i]
            if rows + (span.stop - span.start) / 2 > self.share * batch.tokens.size:
                break
            if self.blocks.number(batch.sequences[i].cache.storage) is not None:
                theirs.append(i)
                rows += span.stop - span.start
        return theirs[::-1] if len(theirs) < len(batch.sequences) else []

    def _their_states(self, batch: Batch) -> np.ndarray:
        """The helper's answer: its sequences' final states (m, d) copied out, their caches advanced."""
        for seq, span in zip(batch.sequences, batch.spans):
            seq.cache.length += span.stop - span.start
        return self.helper.states[: len(batch.output_rows)].copy()

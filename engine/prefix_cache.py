"""A cache of finished sequences' KV caches, reused by the longest common token prefix.

The next turn of a conversation, a tool round trip, or a request with the same
system prompt starts with tokens an earlier sequence has already run: their keys
and values are the same (a position's K/V depend only on the tokens up to it), so
a new sequence copies them instead of computing them again. Only the tokens after
the common prefix are prefilled.

Entries are whole finished sequences (prompt and generated tokens). The cache is
bounded in bytes of K/V storage and evicts the least recently used entry first.
An entry that is a prefix of a newer one is dropped: the newer one covers it.
The scheduler's worker thread uses it while callers may `clear()` it: a lock
keeps each operation whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from . import tuning
from .kv_cache import Sequence


class PrefixCache:
    """Finished sequences, looked up by longest common token prefix; LRU-bounded in bytes."""

    def __init__(self, max_bytes: int = tuning.PREFIX_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.nbytes = 0
        # id -> (tokens (L,) int64 of the cached positions, the sequence holding them)
        self._entries: OrderedDict[int, tuple[np.ndarray, Sequence]] = OrderedDict()
        self._next_id = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def start(self, prompt: list[int], new_sequence) -> tuple[Sequence, int]:
        """A sequence for `prompt`, with the longest cached prefix already in its KV cache.

        `new_sequence(tokens)` makes a sequence with an empty cache. Returns the
        sequence and how many prompt tokens came from the cache. At least the
        last prompt token is left to compute: its logits give the first output token.
        """
        with self._lock:
            return self._start(prompt, new_sequence)

    def _start(self, prompt: list[int], new_sequence) -> tuple[Sequence, int]:
        prompt_arr = np.asarray(prompt, np.int64)                  # (P,)
        best_id, best_n = None, 0
        for entry_id, (tokens, _) in self._entries.items():
            n = common_prefix_length(tokens, prompt_arr)
            if n > best_n:
                best_id, best_n = entry_id, n
        best_n = min(best_n, len(prompt) - 1)
        if best_id is None or best_n <= 0:
            return new_sequence(prompt), 0
        self._entries.move_to_end(best_id)
        seq = self._entries[best_id][1].fork(best_n)
        seq.tokens = list(prompt)
        return seq, best_n

    def store(self, seq: Sequence) -> None:
        """Keep a finished sequence's cache (taking ownership of it) for later prefixes."""
        with self._lock:
            self._store(seq)

    def _store(self, seq: Sequence) -> None:
        n = seq.cache.length
        if n == 0 or seq.cache.nbytes * n // seq.cache.capacity > self.max_bytes:
            return
        if self.nbytes + seq.cache.nbytes > self.max_bytes and seq.cache.capacity >= n + n // 2:
            # A cache's storage grows by doubling: one that ends at 1,001 tokens holds room
            # for 2,000, and would take twice the bytes it needs. When the budget is short,
            # a copy of what it holds is kept instead, so that more conversations stay: the
            # copy costs time at the end of a request (40 ms for SmolLM2's 1,001 tokens),
            # a conversation dropped costs its next turn a cold prefill (1.9 s at 1,000).
            seq = seq.fork(n)
        tokens = np.asarray(seq.tokens[:n], np.int64)              # (n,)
        for entry_id, (old, _) in list(self._entries.items()):
            common = common_prefix_length(old, tokens)
            if common == len(old):       # the old entry is a prefix of the new one: covered
                self._drop(entry_id)
            elif common == n:            # the new one is a prefix of an old one: nothing to add
                self._entries.move_to_end(entry_id)
                return
        self._entries[self._next_id] = (tokens, seq)
        self._next_id += 1
        self.nbytes += seq.cache.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))                  # least recently used first

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def _drop(self, entry_id: int) -> None:
        _, seq = self._entries.pop(entry_id)
        self.nbytes -= seq.cache.nbytes


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens the id arrays a and b share."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m

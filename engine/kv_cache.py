"""The key/value cache of a sequence, and the sequence itself.

Each sequence owns its cache: for every layer, the keys and values of every
position seen so far, so a decode step only computes the new token's keys and
values and attends over the stored ones. Storage is float32 (the precision the
attention math runs in; float16 would halve the memory but round every stored
key). It is preallocated and grows geometrically up to the context window, so
a short chat does not pay for a 32k-token window and a long one copies rarely.

A cache's keys and values are views of one flat block of storage, which it asks of
its `allocate` (zeros of n float32 values): private memory by default; the
acceleration layer gives a model's caches memory its helper process maps too, so that
the helper can step some of the sequences of a batch (engine/accel/halves.py).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from . import tuning


def private_zeros(n_values: int) -> np.ndarray:
    """n_values float32 zeros in this process's memory: the storage of a cache by default."""
    return np.zeros(n_values, np.float32)


class KVCache:
    """Keys (n_layer, n_head_kv, capacity, head_dim_k) and values, positions [0, length) valid."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim_k: int, head_dim_v: int,
                 max_length: int, capacity: int = tuning.INITIAL_CAPACITY,
                 allocate: Callable[[int], np.ndarray] = private_zeros):
        self.n_layer = n_layer
        self.n_head_kv = n_head_kv
        self.head_dim_k = head_dim_k
        self.head_dim_v = head_dim_v
        self.max_length = max_length
        self.allocate = allocate
        self.length = 0
        self.storage, self.keys, self.values = self._allot(min(capacity, max_length))

    def _allot(self, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A zeroed block for `capacity` positions, and its keys and values (all keys first)."""
        shape_k = (self.n_layer, self.n_head_kv, capacity, self.head_dim_k)
        shape_v = (self.n_layer, self.n_head_kv, capacity, self.head_dim_v)
        n_k = math.prod(shape_k)
        storage = self.allocate(n_k + math.prod(shape_v))
        return storage, storage[:n_k].reshape(shape_k), storage[n_k:].reshape(shape_v)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def capacity_for(self, n: int) -> int:
        """The capacity `reserve(n)` leaves: the same, or doubled (at least n, at most max_length)."""
        return self.capacity if n <= self.capacity else min(self.max_length, max(n, 2 * self.capacity))

    def reserve(self, n: int) -> None:
        """Make room for positions [0, n), doubling the storage when it must grow."""
        if n > self.max_length:
            raise ValueError(f"{n} positions do not fit a cache of {self.max_length}")
        if n <= self.capacity:
            return
        storage, keys, values = self._allot(self.capacity_for(n))
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self.storage, self.keys, self.values = storage, keys, values

    def store(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write the keys k (T, n_head_kv, head_dim_k) and values v of positions start..start+T."""
        stop = start + k.shape[0]
        self.keys[layer][:, start:stop] = k.transpose(1, 0, 2)
        self.values[layer][:, start:stop] = v.transpose(1, 0, 2)

    def view(self, layer: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys (n_head_kv, stop, head_dim_k) and values (n_head_kv, stop, head_dim_v) of [0, stop)."""
        return self.keys[layer][:, :stop], self.values[layer][:, :stop]

    def truncate(self, n: int) -> None:
        """Forget every position from n on (the storage stays allocated)."""
        self.length = min(self.length, n)

    def copy_prefix(self, n: int) -> KVCache:
        """A new cache holding a copy of positions [0, n): a prefix shared by another sequence."""
        n = min(n, self.length)
        copy = KVCache(self.n_layer, self.n_head_kv, self.head_dim_k, self.head_dim_v,
                       self.max_length, capacity=max(n, 1), allocate=self.allocate)
        copy.keys[:, :, :n] = self.keys[:, :, :n]
        copy.values[:, :, :n] = self.values[:, :, :n]
        copy.length = n
        return copy

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes


class Sequence:
    """A token sequence being run through the model: its tokens and the cache of those already run.

    `tokens[:cache.length]` are in the cache; `tokens[cache.length:]` are pending and
    will be fed to the next forward step(s).
    """

    def __init__(self, tokens: list[int], cache: KVCache):
        self.tokens = list(tokens)
        self.cache = cache

    @property
    def n_pending(self) -> int:
        return len(self.tokens) - self.cache.length

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def fork(self, n: int) -> Sequence:
        """A new sequence sharing (a copy of) the first n cached tokens of this one."""
        n = min(n, self.cache.length)
        return Sequence(self.tokens[:n], self.cache.copy_prefix(n))

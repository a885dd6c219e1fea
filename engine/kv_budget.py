"""The KV budget: the active requests' KV caches within so many bytes together.

Each step grows the KV caches of the sequences it feeds, and a server's memory is not.
With a budget of `max_bytes`, the scheduler (engine/scheduler.py) asks this part, before
each forward step:
- which waiting requests join the batch (`admit`): a request joins only when its cache
  fits beside the active ones', first come, first served, so the first one that does not
  fit waits at the head of the queue for room, and nobody overtakes it;
- which active request leaves it (`to_preempt`): when the caches the next step grows
  would not fit together, the newest. The scheduler puts it back at the front of the
  queue, to resume from its tokens so far (the prefix cache usually still holds what it
  computed);
- how long a draft may make a sequence (`draft_room`): never past the capacity its cache
  was counted with.
One request alone may exceed the budget (its context window bounds it), or it could
never run. Without a budget (`max_bytes` None) every request fits and none leaves.

This part decides; the scheduler moves the requests (engine/scheduler.py's `Request`:
its `seq`, `tokens` and `cancelled` are read here). A cache's bytes are its capacity
(engine/kv_cache.py: it doubles as it grows) times the model's bytes per position.
Next: engine/drafting.py, the other part the scheduler asks before a step.
"""

from __future__ import annotations

import math
from collections import deque

from . import tuning


class KVBudget:
    """The bytes the active requests' KV caches may hold together (None: no bound), and the
    decisions that keep them within it (see the module docstring)."""

    def __init__(self, model, max_bytes: int | None, prefill_chunk: int):
        self.model = model
        self.max_bytes = max_bytes
        self.prefill_chunk = prefill_chunk  # the most tokens of one sequence a step feeds

    def used(self, active: list) -> int:
        """The bytes the active requests' caches may hold after the next step (0 without a
        bound: nothing is counted)."""
        if self.max_bytes is None:
            return 0
        return sum(self._next_bytes(r) for r in active if not r.cancelled)

    def admit(self, waiting: deque, n_active: int, used: int, room: int) -> list:
        """Take from the front of `waiting` the requests that join the n_active ones, whose
        caches hold `used` bytes: at most `room`, while their caches fit beside them."""
        joining = []
        while waiting and len(joining) < room:
            need = self._joining_bytes(waiting[0])
            if self.max_bytes is not None and n_active + len(joining) and used + need > self.max_bytes:
                break                  # first come, first served: nobody overtakes it
            used += need
            joining.append(waiting.popleft())
        return joining

    def to_preempt(self, active: list):
        """The request that leaves the batch before the next step (the newest), or None when
        the caches fit (or one request alone runs)."""
        if self.max_bytes is None or len(active) < 2:
            return None
        if sum(self._next_bytes(r) for r in active) <= self.max_bytes:
            return None
        return active[-1]

    def draft_room(self, seq) -> float:
        """The draft tokens a sequence may take this step: what its cache holds without
        growing past what the budget counted (no limit without a bound)."""
        if self.max_bytes is None:
            return math.inf
        return seq.cache.capacity - len(seq.tokens)

    def _next_bytes(self, request) -> int:
        """The bytes of an active request's KV cache after the next step, at most: grown for
        as many of its pending tokens as a step can take."""
        cache = request.seq.cache
        n = min(cache.max_length, cache.length + min(request.seq.n_pending, self.prefill_chunk))
        return cache.capacity_for(n) * self.model.kv_bytes_per_position

    def _joining_bytes(self, request) -> int:
        """What a waiting request's KV cache may hold once it has run a while: room for its
        tokens (a new cache's at least), doubled once. Counting its first growth keeps it
        from being preempted at that growth, which could make a request leave and rejoin
        at every step."""
        positions = min(self.model.n_ctx, 2 * max(tuning.INITIAL_CAPACITY, len(request.tokens)))
        return positions * self.model.kv_bytes_per_position

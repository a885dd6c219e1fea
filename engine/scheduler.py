"""Continuous batching: one forward step serves every active sequence of a model.

A decode step costs about the same for one sequence as for eight: its time goes
into reading the quantized weights, and a matmul over eight rows reads them once.
So the scheduler keeps a set of active requests and, step after step, feeds all
of them through `model.step` together:

- a decoding request contributes its one new token;
- requests still in their prompts share `prefill_chunk` prompt tokens; while
  streams decode, the steps that feed prompts take at most `prefill_share` of the
  worker's time: after one, the decoding requests are owed steps of their own for
  a time in proportion (`_decode_owed`), so a burst of arrivals slows the streams
  already running but never freezes them, and a newcomer's prompt still runs in
  whole chunks (a prompt token costs several times more in a thin chunk);
- new requests join between steps (up to `max_batch` active), others wait in a
  bounded queue, and past `max_queue` waiting ones `submit` raises `QueueFull`;
- with `kv_cache_bytes`, the active requests' KV caches stay within that many
  bytes together: the `KVBudget` (engine/kv_budget.py) decides who joins, and who
  leaves the batch to wait at the front of the queue and resume later;
- a cancelled request leaves at the next step; a step whose requests have all been
  cancelled (their clients left) stops between two layers, its caches as before it,
  so a long prefill nobody waits for does not hold the worker;
- with `speculate` (the default), a request about to pick a token may feed a draft
  after its last token, chosen by the `Drafting` part (engine/drafting.py): tokens
  guessed from its context or forced by its constraint, verified in the same step
  by its own `pick` at every drafted position (`_take`); the tokens it agrees with,
  and its own next one, are taken, the rest are dropped from the sequence and its
  KV cache. Each taken token is its own `Step`, delivered together; stop ids,
  `stop_when`, `max_tokens` and a cancel are judged token by token, as without drafts.

The scheduler owns the queue, the batch and the worker thread, and composes the two
parts: before each step it asks the budget (admission, preemption) and the drafting
(drafts), after it tells the drafting what was taken. Each part decides; the
scheduler moves the requests. The chunk sizes and batch size are in engine/tuning.py.

A prompt starts from the longest prefix of it that an earlier sequence already
ran (engine/prefix_cache.py); a finished or cancelled sequence goes back to that
cache.

Threads: the numpy work runs in one worker thread per model, never on the trio
loop. The worker starts when a request arrives and ends when none is left. It
hands each sampled token to the request's trio memory channel through the trio
token of the loop that submitted it (`run_sync_soon`, so a slow reader never
stalls the batch); the caller reads them with `async for`. The worker serves
requests from any trio loop, so it is not a task of one: its owner is the
scheduler, whose `close()` (called by `Model.close`) ends the requests still
there (`ModelClosed`) and joins it, the step it is in abandoned at its next layer.

Reading the request path: engine/generate.py reads a `StepStream` (one
generation's tokens); this file is where the path ends, in `Model.step`
(engine/model.py, then engine/architectures.py for the forward itself). Its parts:
engine/kv_budget.py, then engine/drafting.py (and engine/speculate.py behind it).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Callable, NamedTuple

import numpy as np
import trio

from . import tuning
from .architectures import StepAbandoned
from .drafting import Drafting
from .errors import ModelClosed, QueueFull
from .kv_budget import KVBudget
from .kv_cache import Sequence
from .prefix_cache import PrefixCache

Pick = Callable[[np.ndarray], int]  # logits (V,) float32 -> the next token id; runs in the worker thread


class Step(NamedTuple):
    """One generated token, and "stop" or "length" when it is the last one (else None)."""

    token: int
    finish_reason: str | None


class Request:
    """One generation inside the scheduler: its prompt, how to pick tokens, where they go."""

    def __init__(self, prompt: list[int], pick: Pick, max_tokens: int, stop_ids: frozenset[int],
                 stop_when: Callable[[], bool] | None, send: trio.MemorySendChannel,
                 trio_token: trio.lowlevel.TrioToken, constraint=None):
        self.tokens = prompt               # the prompt, and after a preemption what it generated too
        self.pick = pick
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.stop_when = stop_when
        self.send = send
        self.trio_token = trio_token
        self.seq: Sequence | None = None
        self.cached_tokens = 0             # prompt tokens reused from the prefix cache
        self.generated = 0
        self.finish_reason: str | None = None  # "stop" (a stop id) or "length" once finished here
        self.cancelled = False
        self.preempted = 0                 # times it left the batch to make room in the KV budget
        # its drafts' state, kept by the scheduler's Drafting (engine/drafting.py)
        self.constraint = constraint       # what `pick` obeys, read for drafts (engine/jump_forward.py)
        self.drafter = None                # its Drafter (engine/speculate.py), made in the worker thread at its first draft
        self.proposal: tuple = ((), None)  # this step's draft proposed, and its Acceptance
        self.draft: list[int] = []         # the draft tokens fed this step, after its last token


class StepStream:
    """The caller's side of a request: an async iterator of `Step`s.

    Use it in a `with` block (or call `cancel()`): leaving early takes the request
    out of the batch at the next step.
    """

    def __init__(self, scheduler: Scheduler, request: Request, receive: trio.MemoryReceiveChannel):
        self._scheduler = scheduler
        self._request = request
        self._receive = receive

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens that came from the prefix cache (known once the first token arrived)."""
        return self._request.cached_tokens

    @property
    def finish_reason(self) -> str | None:
        """"stop" when a stop id ended it, "length" at max_tokens or a full context, else None."""
        return self._request.finish_reason

    @property
    def preempted(self) -> int:
        """Times the request left the batch to make room in the KV budget (and resumed)."""
        return self._request.preempted

    def __aiter__(self) -> StepStream:
        return self

    async def __anext__(self) -> Step:
        try:
            item = await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._scheduler._cancel(self._request)
        self._receive.close()

    def __enter__(self) -> StepStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.cancel()


class Scheduler:
    """Continuous batching over one model's `step` (see the module docstring)."""

    def __init__(self, model, *, max_batch: int = tuning.MAX_BATCH, max_queue: int = 32,
                 prefill_chunk: int = tuning.PREFILL_CHUNK, prefill_share: float = tuning.PREFILL_SHARE,
                 prefix_cache_bytes: int = tuning.PREFIX_CACHE_BYTES, kv_cache_bytes: int | None = None,
                 speculate: bool = True, clock: Callable[[], float] = time.perf_counter):
        self.model = model
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        if not 0 < prefill_share <= 1:
            raise ValueError(f"prefill_share must be in (0, 1], not {prefill_share}")
        self.prefill_share = prefill_share     # 1: prompts take every step they can
        self._decode_owed = 0.0                # seconds of steps without prompts the decoding requests are owed
        self._clock = clock                    # what times a step (seconds)
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.kv_budget = KVBudget(model, kv_cache_bytes, prefill_chunk)  # the active requests' KV caches together
        self.speculate = speculate             # drafts from the context and constraints
        self.drafting = Drafting(model)        # which requests draft, how long, how they fared
        self._lock = threading.Lock()          # guards _waiting, _running and _closed
        self._waiting: deque[Request] = deque()
        self._running = False                  # a worker thread is stepping the requests
        self._worker: threading.Thread | None = None  # the latest worker thread, which close() joins
        self._closed = False

    def submit(self, prompt: list[int], *, pick: Pick, max_tokens: int,
               stop_ids: frozenset[int] = frozenset(),
               stop_when: Callable[[], bool] | None = None, constraint=None) -> StepStream:
        """Queue a generation; call from a trio task. Raises QueueFull when the queue is
        full, ModelClosed once the scheduler is closed.

        The generation ends ("stop") after a token in `stop_ids` or a token after
        which `stop_when()` is true (a complete constraint: asked in the worker
        thread right after `pick`, which may advance it), or ("length") after
        `max_tokens` tokens or when the context window is full. The last token's
        `Step` carries that reason. The worker runs ahead of the reader, so state
        that `pick` changes must be judged here, not by the reader. `constraint`,
        the GrammarConstraint that `pick` advances, if any, lets drafts follow it.
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not prompt:
            raise ValueError("the prompt has no token")
        send, receive = trio.open_memory_channel(math.inf)
        request = Request(list(prompt), pick, max_tokens, frozenset(stop_ids), stop_when, send,
                          trio.lowlevel.current_trio_token(), constraint)
        with self._lock:
            if self._closed:
                raise ModelClosed()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(len(self._waiting))
            self._waiting.append(request)
            if not self._running:
                self._running = True
                self._worker = threading.Thread(target=self._run, name="lmsp-scheduler")
                self._worker.start()
        return StepStream(self, request, receive)

    @property
    def running(self) -> bool:
        """Whether a worker thread is stepping requests (it stops when none is left)."""
        with self._lock:
            return self._running

    @property
    def n_waiting(self) -> int:
        """Requests queued, not in the batch (new ones, and preempted ones to resume)."""
        with self._lock:
            return len(self._waiting)

    def close(self) -> None:
        """End every request still here (their readers raise ModelClosed) and wait for
        the worker thread to stop: at the next layer of the step it is in, if any.
        Idempotent; blocks for about one layer's time (a request's `pick` may hold it
        longer), so call it from a worker thread in async code."""
        with self._lock:
            self._closed = True
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join()

    def _cancel(self, request: Request) -> None:
        with self._lock:
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)

    # --- the worker thread ----------------------------------------------------------------

    def _run(self) -> None:
        """Step the active requests until none is left, admitting new ones between steps."""
        active: list[Request] = []
        try:
            while True:
                used = self.kv_budget.used(active)
                with self._lock:
                    if self._closed:
                        stranded = self._strand(active)
                        break
                    joining = self.kv_budget.admit(self._waiting, len(active), used, self.max_batch - len(active))
                    if not active and not joining:
                        self._running = False
                        return
                self._join(joining, active)
                for request in [r for r in active if r.cancelled]:
                    self._retire(request, active)
                while (newest := self.kv_budget.to_preempt(active)) is not None:
                    self._preempt(newest, active)
                if active:
                    self._step(active)
        except BaseException as exc:  # a bug here must not leave readers waiting forever
            with self._lock:
                stranded = self._strand(active)
            for request in stranded:
                _fail(request, exc)
            raise
        for request in stranded:               # closed: nobody is left to step them
            _fail(request, ModelClosed())

    def _strand(self, active: list[Request]) -> list[Request]:
        """The worker stops (the lock held): every request still here, the queue emptied."""
        stranded = active + list(self._waiting)
        self._waiting.clear()
        self._running = False
        return stranded

    def _join(self, joining: list[Request], active: list[Request]) -> None:
        """Start the joining requests' sequences from the prefix cache, and add them to the batch."""
        for request in joining:
            try:
                request.seq, cached = self.prefix_cache.start(request.tokens, self.model.new_sequence)
            except Exception as exc:   # its cache could not be made (MemoryError): it alone fails
                _fail(request, exc)
                continue
            if not request.preempted:  # (after a preemption, its own tokens are what is cached)
                request.cached_tokens = cached
            active.append(request)

    def _preempt(self, request: Request, active: list[Request]) -> None:
        """Make room in the KV budget: the request leaves the batch and waits at the front
        of the queue; the prefix cache takes its cache, to resume from."""
        active.remove(request)
        request.tokens = list(request.seq.tokens)
        self.prefix_cache.store(request.seq)
        request.seq = None
        request.preempted += 1
        with self._lock:
            if not request.cancelled:  # (a cancel since the batch's were retired found it in no queue)
                self._waiting.appendleft(request)
                return
        _deliver(request, None)

    def _step(self, active: list[Request]) -> None:
        """One forward step: every decoding request's token (and draft), plus prompt chunks
        unless the decoding requests are owed a step of their own."""
        decoding = [r for r in active if r.seq.n_pending == 1]
        owed = decoding and self._decode_owed > 0
        chunk = self.prefill_chunk
        chunks, used = [], 0
        for request in [] if owed else [r for r in active if r.seq.n_pending > 1]:
            take = min(request.seq.n_pending, chunk)  # oldest first; the first one always gets a chunk
            if used and used + take > chunk:
                break
            chunks.append(request)
            used += take
        if self.speculate:               # (a prompt ending in this step may carry a draft too)
            self.drafting.add(decoding, chunks, used, chunk, self.kv_budget)
        batch = decoding + chunks
        wanted = [1 + len(r.draft) for r in batch]  # logit rows: its last token's, and its draft's
        try:
            start = self._clock()
            logits = self.model.step([r.seq for r in batch], chunk=chunk, logit_rows=wanted,  # (k, V) each
                                     abandon=lambda: self._closed or all(r.cancelled for r in batch))
            seconds = self._clock() - start
            self.drafting.step_cost.record(sum(wanted) + used, seconds)
            self._account(seconds, decoding, used)
        except StepAbandoned:            # all of them left (or close()): the next loop retires them
            return
        except Exception as exc:
            for request in batch:
                active.remove(request)
                _fail(request, exc)
            return
        for request, rows in zip(batch, logits):
            if request.seq.n_pending:
                continue                 # mid-prompt: its logits are not wanted yet
            self._take(request, rows, active)

    def _account(self, seconds: float, decoding: list[Request], prompt_tokens: int) -> None:
        """After a step: what the decoding requests are owed. A step that fed prompts beside
        them adds its time in the proportion `prefill_share` sets; one of theirs alone pays
        it back. Nothing is owed to nobody, and nothing is kept in advance."""
        if not decoding:
            self._decode_owed = 0.0
        elif prompt_tokens:
            self._decode_owed += seconds * (1 - self.prefill_share) / self.prefill_share
        else:
            self._decode_owed = max(0.0, self._decode_owed - seconds)

    def _take(self, request: Request, rows: np.ndarray, active: list[Request]) -> None:
        """Pick a request's next token from its first row of logits (rows: (k, V), k = 1 + its
        draft), and on along its draft while the picks agree with it; drop the rest of the
        draft; deliver what was taken."""
        seq, draft = request.seq, request.draft
        request.draft = []
        before = len(seq.tokens) - len(draft)    # its tokens before the draft
        taken, failure = self._pick(request, rows, draft, before)
        # the cache keeps the positions of the draft tokens taken: all but the last token
        # taken (which, as after any pick, is pending)
        del seq.tokens[before:]
        seq.tokens.extend(taken)
        seq.cache.truncate(len(seq.tokens) - 1)
        self.drafting.observe(request, draft, taken)
        self._hand_over(request, taken, failure, active)

    def _pick(self, request: Request, rows: np.ndarray, draft: list[int],
              before: int) -> tuple[list[int], Exception | None]:
        """The tokens the request picks from its rows of logits, one per row while it agrees
        with its draft, judging stop ids, `stop_when` and the limits at each (`before`: its
        tokens before the draft); and the exception its pick raised, if it did."""
        taken: list[int] = []
        for i, row in enumerate(rows):
            if request.cancelled:
                break
            try:
                token = int(request.pick(row))
                complete = request.stop_when is not None and request.stop_when()
            except Exception as exc:
                return taken, exc
            taken.append(token)
            request.generated += 1
            if token in request.stop_ids or complete:
                request.finish_reason = "stop"
            elif request.generated >= request.max_tokens or before + len(taken) >= self.model.n_ctx:
                request.finish_reason = "length"
            if request.finish_reason or i >= len(draft) or token != draft[i]:
                break
        return taken, None

    def _hand_over(self, request: Request, taken: list[int], failure: Exception | None,
                   active: list[Request]) -> None:
        """Deliver the tokens taken, each its own Step, the last with the finish reason; a
        failed or cancelled request leaves the batch after them."""
        if failure is not None or request.cancelled:
            for token in taken:
                _deliver(request, Step(token, None))
            if failure is not None:
                _deliver(request, failure)
            self._retire(request, active)
            return
        for token in taken[:-1]:
            _deliver(request, Step(token, None))
        if request.finish_reason:
            self._retire(request, active, Step(taken[-1], request.finish_reason))
        else:
            _deliver(request, Step(taken[-1], None))

    def _retire(self, request: Request, active: list[Request], last: Step | None = None) -> None:
        """Take a request out of the batch, keep its cache for later prefixes, end its stream.

        The cache is stored before the last step is delivered: a reader that has
        its last token can count on the next request finding it.
        """
        active.remove(request)
        self.prefix_cache.store(request.seq)
        if last is not None:
            _deliver(request, last)
        _deliver(request, None)


def _fail(request: Request, exc: BaseException) -> None:
    """End a request's stream with an exception, which its reader raises."""
    _deliver(request, exc)
    _deliver(request, None)


def _deliver(request: Request, item) -> None:
    """Hand a Step, an exception, or None (end of stream) to the request's trio loop."""
    try:
        request.trio_token.run_sync_soon(_send, request.send, item)
    except trio.RunFinishedError:        # the loop that asked is gone: nobody will read
        request.cancelled = True


def _send(send: trio.MemorySendChannel, item) -> None:
    """Runs on the trio loop: pass the item on; a reader that left is not an error."""
    try:
        if item is None:
            send.close()
        else:
            send.send_nowait(item)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass

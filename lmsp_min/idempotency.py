"""Idempotency keys (D8) for POST /responses and POST /tasks.

A key belongs to the principal that sent it. The first request with a key
claims it in the store; the request's fingerprint (route + canonical JSON body,
so whitespace and key order do not matter) is kept with it. Then:

- a repeat with the same fingerprint while the first runs: 409 idempotency_conflict;
- a repeat with another fingerprint (another body, or the same key on the other
  route): 422 idempotency_key_reused, running or not;
- a repeat once the first has succeeded: the first result again, with
  `Idempotent-Replayed: true`. A synchronous response replays the exact bytes
  first served. A task request returns the same task (its current state, 202,
  same Location).
- A streamed POST /responses with a key is recorded too: once its stream has
  run to a `response.completed` or `response.incomplete` event, a repeat gets
  the whole stream again, byte for byte (the same ids, the same events), as one
  `text/event-stream` body.

Only successes are remembered. A request that ends in a problem document (or
a stream that ends in `response.failed`/`error`), or whose client goes away
before the end, releases its key, so a retry runs it again: those outcomes are
not results a client could have relied on, and most of them (429, 503, a dropped
connection) are exactly what a retry is for. Records are kept 24 hours
(`RECORD_TTL`) and then purged with expired task events.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable

import trio

from lmsp_min.http import Request, Response, StreamingResponse
from lmsp_min.problems import Problem
from lmsp_min.store import Store

HEADER = "idempotency-key"
RECORD_TTL = 24 * 3600.0
MAX_KEY_LENGTH = 255
REPLAYED = ("Idempotent-Replayed", "true")

# A stream ending with one of these was a success worth replaying.
_SUCCESSFUL_ENDINGS = (b"event: response.completed\n", b"event: response.incomplete\n")


def fingerprint(route: str, body: object) -> str:
    """What makes two requests "the same": route and canonical JSON of the body."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{route}\n{canonical}".encode("utf-8")).hexdigest()


def key_of(request: Request) -> str | None:
    """The request's Idempotency-Key, checked; None when it has none. Two of them are a
    400, not the one key the HTTP layer's ", " would join them into."""
    keys = [value for name, value in request.header_fields if name == HEADER]
    if not keys:
        return None
    if len(keys) > 1:
        raise Problem("invalid_request", f"send one Idempotency-Key header, not {len(keys)}",
                      param="Idempotency-Key")
    key = keys[0]
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable() or not key.isascii():
        raise Problem(
            "invalid_request",
            f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable ASCII characters",
            param="Idempotency-Key",
        )
    return key


async def run_once(
    store: Store | None,
    request: Request,
    route: str,
    body: object,
    run: Callable[[], Awaitable[Response | StreamingResponse]],
    replay_task: Callable[[str], Awaitable[Response]] | None = None,
) -> Response | StreamingResponse:
    """Answer `request` with `run()`, at most once per Idempotency-Key.

    `body` is the parsed JSON request body. For POST /tasks, `run()` answers with
    the task object (its "id" is what the record keeps) and `replay_task(task_id)`
    builds the answer to a repeat from the task as it is now.
    """
    key = key_of(request)
    if key is None or store is None:  # (a Service built without a store honours no keys)
        return await run()
    principal = request.principal
    digest = fingerprint(route, body)
    record = await store.claim_idempotency_key(principal, key, digest)
    if record is not None:
        if record.fingerprint != digest:
            raise Problem(
                "idempotency_key_reused",
                "this Idempotency-Key was already used with a different request",
            )
        if record.state == "running":
            raise Problem(
                "idempotency_conflict",
                "a request with this Idempotency-Key is still being processed",
            )
        if record.task_id is not None and replay_task is not None:
            response = await replay_task(record.task_id)
        else:
            response = Response(record.status, record.body, record.content_type)
        response.headers.append(REPLAYED)
        return response

    try:
        response = await run()
    except BaseException:
        await _release(store, principal, key)
        raise
    if isinstance(response, StreamingResponse):
        response.chunks = _RecordedStream(store, principal, key, response)
        return response
    if 200 <= response.status < 300:
        task_id = None
        if replay_task is not None:
            task_id = json.loads(response.body)["id"]
        await _complete(store, principal, key, status=response.status, content_type=response.content_type,
                        body=response.body, task_id=task_id)
    else:
        await _release(store, principal, key)
    return response


class _RecordedStream:
    """A stream's chunks, passed on as they come and kept for replay at the end.

    The HTTP layer closes it (`aclose`) however the response ends: a stream whose
    body never started (its client left before the head was sent) releases its key
    then, as one that started does when it fails.
    """

    def __init__(self, store: Store, principal: str, key: str, response: StreamingResponse):
        self.store, self.principal, self.key = store, principal, key
        self.response = response
        self.source = response.chunks
        self.started = False
        self._chunks_iter: AsyncIterator[bytes] | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        if self._chunks_iter is None:
            self._chunks_iter = self._chunks()
        return self._chunks_iter

    async def aclose(self) -> None:
        if self._chunks_iter is not None:
            await self._chunks_iter.aclose()  # (a started one releases or completes its key itself)
        if not self.started:
            await _release(self.store, self.principal, self.key)
            close = getattr(self.source, "aclose", None)
            if close is not None:
                await close()  # (closing it closes the generation)

    async def _chunks(self) -> AsyncIterator[bytes]:
        self.started = True
        sent: list[bytes] = []
        try:
            async with aclosing(aiter(self.source)) as inner:  # closing us closes the generation
                async for chunk in inner:
                    sent.append(chunk)
                    yield chunk
        finally:  # (a client that leaves once it has the final event has its whole answer)
            whole = b"".join(sent)
            last_event = whole[whole.rfind(b"\nevent: ") + 1:] if b"\nevent: " in whole else b""
            if last_event.startswith(_SUCCESSFUL_ENDINGS):
                await _complete(self.store, self.principal, self.key, status=self.response.status,
                                content_type=self.response.content_type, body=whole)
            else:
                await _release(self.store, self.principal, self.key)


async def _complete(store: Store, principal: str, key: str, **result) -> None:
    """Record the result to replay. Shielded: a client that leaves now has its result
    all the same, and an unshielded write could be cancelled before it starts, leaving
    the key 'running' for good. A result that cannot be recorded releases the key."""
    with trio.CancelScope(shield=True):
        try:
            await store.complete_idempotency_key(principal, key, **result)
        except BaseException:
            await _release(store, principal, key)
            raise


async def _release(store: Store, principal: str, key: str) -> None:
    # Shielded: this runs while the request is being cancelled (client gone).
    # If it fails too (a full disk), Tasks' periodic recovery releases the key later.
    with trio.CancelScope(shield=True):
        await store.release_idempotency_key(principal, key)

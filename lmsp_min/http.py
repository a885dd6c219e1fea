"""HTTP/1.1 on h11 and trio: one task per connection, every error path explained.

h11 knows the protocol (framing, keep-alive, what may legally come next);
this module owns the socket and the policy around it, in the spirit of h11's
examples/trio-server.py:

- One reader task per connection moves bytes from the socket into a channel
  bounded in bytes (`READ_AHEAD`). It is always reading, so a client that goes
  away (EOF) is noticed while a response is still being generated, even behind
  the next requests it pipelined. A request that asked for
  it (`request.cancel_on_disconnect()`, done before generating) and every
  streamed response are then cancelled at once: a stream or a synchronous
  request stops within one decoding step. A half-closed socket counts as gone
  for those, as in nginx; quick requests are still answered to a client that
  only shut its sending side.
- Requests on a keep-alive connection are answered one after another, in
  order; pipelined requests simply wait in h11's buffer.
- Limits are explicit (`Limits`): header size (431), body size (413), number
  of connections, in all and from one client address (429), and four
  timeouts: idle keep-alive (close), headers (408 then close), body (408 then
  close), and a client that stops reading what we write (close: its
  generation is cancelled like a disconnect).
- A malformed request gets 400 and the connection is closed: after a framing
  error nothing later on the connection can be trusted. A request line of
  another HTTP version than 1.0 or 1.1 gets 505. An absolute-form target's
  authority is the request's host (RFC 9112 3.2.2): `Request.headers["host"]`.
- When a client may still be sending (a body refused with 413, a request we
  could not read, a connection refused with 429) we close gently: FIN first,
  then what it sends is read and dropped for a moment, so that the answer
  reaches it instead of being destroyed by a reset.
- A handler that raises a `Problem` gets its problem document; any other
  exception is logged and becomes 500 `internal_error`, never a crash or a
  hung connection.
- Every response carries `X-Request-Id`, also on its access-log line: the
  client's own (a proxy's `$request_id`) when it sent a short token-like one,
  else a new `req_...`, so a report can be matched with the log line (the
  openai SDK shows it as `_request_id`).

Handlers see a `Request` and return a `Response` (a whole body) or a
`StreamingResponse` (an async iterator of byte chunks, each written and
flushed as soon as it exists). A stream whose iterator raises ends without its final
chunk, cut, never as if complete (`StreamCut` says why in one log line). `HTTPServer`
listens and can stop gracefully.
"""

import json
import math
import re
import secrets
import sys
import time
import traceback
from collections.abc import AsyncIterable, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qsl
from wsgiref.handlers import format_date_time

import h11
import trio

from lmsp_min import __version__
from lmsp_min.problems import Problem

LMSP_VERSION = "1.0"
SERVER_HEADER = f"lmsp-min/{__version__}"
RECEIVE_SIZE = 64 * 1024
DRAIN_LIMIT = 64 * 1024  # an unread request body up to this size is read and dropped
# The reader reads ahead of the request being served (pipelined requests) up to this many
# bytes, plus one read: past it, it waits, and a client that leaves is not noticed until
# the handler has read its way back under it.
READ_AHEAD = 256 * 1024
LINGER = 2.0  # seconds a closing connection reads and drops what its client still sends
MAX_LINGERING_REFUSALS = 32  # connections refused over the limit that may linger at once
# A client's X-Request-Id is echoed when it is this (it goes into headers and log lines).
CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class Limits:
    """Every bound the HTTP layer enforces (docs/protocol.md D9)."""

    max_header_bytes: int = 16 * 1024  # request line + headers; past it: 431
    max_body_bytes: int = 4 * 1024 * 1024  # past it: 413 request_too_large
    max_connections: int = 256  # past it: 429 rate_limited, then close
    max_connections_per_client: int = 64  # from one client address; past it: 429 too, so that
    # one client holding many connections open cannot lock the others out
    idle_timeout: float = 15.0  # keep-alive: wait this long for a next request
    header_timeout: float = 10.0  # from a request's first byte to the end of its headers
    body_timeout: float = 30.0  # to receive a whole request body
    stream_keepalive: float = 10.0  # silence in an event stream before an SSE comment: under D3's 15 s,
    # since each gap also holds the write before it (at 15.0 the gaps measured 15.001-15.007 s)
    write_timeout: float = 30.0  # a client that reads nothing this long is dropped


@dataclass
class Response:
    """A complete response; Content-Length is set from `body`."""

    status: int
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


class StreamCut(Exception):
    """Raised by a streaming body that cannot end as complete (what it streams was lost):
    the connection ends without the final chunk, so that the client sees a cut stream,
    and the log says the message in one line (a cut the body chose has no traceback)."""


@dataclass
class StreamingResponse:
    """A response whose body is produced while it is sent (chunked framing).

    Each chunk of `chunks` is written to the socket as soon as the iterator
    yields it. The iterator is closed (aclose) when the client goes away.
    With `idle_chunk` (an SSE comment), that chunk is written whenever
    `idle_interval` seconds pass without one, so that clients and proxies do
    not take a long silence (a long prompt, a queue) for a dead connection.
    """

    chunks: AsyncIterable[bytes]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: list[tuple[str, str]] = field(default_factory=list)
    idle_chunk: bytes | None = None
    idle_interval: float = 15.0


def json_bytes(obj) -> bytes:
    """Compact JSON in UTF-8 (\\u escapes only for what UTF-8 cannot carry: lone surrogates)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":")).encode("ascii")


def json_response(obj, status: int = 200, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(status, json_bytes(obj), "application/json", headers or [])


def problem_response(problem: Problem) -> Response:
    return Response(problem.status, json_bytes(problem.to_dict()), "application/problem+json",
                    list(problem.headers))


def new_request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


class Request:
    """One HTTP request as handlers see it.

    `headers` maps lowercase names to values (repeated headers joined by ", ");
    `header_fields` keeps them as sent, (lowercase name, value) in order, for a
    header that must be sent once (a joined value cannot tell two from one with a comma).
    The body is read only when a handler asks for it (`await request.body()`),
    so a request rejected on its headers (401, 415, 413 by Content-Length)
    never makes a client that sent `Expect: 100-continue` upload anything.
    """

    def __init__(self, event: h11.Request, connection: "_Connection"):
        self.method = event.method.decode("ascii")
        authority, target = _split_target(event.target)
        path, _, query = target.decode("ascii").partition("?")
        self.path = path
        self.query: dict[str, str] = dict(parse_qsl(query, keep_blank_values=True))
        self.header_fields = [(name.decode("ascii"), value.decode("latin-1")) for name, value in event.headers]
        headers: dict[str, str] = {}
        for key, text in self.header_fields:
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if authority is not None:  # RFC 9112 3.2.2: the target's authority, not the Host header
            headers["host"] = authority.decode("ascii")
        self.headers = headers
        given = headers.get("x-request-id", "")
        self.id = given if CLIENT_REQUEST_ID.fullmatch(given) else new_request_id()
        self.params: dict[str, str] = {}  # route parameters, filled by the router
        self.principal: str | None = None  # filled by authentication
        self.log_note = ""  # appended to the access-log line (token counts)
        self._connection = connection
        self._body: bytes | None = None

    def cancel_on_disconnect(self) -> None:
        """From now on, the client going away cancels this request's handler.

        Call it before long work done only for this client (generation):
        nobody is left to read the result. If the client is already gone, the
        handler is cancelled at its next checkpoint.
        """
        self._connection.watch_disconnect()

    async def body(self) -> bytes:
        """The whole request body, at most `Limits.max_body_bytes` (else 413)."""
        if self._body is None:
            self._body = await self._connection.read_body()
        return self._body


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


class _ClientGone(Exception):
    """The socket broke while we were writing: nothing more can be sent."""


class _StreamFailed(_ClientGone):
    """A response stream failed after its head went out: nothing more can be sent either."""


class _DateHeader:
    """`Date` in IMF-fixdate, formatted once per second rather than per response."""

    def __init__(self):
        self._second = -1
        self._value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = format_date_time(now).encode("ascii")
        return self._value


_date = _DateHeader()


def _base_headers() -> list[tuple[bytes, bytes]]:
    return [
        (b"Date", _date()),
        (b"Server", SERVER_HEADER.encode("ascii")),
        (b"LMSP-Version", LMSP_VERSION.encode("ascii")),
    ]


class _Connection:
    """The state of one client connection, from accept to close."""

    def __init__(self, stream: trio.SocketStream, handler: Handler, limits: Limits, log,
                 server: "HTTPServer | None" = None):
        self.stream = stream
        self.handler = handler
        self.limits = limits
        self.log = log
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.peer_closed = trio.Event()
        # The reader task pushes received chunks here. They are bounded in bytes
        # (READ_AHEAD), not in chunks: a pipelining client that sends a few small
        # pieces must not stop the reader, which would then miss its EOF.
        self._incoming_send, self._incoming = trio.open_memory_channel[bytes](math.inf)
        self._read_ahead = 0  # bytes in that channel
        self._room = trio.Event()  # set when the handler takes some out
        self._request_scope: trio.CancelScope | None = None
        self._cancel_on_disconnect = False  # for the request being served
        self._sent_100_continue = False
        self._content_length: int | None = None  # of the request being served
        self._body_abandoned = False
        self._answering_head = False  # the request being served is a HEAD
        self._request_id: str | None = None  # of the request being served, for X-Request-Id
        self.server = server
        self._idle_scope: trio.CancelScope | None = None  # waiting for a next request

    @property
    def draining(self) -> bool:
        """The server is stopping: close after the current response."""
        return self.server is not None and self.server.draining

    def drain(self) -> None:
        """Finish the request in progress, if any, then close; an idle connection closes now."""
        if self._idle_scope is not None:
            self._idle_scope.cancel()

    # -- socket I/O ---------------------------------------------------------

    async def _read_socket(self) -> None:
        """Read until EOF; then cancel the request being served, if it asked for that."""
        async with self._incoming_send:
            while True:
                try:
                    data = await self.stream.receive_some(RECEIVE_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    self.peer_closed.set()
                    if self._request_scope is not None and self._cancel_on_disconnect:
                        self._request_scope.cancel()
                    return
                self._incoming_send.send_nowait(data)
                self._read_ahead += len(data)
                while self._read_ahead >= READ_AHEAD:
                    self._room = trio.Event()
                    await self._room.wait()

    async def _receive_into_h11(self) -> None:
        """Hand h11 the next chunk from the reader (b"" means EOF)."""
        if self.h11.they_are_waiting_for_100_continue and not self._sent_100_continue:
            self._sent_100_continue = True
            await self._send(h11.InformationalResponse(status_code=100, headers=_base_headers()))
        try:
            data = await self._incoming.receive()
        except trio.EndOfChannel:
            data = b""
        self._read_ahead -= len(data)
        self._room.set()
        self.h11.receive_data(data)

    async def _send(self, event) -> None:
        data = self.h11.send(event)
        if data:
            with trio.move_on_after(self.limits.write_timeout) as stalled:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise _ClientGone() from exc
            if stalled.cancelled_caught:  # a client that stopped reading holds nothing for long
                self.log(f"a client read nothing for {self.limits.write_timeout:.0f} s: connection dropped")
                raise _ClientGone()

    # -- the connection loop ------------------------------------------------

    async def serve(self) -> None:
        try:
            client_gone = False
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_socket)
                try:
                    await self._serve_requests()
                except _ClientGone:
                    client_gone = True
                finally:
                    nursery.cancel_scope.cancel()
            # a client may still be sending what we will not read (a body refused with 413,
            # a request we could not parse): closing now would reset the connection
            still_sending = self.h11.their_state in (h11.SEND_BODY, h11.ERROR)
            if still_sending and not (client_gone or self.peer_closed.is_set()):
                await _close_gently(self.stream)
        finally:
            await trio.aclose_forcefully(self.stream)

    async def _serve_requests(self) -> None:
        while True:
            event = await self._next_request()
            if event is None:
                return
            await self._serve_request(event)
            if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                return  # MUST_CLOSE (Connection: close, draining), or a body we chose not to read
            self.h11.start_next_cycle()
            self._sent_100_continue = False
            self._body_abandoned = False

    async def _next_request(self) -> h11.Request | None:
        """Wait for the next request's headers; None means close the connection.

        Idle timeout until its first byte, header timeout from then on.
        """
        idle_deadline = trio.current_time() + self.limits.idle_timeout
        header_deadline = None
        self._answering_head = False  # (until a HEAD is read)
        while True:
            unread = self.h11.trailing_data[0]  # (h11 drops what it cannot read)
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                # a request that h11 cannot read but that says HEAD is answered as one
                self._answering_head = unread.startswith(b"HEAD ")
                await self._refuse(_protocol_problem(exc))
                return None
            if type(event) is h11.Request:
                self._answering_head = event.method == b"HEAD"
                problem = self._check_head(event)
                if problem is not None:
                    await self._refuse(problem)
                    return None
                return event
            if event is not h11.NEED_DATA:
                return None  # ConnectionClosed: the client is done with us
            started = bool(self.h11.trailing_data[0])
            if not started and self.draining:
                return None
            if started and header_deadline is None:
                header_deadline = trio.current_time() + self.limits.header_timeout
            with trio.move_on_at(header_deadline if started else idle_deadline) as waiting:
                self._idle_scope = None if started else waiting
                await self._receive_into_h11()
                continue
            if started:
                await self._refuse(Problem("invalid_request", "the request headers took too long to arrive", status=408))
            return None

    def _check_head(self, event: h11.Request) -> Problem | None:
        """What h11 lets through and we refuse, closing the connection after the answer."""
        # h11 bounds the headers only while they are incomplete: a whole block that
        # arrived in one read is parsed whatever its size, so the bound is checked here too
        if _header_bytes(event) > self.limits.max_header_bytes:
            return Problem("request_too_large", "the request headers are too large", status=431)
        if event.http_version not in (b"1.0", b"1.1"):  # h11 reads any d.d, and would answer it as 1.1
            return Problem("invalid_request", f"HTTP/{event.http_version.decode('ascii')} is not "
                           "supported: this service speaks HTTP/1.1 (and 1.0)", status=505)
        names = {name for name, _ in event.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            # h11 frames it by Transfer-Encoding; a proxy in front may have framed it by
            # Content-Length: the next request would not be the same for both (request
            # smuggling), so the connection ends here (RFC 9112 6.1)
            return Problem("invalid_request", "a request with both Content-Length and "
                           "Transfer-Encoding has no one meaning")
        authority, _ = _split_target(event.target)
        if authority is not None:  # the host the request is for (RFC 9112 3.2.2), checked as Host is
            if not _HOST.fullmatch(authority):  # (userinfo, "user@host", is no host: RFC 9110 4.2.4)
                return Problem("invalid_request", "the request target's authority is not a host name "
                               "or address with an optional port")
            return None
        host = next((value for name, value in event.headers if name == b"host"), b"")
        if not _HOST.fullmatch(host):  # RFC 9112 3.2: an invalid Host value gets 400
            return Problem("invalid_request", "the Host header is not a host name or address "
                           "with an optional port")
        return None

    async def read_body(self) -> bytes:
        """Read the current request's body, enforcing size and time limits."""
        try:
            return await self._read_body()
        except Problem:
            self._body_abandoned = True  # the rest of it will not be read: close after answering
            raise

    async def _read_body(self) -> bytes:
        length = self._content_length
        if length is not None and length > self.limits.max_body_bytes:
            raise Problem("request_too_large", _too_large(self.limits.max_body_bytes))
        chunks = []
        size = 0
        with trio.move_on_after(self.limits.body_timeout):
            while True:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError as exc:
                    raise _protocol_problem(exc) from None
                if event is h11.NEED_DATA:
                    await self._receive_into_h11()
                elif type(event) is h11.Data:
                    size += len(event.data)
                    if size > self.limits.max_body_bytes:
                        raise Problem("request_too_large", _too_large(self.limits.max_body_bytes))
                    chunks.append(event.data)
                elif type(event) is h11.EndOfMessage:
                    return b"".join(chunks)
                else:  # ConnectionClosed in the middle of the body
                    raise Problem("invalid_request", "the connection closed before the request body ended")
        raise Problem("invalid_request", "the request body took too long to arrive", status=408)

    async def _serve_request(self, event: h11.Request) -> None:
        request = Request(event, self)
        self._request_id = request.id
        length = request.headers.get("content-length")
        self._content_length = int(length) if length is not None else None  # h11 checked it
        started = time.perf_counter()
        status = 0
        outcome = " (failed)"  # unless the response is sent, below
        try:
            with trio.CancelScope() as scope:
                self._request_scope = scope
                self._cancel_on_disconnect = False
                try:
                    response = await self.handler(request)
                except Problem as problem:
                    response = problem_response(problem)
                except Exception:
                    self.log("error: unexpected exception in a handler:\n" + traceback.format_exc())
                    response = problem_response(Problem("internal_error", "an unexpected error occurred"))
                status = response.status
                if isinstance(response, StreamingResponse):
                    await self._send_streaming(response)
                else:
                    await self._send_response(response)
            outcome = " (client disconnected)" if scope.cancelled_caught else ""
        except _ClientGone as exc:
            outcome = " (stream failed)" if isinstance(exc, _StreamFailed) else " (client gone)"
            raise
        except trio.Cancelled:
            outcome = " (stopped)"  # the server is shutting down
            raise
        finally:
            self._request_scope = None
            duration = (time.perf_counter() - started) * 1000
            note = f" {request.log_note}" if request.log_note else ""
            self.log(f"{request.method} {request.path} {status} {duration:.1f}ms {request.id}{note}{outcome}")

    def watch_disconnect(self) -> None:
        """Cancel the current request when the client goes away (now, if it already has)."""
        self._cancel_on_disconnect = True
        if self.peer_closed.is_set() and self._request_scope is not None:
            self._request_scope.cancel()

    async def _finish_request_body(self) -> bool:
        """Before answering: read what is left of the request, if that is cheap.

        A request without a body still has its end to read. A small body that a
        handler did not need (a request refused on its headers) is read and
        dropped, so the connection can serve the next request. Anything else
        (a large body, a client waiting for 100-continue that we never sent)
        is not worth reading: the response says `Connection: close`.
        """
        if self.h11.their_state is h11.ERROR:  # a body we could not read (bad chunk framing)
            return False
        if self.h11.their_state is not h11.SEND_BODY:
            return True
        if self._body_abandoned:
            return False
        if self.h11.they_are_waiting_for_100_continue and not self._sent_100_continue:
            return False
        if self._content_length is not None and self._content_length > DRAIN_LIMIT:
            return False
        budget = DRAIN_LIMIT  # also bounds a chunked body
        with trio.move_on_after(self.limits.body_timeout):
            while True:
                try:
                    event = self.h11.next_event()
                except h11.RemoteProtocolError:
                    return False
                if event is h11.NEED_DATA:
                    await self._receive_into_h11()
                elif type(event) is h11.Data and len(event.data) <= budget:
                    budget -= len(event.data)
                elif type(event) is h11.EndOfMessage:
                    return True
                else:  # over budget, or the connection closed
                    return False
        return False

    async def _head(self, status: int, content_type: str | None, extra, length: int | None) -> h11.Response:
        headers = _base_headers()
        if self._request_id is not None:
            headers.append((b"X-Request-Id", self._request_id.encode("ascii")))
        if content_type is not None:
            headers.append((b"Content-Type", content_type.encode("ascii")))
        if length is not None:
            headers.append((b"Content-Length", str(length).encode("ascii")))
        for name, value in extra:
            headers.append((name.encode("ascii"), value.encode("latin-1")))
        if self.draining or not await self._finish_request_body():
            headers.append((b"Connection", b"close"))
        return h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase)

    async def _send_response(self, response: Response) -> None:
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return  # a response already started: nothing more can be said
        length = None if response.status == 204 else len(response.body)  # (RFC 9110 8.6: a 204 has none)
        await self._send(await self._head(response.status, response.content_type, response.headers, length))
        if response.body and not self._answering_head:  # HEAD: the same head, no body
            await self._send(h11.Data(data=response.body))
        await self._send(h11.EndOfMessage())

    async def _send_streaming(self, response: StreamingResponse) -> None:
        try:
            await self._send_stream(response)
        finally:  # closed however it ends, even if its head could not be sent and it never started
            close = getattr(response.chunks, "aclose", None)
            if close is not None:
                with trio.CancelScope(shield=True):
                    await close()

    async def _send_stream(self, response: StreamingResponse) -> None:
        self.watch_disconnect()  # a stream nobody reads is not worth producing
        extra = [("Cache-Control", "no-cache"), *response.headers]
        await self._send(await self._head(response.status, response.content_type, extra, None))
        try:
            if self._answering_head:
                async with aclosing(aiter(response.chunks)):
                    pass  # nothing is produced for a HEAD
            elif response.idle_chunk is None:
                await self._write_chunks(response.chunks)
            else:
                await self._write_chunks_or_idle(response)
        except _ClientGone:
            raise
        except StreamCut as cut:
            self.log(f"error: a response stream was cut: {cut}")
            raise _StreamFailed() from None
        except Exception:
            # The body is half sent: we cannot report the error in-band any
            # more, so the connection ends without its final chunk and the
            # client sees a truncated stream rather than a clean end.
            self.log("error: a response stream failed:\n" + traceback.format_exc())
            raise _StreamFailed() from None
        await self._send(h11.EndOfMessage())

    async def _write_chunks(self, source: AsyncIterable[bytes]) -> None:
        async with aclosing(aiter(source)) as chunks:
            async for chunk in chunks:
                await self._send(h11.Data(data=chunk))

    async def _write_chunks_or_idle(self, response: StreamingResponse) -> None:
        """Write chunks as they come; after `idle_interval` seconds without one, the idle chunk.

        The chunks are produced in a task of their own, so that waiting for the
        next one can time out without interrupting whatever produces it. The
        channel has no buffer: the producer still waits for each write.

        What fails, the producer or the writer (_ClientGone), is raised once the
        nursery is over: raised inside it, trio >= 0.25 would wrap it in an
        exception group, which the callers' `except _ClientGone` does not catch.
        """
        send, receive = trio.open_memory_channel[bytes](0)
        failures: list[Exception] = []

        async def produce() -> None:
            async with send:
                try:
                    await self._pass_on(response.chunks, send)
                except Exception as exc:
                    failures.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            try:
                while True:
                    with trio.move_on_after(response.idle_interval) as idle:
                        try:
                            chunk = await receive.receive()
                        except trio.EndOfChannel:
                            break
                    await self._send(h11.Data(data=response.idle_chunk if idle.cancelled_caught else chunk))
            except _ClientGone as exc:
                failures.append(exc)
                nursery.cancel_scope.cancel()  # (the producer waits to hand over its next chunk)
        if failures:
            raise failures[0] from None

    @staticmethod
    async def _pass_on(source: AsyncIterable[bytes], send: trio.MemorySendChannel) -> None:
        async with aclosing(aiter(source)) as chunks:
            async for chunk in chunks:
                await send.send(chunk)

    async def _refuse(self, problem: Problem) -> None:
        """Answer with a problem and close: the request could not even be read.

        The answer is written as bytes, once, not through h11: h11 has not always read
        a request (headers too large, a bad request line), and then frames the answer
        as if to a GET, with a body that a HEAD's client would read as the start of a
        second response. A HEAD (read, or seen at the start of bytes h11 could not
        read) gets the head alone (RFC 9110 9.3.2).
        """
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        request_id = new_request_id()  # (no request was read: none of the client's)
        with trio.move_on_after(self.limits.write_timeout):
            try:
                await self.stream.send_all(_raw_response(problem_response(problem), request_id,
                                                         to_head=self._answering_head))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        self.log(f"- - {problem.status} {request_id} ({problem.detail})")


# RFC 3986's host (an IP literal in brackets, or a name or IPv4 address) and optional port
_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~%!$&'()*+,;=-]*)(?::[0-9]*)?")


_ABSOLUTE_FORM = re.compile(rb"(?i:https?)://([^/?#]*)(.*)", re.DOTALL)


def _split_target(target: bytes) -> tuple[bytes | None, bytes]:
    """(authority, origin-form target) of a request target: an absolute-form target
    ("http://host:port/path?query", as sent to a proxy) has an authority, which is the
    request's host; the others have None."""
    found = _ABSOLUTE_FORM.fullmatch(target)
    if found is None:
        return None, target
    rest = found.group(2)
    return found.group(1), rest if rest.startswith(b"/") else b"/" + rest


def _header_bytes(event: h11.Request) -> int:
    """About the bytes of a request line and its headers as sent ("name: value\r\n" each)."""
    return len(event.method) + len(event.target) + 12 + sum(len(name) + len(value) + 4
                                                            for name, value in event.headers)


def _too_large(limit: int) -> str:
    return f"the request body is larger than the limit of {limit} bytes"


def _protocol_problem(exc: h11.RemoteProtocolError) -> Problem:
    if exc.error_status_hint == 431:
        return Problem("request_too_large", "the request headers are too large", status=431)
    # h11 hints 501 for a transfer coding it does not know; for the client it is
    # all one thing, a request we cannot read: 400 (D9).
    return Problem("invalid_request", f"malformed HTTP request: {_unquoted(str(exc))}", status=400)


def _unquoted(reason: str) -> str:
    """h11's reason without the request bytes it quotes ("illegal header line: bytearray(b'...')"):
    the line may be an Authorization header, and a token is never logged nor echoed (D7)."""
    return re.split(r":? (?:bytearray\(|b['\"])", reason, maxsplit=1)[0][:200]


class HTTPServer:
    """The listeners and the connections of one service.

    `serve` accepts connections until cancelled; `drain` stops gracefully: no
    new connection, idle keep-alive connections closed at once, requests in
    progress given `grace` seconds to finish (their responses say
    `Connection: close`), and then the caller cancels what is left.
    """

    def __init__(self, handler: Handler, *, limits: Limits = Limits(), log=None):
        self.handler = handler
        self.limits = limits
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.connections: set[_Connection] = set()
        self.draining = False
        self._accepting = trio.CancelScope()
        self._all_closed = trio.Event()  # set, while draining, once no connection is left
        self._refusing = 0  # connections over the limit being refused, gently
        self._per_client: dict[str, int] = {}  # open connections by client address

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on host:port and serve connections until cancelled.

        Reports the bound (host, port) addresses through `task_status` (port 0
        picks a free port, which is what tests use).
        """
        listeners = await trio.open_tcp_listeners(port, host=host)
        task_status.started([listener.socket.getsockname()[:2] for listener in listeners])
        async with trio.open_nursery() as connections:
            with self._accepting:  # cancelled by drain(): the listeners close, connections go on
                await trio.serve_listeners(self._serve_connection, listeners, handler_nursery=connections)

    async def drain(self, grace: float) -> None:
        """Stop accepting, let requests in progress finish for up to `grace` seconds."""
        self.draining = True
        self._accepting.cancel()
        for connection in list(self.connections):
            connection.drain()
        with trio.move_on_after(grace):
            if self.connections:
                await self._all_closed.wait()

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        client = _client_address(stream)
        refusal = None
        if len(self.connections) >= self.limits.max_connections:
            refusal = f"the service already has {self.limits.max_connections} open connections"
        elif self._per_client.get(client, 0) >= self.limits.max_connections_per_client:
            # checked at accept, before authentication: one address holding connections
            # open (slowly, or by the hundred) leaves room for every other address
            refusal = f"this client address already has {self.limits.max_connections_per_client} open connections"
        if refusal is not None:
            # those refused in one burst are held (reading what they send) for a second
            # at most, and only so many at a time: past that they are closed at once
            linger = self._refusing < MAX_LINGERING_REFUSALS
            self._refusing += linger
            try:
                await _refuse_connection(stream, refusal, linger)
            finally:
                self._refusing -= linger
            return
        connection = _Connection(stream, self.handler, self.limits, self.log, self)
        self.connections.add(connection)
        self._per_client[client] = self._per_client.get(client, 0) + 1
        try:
            await connection.serve()
        except Exception:  # a bug in this module must cost one connection, not the server
            self.log("error: a connection failed:\n" + traceback.format_exc())
        finally:
            self.connections.discard(connection)
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]
            if self.draining and not self.connections:
                self._all_closed.set()


def _client_address(stream: trio.SocketStream) -> str:
    """The peer's IP address (its port aside: one client opens many connections)."""
    try:
        return str(stream.socket.getpeername()[0])
    except OSError:  # (it has gone already)
        return ""


async def _refuse_connection(stream: trio.SocketStream, detail: str, linger: bool) -> None:
    """Over a connection limit: a 429 problem, then close, reading nothing but what is
    dropped while closing (`linger`: for at most a second in all)."""
    problem = Problem("rate_limited", detail, headers=[("Retry-After", "1")])
    try:
        with trio.move_on_after(1):
            await stream.send_all(_raw_response(problem_response(problem), new_request_id()))
            if linger:
                await _close_gently(stream)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(stream)


async def _close_gently(stream: trio.SocketStream) -> None:
    """Say we are done (FIN), then read and drop what the client still sends, until it
    closes too or LINGER seconds pass.

    Closing a socket with received bytes unread makes the kernel reset the connection,
    and a reset can destroy a response the client has not read yet: a 413 sent while
    the client still uploads its body would never be seen (RFC 9112 9.6).
    """
    with trio.move_on_after(LINGER):
        try:
            await stream.send_eof()
            while await stream.receive_some(RECEIVE_SIZE):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _raw_response(response: Response, request_id: str, to_head: bool = False) -> bytes:
    """A complete `Connection: close` response as bytes, for when no h11 state can send it
    (`to_head`: the answer to a HEAD, without its body)."""
    head = [
        *_base_headers(),
        (b"X-Request-Id", request_id.encode("ascii")),
        (b"Content-Type", (response.content_type or "application/octet-stream").encode("ascii")),
        (b"Content-Length", str(len(response.body)).encode("ascii")),
        *[(name.encode("ascii"), value.encode("latin-1"))
          for name, value in response.headers if name.lower() != "connection"],
        (b"Connection", b"close"),
    ]
    reason = HTTPStatus(response.status).phrase.encode("ascii")
    lines = [b"HTTP/1.1 %d %s" % (response.status, reason)]
    lines += [name + b": " + value for name, value in head]
    return b"\r\n".join(lines) + b"\r\n\r\n" + (b"" if to_head else response.body)

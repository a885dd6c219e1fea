"""A real lmsp-min server in a test's nursery, and a small HTTP client over real sockets.

    service = await make_service([model_path])         # Service.open, closed when the server stops
    server = await start_server(nursery, service)      # listens on 127.0.0.1:<random port>
    reply = await server.request("GET", "/lmsp/v1/models")
    async with server.connection() as client:          # one keep-alive connection
        await client.send("POST", "/lmsp/v1/responses", json_body={...})
        reply = await client.read_reply()
        events = parse_sse(reply.body)

The client speaks HTTP through h11 (client side), so what the tests check is
what a real client would see on the wire: framing, headers, bodies. Raw bytes
can be sent too, for malformed, pipelined or slow requests.
"""

import json
import math
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import h11
import pytest
import trio
import trio.testing

from lmsp_min.http import Limits
from lmsp_min.service import Service, ServiceConfig, serve
from lmsp_min.store import STORE_TIMEOUT

_loaded_models: dict[Path, object] = {}  # closed at the end of the session (close_loaded_models)
_open_services: dict[int, AsyncExitStack] = {}  # id(service) -> what closes it (close_service)


async def make_service(model_paths: list[Path], *, tokens_file: Path | None = None,
                       limits: Limits | None = None, log=None, data_dir: Path | str | None = None,
                       event_retention: float = 3600.0, cors_origins: list[str] | None = None,
                       allowed_hosts: list[str] | None = None, store_timeout: float = STORE_TIMEOUT,
                       store_lease: float = 10.0) -> Service:
    """A service over `model_paths` (entered `Service.open`), whose engine models are
    loaded once per test session: the service serves them but does not own them.
    `start_server` closes it when the server stops; a test that does not serve it
    calls `close_service`.

    Without `data_dir` it stores nothing (--no-store: a throw-away database); a
    postgresql:// URL as `data_dir` is a PostgreSQL store (--store URL, conftest's
    `store_location`)."""
    import engine

    lines: list[str] = []
    config = ServiceConfig(model_paths=list(model_paths), models_dir=None, tokens_file=tokens_file,
                           limits=limits or Limits(), store=data_dir is not None, event_retention=event_retention,
                           cors_origins=cors_origins or [], allowed_hosts=allowed_hosts or [],
                           store_timeout=store_timeout, store_lease=store_lease)
    if isinstance(data_dir, str):
        config.store_url = data_dir
    else:
        config.data_dir = data_dir
    service = await open_service(config, log=log or lines.append)
    if isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock) and service.store is not None:
        # (a virtual clock, autojump_clock, jumps to the next deadline whenever the loop
        # waits, a worker thread working or not: the deadline of a store call would pass
        # while its thread works, at random)
        service.store.timeout = math.inf
    service.log_lines = lines
    for entry in service.registry:
        if entry.path not in _loaded_models:
            _loaded_models[entry.path] = await trio.to_thread.run_sync(
                lambda: engine.load_model(entry.path, entry.context_cap, kv_cache_bytes=entry.kv_cache_bytes))
        entry.use(_loaded_models[entry.path])
    return service


async def open_service(config: ServiceConfig, log=None) -> Service:
    """`Service.open(config)` entered, to be left by `close_service` (which `start_server`
    calls when the server stops): a test's service outlives the fixture that makes it."""
    stack = AsyncExitStack()
    service = await stack.enter_async_context(Service.open(config, log=log or (lambda line: None)))
    _open_services[id(service)] = stack
    return service


async def close_service(service: Service) -> None:
    """End a service made by `make_service` (its `async with Service.open`); again: nothing."""
    stack = _open_services.pop(id(service), None)
    if stack is not None:
        await stack.aclose()


def close_loaded_models() -> None:
    """Close the engine models the session's services shared (conftest calls it at the end)."""
    while _loaded_models:
        _loaded_models.popitem()[1].close()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lowercase names
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclass
class SSE:
    id: int | None
    event: str
    data: dict


def parse_sse(body: bytes) -> list[SSE]:
    """The events of a text/event-stream body (comments skipped)."""
    events = []
    for block in body.decode("utf-8").split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(": ")
            fields[name] = value
        if fields:
            events.append(SSE(int(fields["id"]) if "id" in fields else None, fields["event"],
                              json.loads(fields["data"])))
    return events


class Client:
    """One connection to the server."""

    def __init__(self, stream: trio.SocketStream):
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    async def send(self, method: str, path: str, *, json_body=None, body: bytes | None = None,
                   headers: dict[str, str] | None = None) -> None:
        """Send one request (Content-Length framing)."""
        all_headers = {"Host": "localhost"}
        if json_body is not None:
            body = json.dumps(json_body).encode("utf-8")
            all_headers["Content-Type"] = "application/json"
        if body is not None:
            all_headers["Content-Length"] = str(len(body))
        all_headers.update(headers or {})
        data = self.h11.send(h11.Request(method=method, target=path, headers=list(all_headers.items())))
        if body:
            data += self.h11.send(h11.Data(data=body))
        data += self.h11.send(h11.EndOfMessage())
        await self.stream.send_all(data)

    def expect_reply_to(self, method: str = "GET") -> None:
        """Tell h11 a request was sent as raw bytes (pipelining), so it can read its reply."""
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
        self.h11.send(h11.Request(method=method, target="/", headers=[("Host", "localhost")]))
        self.h11.send(h11.EndOfMessage())

    async def _next_event(self):
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))
                continue
            return event

    async def read_head(self) -> Reply:
        """The status and headers of the next response (skipping 1xx)."""
        while True:
            event = await self._next_event()
            if type(event) is h11.Response:
                headers = {name.decode().lower(): value.decode() for name, value in event.headers}
                return Reply(event.status_code, headers, b"")

    async def read_chunks(self):
        """The body of the response being read, chunk by chunk as it arrives."""
        while True:
            event = await self._next_event()
            if type(event) is h11.Data:
                yield bytes(event.data)
            elif type(event) is h11.EndOfMessage:
                if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                    self.h11.start_next_cycle()
                return
            else:
                raise AssertionError(f"unexpected {event!r} in a response body")

    async def read_reply(self) -> Reply:
        reply = await self.read_head()
        reply.body = b"".join([chunk async for chunk in self.read_chunks()])
        return reply

    async def read_until_closed(self) -> bytes:
        """Raw bytes until the server closes the connection."""
        chunks = []
        while True:
            data = await self.stream.receive_some(65536)
            if not data:
                return b"".join(chunks)
            chunks.append(data)


@dataclass
class Server:
    host: str
    port: int
    service: Service

    @asynccontextmanager
    async def connection(self):
        stream = await trio.open_tcp_stream(self.host, self.port)
        try:
            yield Client(stream)
        finally:
            await stream.aclose()

    async def request(self, method: str, path: str, **kwargs) -> Reply:
        """One request on a fresh connection."""
        async with self.connection() as client:
            await client.send(method, path, **kwargs)
            return await client.read_reply()

    async def responses(self, body: dict, headers: dict[str, str] | None = None) -> Reply:
        return await self.request("POST", "/lmsp/v1/responses", json_body=body, headers=headers)


async def start_server(nursery: trio.Nursery, service: Service) -> Server:
    """Serve `service` on a random loopback port until the nursery ends (then close it)."""
    addresses = await nursery.start(_serve_then_close, service)
    host, port = addresses[0]
    return Server(host, port, service)


# -- fixtures (import them into a test module to use them) ----------------------------------

_tiny_path: list[Path] = []


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> Path:
    """A tiny random-weight chat model (SmolLM2's tokenizer and template), written once.

    Each test module imports this fixture, which makes it one fixture per module
    for pytest: the module-level cache keeps it one file (and one loaded model).
    """
    from tiny import write_tiny_chat_model

    if not _tiny_path:
        _tiny_path.append(write_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat-q8_0.gguf"))
    return _tiny_path[0]


@pytest.fixture
async def server(nursery, tiny_path) -> Server:
    """A server with the tiny model (id `tiny:chat-q8_0`), no tokens, default limits."""
    return await start_server(nursery, await make_service([tiny_path]))


async def _serve_then_close(service: Service, task_status=trio.TASK_STATUS_IGNORED) -> None:
    try:
        await serve(service, "127.0.0.1", 0, task_status=task_status)
    finally:
        await close_service(service)

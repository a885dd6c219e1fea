"""Issue 29's probe findings, each over real sockets: long header values, refused HEADs,
absolute-form targets and other HTTP versions, echoed input, and connections per client."""

import json

import pytest
import trio

from lmsp_min.http import Limits
from server_harness import make_service, start_server, server, tiny_path  # noqa: F401
from waiting import wait_until

TINY_ID = "tiny:chat-q8_0"
MODELS = "/lmsp/v1/models"
MEGABYTE = 1 << 20


async def _raw(server, data: bytes) -> bytes:
    """Send raw bytes on a fresh connection; everything the server sends until it closes."""
    async with server.connection() as client:
        await client.stream.send_all(data)
        with trio.fail_after(10):
            return await client.read_until_closed()


def _status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


def _errors(server) -> list[str]:
    return [line for line in server.service.log_lines if line.startswith("error")]


# -- 1. a header value that reaches a conversion -------------------------------------------

@pytest.mark.parametrize("version", ["1" * 4400, "1." + "1" * 5000, "0" * 5000 + "1", "2.0", "1.0, 7", "1.x"],
                         ids=lambda version: version[:12])
async def test_an_lmsp_version_is_compared_as_text(server, version):
    """D1: not a 1.x is a 400 however long (4,400 digits were a 500: int() refuses them)."""
    reply = await server.request("GET", MODELS, headers={"LMSP-Version": version})
    assert reply.status == 400 and reply.json()["code"] == "unsupported_version"
    assert len(reply.body) < 500
    assert not _errors(server)


@pytest.mark.parametrize("version", ["1", "1.0", "01.7", "1.2.3", "1.0, 1.1"])
async def test_every_1x_version_is_served(server, version):
    assert (await server.request("GET", MODELS, headers={"LMSP-Version": version})).status == 200


# -- 2. one answer to a refused HEAD --------------------------------------------------------

@pytest.mark.parametrize("request_bytes", [
    b"HEAD /lmsp/v1/models HTTP/1.1\r\nHost: bad host\r\n\r\n",
    b"HEAD /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\nContent-Length: 3\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"HEAD /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",  # one read
    b"HEAD /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 40000,  # h11 gives up
    b"HEAD /lmsp/v1/models HTTP/2.0\r\nHost: localhost\r\n\r\n",
    b"HEAD /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\nHost: a\r\n\r\n",  # h11 refuses it
    b"HEAD  /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n",  # not a request line h11 reads
], ids=["bad-host", "length-and-chunked", "large-headers", "larger-headers", "http-2", "two-hosts", "bad-line"])
async def test_a_refused_head_gets_one_head_and_no_body(server, request_bytes):
    data = await _raw(server, request_bytes)
    assert data.count(b"HTTP/1.1 ") == 1, data
    assert data.endswith(b"\r\n\r\n")  # the head alone
    assert _status(data) in (400, 431, 505)


async def test_a_refused_get_still_gets_its_body(server):
    data = await _raw(server, b"GET /lmsp/v1/models HTTP/1.1\r\nHost: bad host\r\n\r\n")
    head, _, body = data.partition(b"\r\n\r\n")
    assert _status(data) == 400 and json.loads(body)["code"] == "invalid_request"


# -- 3. absolute-form targets and other HTTP versions ---------------------------------------

async def test_an_absolute_form_target_names_the_host(server):
    """RFC 9112 3.2.2: the target's authority wins over Host, for the loopback check too."""
    evil = await _raw(server, b"GET http://evil.example.com/lmsp/v1/models HTTP/1.1\r\n"
                              b"Host: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert _status(evil) == 400 and b"loopback" in evil
    for target in (b"HTTP://evil.example.com:80/lmsp/v1/models?x=1", b"http://a@127.0.0.1/lmsp/v1/models",
                   b"https://127.0.0.1.evil.example.com/lmsp/v1/models", b"http:///lmsp/v1/models"):
        refused = await _raw(server, b"GET " + target + b" HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        assert _status(refused) == 400, target
    local = await _raw(server, b"GET http://127.0.0.1:%d/lmsp/v1/models HTTP/1.1\r\nHost: evil.example.com\r\n"
                               b"Connection: close\r\n\r\n" % server.port)
    assert _status(local) == 200 and json.loads(local.partition(b"\r\n\r\n")[2])["object"] == "list"


@pytest.mark.parametrize("version", [b"2.0", b"0.9", b"1.2", b"3.0"])
async def test_other_http_versions_get_505(server, version):
    data = await _raw(server, b"GET /lmsp/v1/models HTTP/" + version + b"\r\nHost: localhost\r\n\r\n")
    assert _status(data) == 505
    doc = json.loads(data.partition(b"\r\n\r\n")[2])
    assert doc["status"] == 505 and doc["code"] == "invalid_request"


async def test_http_1_0_is_still_served(server):
    data = await _raw(server, b"GET /lmsp/v1/models HTTP/1.0\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 200 ")


# -- 4. problem documents quote a short prefix ----------------------------------------------

def _message(text: str) -> list:
    return [{"role": "user", "content": text}]


_HUGE = "x" * MEGABYTE
_ECHOES = [
    ("/lmsp/v1/responses", {"model": TINY_ID, "input": _message("hi"), _HUGE: 1}, 400),
    ("/lmsp/v1/responses", {"model": _HUGE, "input": _message("hi")}, 404),
    ("/lmsp/v1/responses", {"model": TINY_ID, "input": [{"type": _HUGE}]}, 400),
    ("/lmsp/v1/responses", {"model": TINY_ID, "input": [{"role": "user", "content": [{"type": _HUGE}]}]}, 400),
    ("/lmsp/v1/responses", {"model": TINY_ID, "input": [{"type": "function_call_output", "call_id": _HUGE,
                                                         "output": "x"}]}, 400),
    ("/lmsp/v1/responses", {"model": TINY_ID, "input": _message("hi"), "tool_choice": {"type": "function",
                                                                                          "name": _HUGE}}, 400),
    ("/lmsp/v1/tasks", {"model": TINY_ID, "input": _message("hi"), _HUGE: 1}, 400),
    ("/v1/responses", {"model": TINY_ID, "input": "hi", _HUGE: 1}, 400),
    ("/v1/responses", {"model": _HUGE, "input": "hi"}, 404),
    ("/v1/responses", {"model": TINY_ID, "input": "hi", "include": [_HUGE]}, 400),
    ("/v1/chat/completions", {"model": TINY_ID, "messages": _message("hi"), _HUGE: 1}, 400),
    ("/v1/chat/completions", {"model": _HUGE, "messages": _message("hi")}, 404),
]


@pytest.mark.parametrize("path, body, status", _ECHOES, ids=[f"{path}-{index}" for index, (path, _, _) in enumerate(_ECHOES)])
async def test_an_error_quotes_at_most_a_short_prefix(server, path, body, status):
    """A megabyte sent (a field name, a model id, a type) is never a megabyte echoed, in
    either dialect: at most 64 characters of it, and an ellipsis."""
    reply = await server.request("POST", path, json_body=body)
    assert reply.status == status, reply.body[:300]
    assert len(reply.body) < 1000
    assert "x" * 65 not in reply.body.decode() and "x" * 64 + "…" in reply.json()["detail" if path.startswith(
        "/lmsp") else "error"].__str__()


async def test_a_long_id_in_a_path_is_not_echoed(server):
    for path in (f"{MODELS}/{'m' * 10000}", f"/lmsp/v1/responses/{'r' * 10000}", f"/lmsp/v1/tasks/{'t' * 10000}",
                 f"/v1/responses/{'r' * 10000}", f"/v1/models/{'m' * 10000}"):
        reply = await server.request("GET", path)
        assert reply.status == 404 and len(reply.body) < 1000, (path[:30], reply.body[:200])
    reply = await server.request("M" * 10000, MODELS)
    assert reply.status == 405 and len(reply.body) < 1000


# -- 6. connections per client address -------------------------------------------------------

async def test_one_client_address_cannot_take_every_connection(nursery, tiny_path):
    """Past its own limit one address gets 429, while another is still served: the global
    cap no longer lets one client lock the others out."""
    limits = Limits(max_connections=4, max_connections_per_client=2)
    server = await start_server(nursery, await make_service([tiny_path], limits=limits))

    async def first_reply(stream: trio.SocketStream, close: bool = False) -> bytes:
        await stream.send_all(b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\n"
                              + (b"Connection: close\r\n" if close else b"") + b"\r\n")
        with trio.fail_after(10):
            return await stream.receive_some(65536)

    held = [await trio.open_tcp_stream(server.host, server.port) for _ in range(3)]
    try:
        # one after another, each kept open and known to the server (it answered on it)
        replies = [await first_reply(stream) for stream in held]
        assert [_status(reply) for reply in replies] == [200, 200, 429]
        assert b"this client address already has 2 open connections" in replies[2]
        other = await trio.open_tcp_stream(server.host, server.port, local_address="127.0.0.2")
        held.append(other)
        assert _status(await first_reply(other, close=True)) == 200
    finally:
        for stream in held:
            await stream.aclose()


def test_serve_passes_the_connection_and_queue_limits_on(monkeypatch, tiny_path):
    """The flags reach the service; without them, the documented defaults."""
    from lmsp_min import cli, service

    configs = []
    monkeypatch.setattr(service, "run", lambda config, host, port: configs.append(config))
    assert cli.main(["serve", "--model", str(tiny_path), "--max-connections", "10",
                     "--max-connections-per-client", "3", "--queue-depth", "5"]) == 0
    assert cli.main(["serve", "--model", str(tiny_path)]) == 0
    given, default = configs
    assert (given.limits.max_connections, given.limits.max_connections_per_client, given.queue_depth) == (10, 3, 5)
    assert (default.limits.max_connections, default.limits.max_connections_per_client,
            default.queue_depth) == (256, 64, 32)
    assert default.limits == Limits() and default.queue_depth == service.ServiceConfig().queue_depth


def test_serve_max_batch_reaches_the_engine_and_sizes_the_queue(monkeypatch, tiny_path):
    """--max-batch N: N requests step together, and the queue (unless given) is 4 N deep,
    so that one principal's share of it still fills the batch."""
    from lmsp_min import cli, service
    from lmsp_min.admission import reserve
    from lmsp_min.registry import ModelEntry

    configs = []
    monkeypatch.setattr(service, "run", lambda config, host, port: configs.append(config))
    assert cli.main(["serve", "--model", str(tiny_path), "--max-batch", "32"]) == 0
    assert cli.main(["serve", "--model", str(tiny_path), "--max-batch", "32", "--queue-depth", "40"]) == 0
    sized, given = configs
    assert (sized.max_batch, sized.queue_depth, given.queue_depth) == (32, 128, 40)
    assert sized.queue_depth - reserve(sized.queue_depth) >= 32
    from engine import tuning
    assert service.ServiceConfig().max_batch == tuning.MAX_BATCH  # (the two defaults agree)
    entry = ModelEntry.from_file(tiny_path, max_batch=32)
    try:
        assert trio.run(entry.load).scheduler.max_batch == 32
    finally:
        entry.close()


async def test_a_model_admits_queue_depth_requests(nursery, tiny_path):
    """--queue-depth reaches each model: past it, 429 before anything is generated."""
    from lmsp_min.service import ServiceConfig
    from server_harness import open_service

    service = await open_service(ServiceConfig(model_paths=[tiny_path], store=False, queue_depth=1))
    server = await start_server(nursery, service)
    entry = service.registry.get(TINY_ID)
    assert entry.queue_depth == 1
    body = {"model": TINY_ID, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 1}
    assert (await server.responses(body)).status == 200
    await entry.load()
    held = entry.admit("someone")  # the one place taken
    try:
        reply = await server.responses(body)
        assert reply.status == 429 and reply.json()["code"] == "rate_limited"
    finally:
        held.release()
    assert (await server.responses(body)).status == 200


# -- 7. admission is fair between principals --------------------------------------------------

BURST, QUIET = "s3cret-burst", "s3cret-quiet"


async def _two_principals_one_held_step_at_a_time(nursery, tiny_path, tmp_path, monkeypatch):
    """A server with the principals "burst" and "quiet", generating one request at a time, each
    step held until the test sets the event it returns (with the server and its model entry)."""
    import threading

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"token": token, "principal": name, "scopes": ["responses:write"]}
                                  for token, name in ((BURST, "burst"), (QUIET, "quiet"))]))
    server = await start_server(nursery, await make_service([tiny_path], tokens_file=tokens))
    entry = server.service.registry.get(TINY_ID)
    monkeypatch.setattr(entry.model.scheduler, "max_batch", 1)
    go, step = threading.Event(), entry.model.step

    def held_step(*args, **kwargs):  # the engine steps once the test says so
        go.wait(20)
        return step(*args, **kwargs)

    monkeypatch.setattr(entry.model, "step", held_step)
    return server, entry, go


async def test_one_principals_burst_does_not_starve_anothers_request(nursery, tiny_path, tmp_path, monkeypatch):
    """With one request generating at a time, a principal's burst of four is queued first,
    then another principal's single request: that one is served next, not last."""
    server, entry, go = await _two_principals_one_held_step_at_a_time(nursery, tiny_path, tmp_path, monkeypatch)
    finished: list[str] = []
    body = {"model": TINY_ID, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 4,
            "temperature": 0}

    async def post(token: str, name: str) -> None:
        reply = await server.responses(body, headers={"Authorization": f"Bearer {token}"})
        assert reply.status == 200, reply.body
        finished.append(name)

    async with trio.open_nursery() as clients:
        for _ in range(4):
            clients.start_soon(post, BURST, "burst")
        await wait_until(lambda: entry.admissions.generating == 1 and entry.admissions.waiting == 3, "3 waiting")
        clients.start_soon(post, QUIET, "quiet")
        await wait_until(lambda: entry.admissions.waiting == 4, "4 waiting")
        go.set()
    assert finished == ["burst", "quiet", "burst", "burst", "burst"]
    assert entry.admitted == 0


async def test_a_request_whose_client_leaves_gives_up_its_place(server, monkeypatch):
    """A synchronous request waiting its turn, whose client goes away, is released at once:
    its place in the queue and in the model's depth is free again, the one generating goes on."""
    import threading

    entry = server.service.registry.get(TINY_ID)
    monkeypatch.setattr(entry.model.scheduler, "max_batch", 1)
    go, step = threading.Event(), entry.model.step

    def held_step(*args, **kwargs):
        go.wait(20)
        return step(*args, **kwargs)

    monkeypatch.setattr(entry.model, "step", held_step)
    body = {"model": TINY_ID, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2}
    replies = []

    async def post() -> None:
        replies.append(await server.responses(body))

    async with trio.open_nursery() as clients:
        clients.start_soon(post)
        await wait_until(lambda: entry.admissions.generating == 1, "one generating")
        async with server.connection() as leaving:
            await leaving.send("POST", "/lmsp/v1/responses", json_body=body)
            await wait_until(lambda: entry.admissions.waiting == 1, "one waiting")
        await wait_until(lambda: entry.admissions.waiting == 0 and entry.admitted == 1, "the leaver released")
        go.set()
    assert [reply.status for reply in replies] == [200]
    assert entry.admitted == 0 and entry.admissions.generating == 0


async def test_a_quiet_principal_is_admitted_while_a_busy_one_holds_its_share_of_the_queue(
        nursery, tiny_path, tmp_path, monkeypatch):
    """A principal alone may hold all of a queue but its reserve (lmsp_min/admission.py): of a
    busy principal's burst of eight into a queue of eight, one gets 429, and another
    principal's request, sent while the seven wait, is admitted and served, not refused."""
    server, entry, go = await _two_principals_one_held_step_at_a_time(nursery, tiny_path, tmp_path, monkeypatch)
    monkeypatch.setattr(entry, "queue_depth", 8)
    body = {"model": TINY_ID, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 1}
    statuses: dict[str, list[int]] = {"burst": [], "quiet": []}

    async def post(token: str, name: str) -> None:
        reply = await server.responses(body, headers={"Authorization": f"Bearer {token}"})
        statuses[name].append(reply.status)
        if reply.status == 429:
            assert reply.json()["code"] == "rate_limited" and reply.headers["retry-after"] == "1"

    async with trio.open_nursery() as clients:
        for _ in range(8):
            clients.start_soon(post, BURST, "burst")
        await wait_until(lambda: entry.admitted == 7 and statuses["burst"] == [429], "the busy one's share taken")
        clients.start_soon(post, QUIET, "quiet")
        await wait_until(lambda: entry.admitted == 8, "the quiet one admitted")
        go.set()
    assert sorted(statuses["burst"]) == [200] * 7 + [429] and statuses["quiet"] == [200]
    assert entry.admitted == 0


def test_the_queue_is_shared_evenly_between_busy_principals_with_a_reserve_kept():
    from lmsp_min.admission import Admissions

    admissions = Admissions(lambda: 1)

    def fill(principal: str) -> list:
        taken = []
        while admissions.has_room(principal, 32):
            taken.append(admissions.admit(principal))
        return taken

    first = fill("a")
    assert len(first) == 28  # alone: all of the queue of 32 but its reserve of 4
    assert len(fill("b")) == 4  # another principal gets the reserve
    for admission in first[:10]:
        admission.release()
    assert not admissions.has_room("a", 32)  # 18: past its share of two, (32 - 4) / 2
    assert len(fill("b")) == 10  # up to its share, 14
    for admission in first[10:18]:
        admission.release()
    assert len(fill("a")) == 4  # back to its share
    assert admissions.admitted == 28 and admissions.has_room("c", 32)  # the reserve is a third's

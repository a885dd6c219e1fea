"""The HTTP/1.1 layer over real sockets: framing, keep-alive, pipelining, limits, timeouts."""

import json
import socket

import pytest
import trio

from lmsp_min import http
from lmsp_min.http import Limits
from server_harness import make_service, parse_sse, server, start_server, tiny_path  # noqa: F401
from waiting import wait_until

MODELS = "/lmsp/v1/models"


def _problem(reply, status: int, code: str) -> dict:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"] == "application/problem+json"
    doc = reply.json()
    assert doc["code"] == code and doc["status"] == status
    assert doc["type"] == f"urn:lmsp:error:{code}"
    assert doc["title"] and doc["detail"]
    return doc


async def test_every_response_has_version_date_and_length(server):
    reply = await server.request("GET", MODELS)
    assert reply.status == 200
    assert reply.headers["lmsp-version"] == "1.0"
    assert reply.headers["date"].endswith(" GMT")
    assert int(reply.headers["content-length"]) == len(reply.body)
    error = await server.request("GET", "/nowhere")
    assert error.headers["lmsp-version"] == "1.0" and "date" in error.headers
    assert int(error.headers["content-length"]) == len(error.body)


async def test_every_response_has_a_request_id_also_in_its_log_line(server):
    ids = []
    for path in (MODELS, "/nowhere"):
        reply = await server.request("GET", path)
        ids.append(reply.headers["x-request-id"])
        assert ids[-1].startswith("req_") and len(ids[-1]) > 12
    assert ids[0] != ids[1]
    assert any(ids[0] in line and MODELS in line for line in server.service.log_lines)
    # a proxy's own id is kept; one that is not a short token is replaced, never echoed
    assert (await server.request("GET", MODELS, headers={"X-Request-Id": "edge-7f3a.1"})).headers["x-request-id"] \
        == "edge-7f3a.1"
    odd = (await server.request("GET", MODELS, headers={"X-Request-Id": "a b<script>"})).headers["x-request-id"]
    assert odd.startswith("req_")


async def test_keep_alive_serves_many_requests_on_one_connection(server):
    async with server.connection() as client:
        for _ in range(3):
            await client.send("GET", MODELS)
            reply = await client.read_reply()
            assert reply.status == 200
        await client.send("GET", "/nowhere")
        assert (await client.read_reply()).status == 404
        await client.send("GET", MODELS)
        assert (await client.read_reply()).status == 200


async def test_pipelined_requests_are_answered_in_order(server):
    model_id = (await server.request("GET", MODELS)).json()["data"][0]["id"]
    body = json.dumps({"model": model_id, "input": [{"role": "user", "content": "hi"}],
                       "max_output_tokens": 2, "temperature": 0}).encode()
    post = (b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body
    get = b"GET /lmsp/v1/models/" + model_id.encode() + b" HTTP/1.1\r\nHost: localhost\r\n\r\n"
    missing = b"GET /nowhere HTTP/1.1\r\nHost: localhost\r\n\r\n"
    async with server.connection() as client:
        await client.stream.send_all(post + get + missing + post)
        replies = []
        for method in ("POST", "GET", "GET", "POST"):
            client.expect_reply_to(method)
            replies.append(await client.read_reply())
    assert [r.status for r in replies] == [200, 200, 404, 200]
    assert replies[0].json()["object"] == "response"
    assert replies[1].json()["id"] == model_id
    assert replies[3].json()["object"] == "response"
    assert replies[0].json()["id"] != replies[3].json()["id"]


async def test_chunked_request_body(server):
    model_id = (await server.request("GET", MODELS)).json()["data"][0]["id"]
    body = json.dumps({"model": model_id, "input": [{"role": "user", "content": "hi"}],
                       "max_output_tokens": 1}).encode()
    head = b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n" \
           b"Transfer-Encoding: chunked\r\n\r\n"
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:]))
    async with server.connection() as client:
        await client.stream.send_all(head + chunks + b"0\r\n\r\n")
        client.expect_reply_to("POST")
        reply = await client.read_reply()
    assert reply.status == 200 and reply.json()["usage"]["output_tokens"] == 1


async def test_expect_100_continue(server):
    model_id = (await server.request("GET", MODELS)).json()["data"][0]["id"]
    body = json.dumps({"model": model_id, "input": [{"role": "user", "content": "hi"}],
                       "max_output_tokens": 1}).encode()
    head = (b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
    async with server.connection() as client:
        await client.stream.send_all(head)
        interim = await client.stream.receive_some(65536)
        assert interim.startswith(b"HTTP/1.1 100 ")
        await client.stream.send_all(body)
        client.expect_reply_to("POST")
        assert (await client.read_reply()).status == 200


async def test_rejected_before_the_body_a_100_continue_client_uploads_nothing(server):
    head = (b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\n"
            b"Expect: 100-continue\r\nContent-Length: 100\r\n\r\n")
    async with server.connection() as client:
        await client.stream.send_all(head)
        data = await client.read_until_closed()
    assert data.startswith(b"HTTP/1.1 415 ") and b"100 Continue" not in data
    assert b"connection: close" in data.lower()


async def test_body_over_the_limit_is_413_by_content_length(server):
    head = (b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (4 * 1024 * 1024 + 1))
    async with server.connection() as client:
        await client.stream.send_all(head + b"{")
        data = await client.read_until_closed()
    status, _, rest = data.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 413 ")
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["code"] == "request_too_large"


async def test_chunked_body_over_the_limit_is_413(nursery, tiny_path):
    service = await make_service([tiny_path], limits=Limits(max_body_bytes=1000))
    server = await start_server(nursery, service)
    head = b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n" \
           b"Transfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (600, b" " * 600)
    async with server.connection() as client:
        await client.stream.send_all(head + chunk + chunk)
        client.expect_reply_to("POST")
        _problem(await client.read_reply(), 413, "request_too_large")
        assert await client.read_until_closed() == b""


async def test_malformed_request_gets_400_and_close(server):
    async with server.connection() as client:
        await client.stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
        data = await client.read_until_closed()
    assert data.startswith(b"HTTP/1.1 400 ")
    assert b"\r\nlmsp-version: 1.0\r\n" in data.lower()  # D1: every response, even to no request at all
    assert b"\r\nx-request-id: req_" in data.lower()
    body = json.loads(data.partition(b"\r\n\r\n")[2])
    assert body["code"] == "invalid_request" and body["status"] == 400


@pytest.mark.parametrize("head", [
    b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Length: nope",
    b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: gzip",
    # a line h11 cannot read may hold a token (D7): the problem and the log name the fault, not the bytes
    b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization : Bearer tok-SECRET",
    b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer tok-SECRET\x00",
])
async def test_unreadable_headers_get_400_and_close(server, head):
    async with server.connection() as client:
        await client.stream.send_all(head + b"\r\n\r\n")
        data = await client.read_until_closed()
    assert data.startswith(b"HTTP/1.1 400 ")
    assert json.loads(data.partition(b"\r\n\r\n")[2])["detail"].startswith("malformed HTTP request: ")
    assert b"SECRET" not in data and not any("SECRET" in line for line in server.service.log_lines)


async def test_content_length_with_transfer_encoding_gets_400_and_close(server):
    """A proxy in front could frame it by Content-Length and see the GET as a request of
    its own (request smuggling): nothing after it on the connection is answered."""
    async with server.connection() as client:
        await client.stream.send_all(
            b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        data = await client.read_until_closed()
    assert data.startswith(b"HTTP/1.1 400 ") and b"connection: close" in data.lower()
    assert data.count(b"HTTP/1.1 ") == 1


@pytest.mark.parametrize("host", [b"a b", b"x:abc", b"x/y", b"[::1", b"x@y", b"x:80:90"])
async def test_an_invalid_host_gets_400_and_close(server, host):
    async with server.connection() as client:
        await client.stream.send_all(b"GET /lmsp/v1/models HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        data = await client.read_until_closed()
    assert data.startswith(b"HTTP/1.1 400 ") and b"Host header" in data


@pytest.mark.parametrize("host", [b"localhost", b"localhost:8080", b"127.0.0.1:1", b"[::1]:8080", b"[::1]"])
async def test_a_host_with_or_without_a_port_is_fine(server, host):
    async with server.connection() as client:
        await client.stream.send_all(b"GET /lmsp/v1/models HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        client.expect_reply_to("GET")
        assert (await client.read_reply()).status == 200


@pytest.mark.parametrize("chunks", [b"zz\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX0\r\n\r\n"])
async def test_a_malformed_chunked_body_gets_400_that_says_close(server, chunks):
    async with server.connection() as client:
        await client.stream.send_all(
            b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunks)
        data = await client.read_until_closed()
    assert data.startswith(b"HTTP/1.1 400 ") and b"connection: close" in data.lower()


# 64 KiB: h11 refuses the block while it is incomplete; 20 KiB may arrive whole, in one
# read, and h11 bounds only incomplete headers: the server checks that size itself
@pytest.mark.parametrize("kib", [64, 20])
async def test_oversized_headers_get_431_and_close(server, kib):
    async with server.connection() as client:
        await client.stream.send_all(b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\nX-Big: "
                                     + b"a" * (kib * 1024) + b"\r\n\r\n")
        data = await client.read_until_closed()
    assert data.startswith(b"HTTP/1.1 431 ") and b"\r\nlmsp-version: 1.0\r\n" in data.lower()
    assert json.loads(data.partition(b"\r\n\r\n")[2])["code"] == "request_too_large"


async def test_slow_headers_time_out_with_408(nursery, tiny_path, autojump_clock):
    limits = Limits(header_timeout=0.3, idle_timeout=5)
    server = await start_server(nursery, await make_service([tiny_path], limits=limits))
    async with server.connection() as client:
        await client.stream.send_all(b"GET /lmsp/v1/models HTTP/1.1\r\nHo")
        with trio.fail_after(3):
            data = await client.read_until_closed()
    assert data.startswith(b"HTTP/1.1 408 ") and b"\r\nlmsp-version: 1.0\r\n" in data.lower()


async def test_idle_keep_alive_connection_is_closed(nursery, tiny_path, autojump_clock):
    limits = Limits(idle_timeout=0.3)
    server = await start_server(nursery, await make_service([tiny_path], limits=limits))
    async with server.connection() as client:
        await client.send("GET", MODELS)
        assert (await client.read_reply()).status == 200
        with trio.fail_after(3):
            assert await client.read_until_closed() == b""


async def test_an_idle_connection_is_closed_without_lingering(nursery, tiny_path, autojump_clock):
    """Nothing is left to read from it: its slot is free at once, whatever the client does."""
    server = await start_server(nursery, await make_service([tiny_path], limits=Limits(idle_timeout=0.2)))
    async with server.connection() as client:
        await client.send("GET", MODELS)
        assert (await client.read_reply()).status == 200
        with trio.fail_after(3):
            assert await client.read_until_closed() == b""
        # (we have not closed our side)
        await wait_until(lambda: not server.service.http.connections, "the slot freed", seconds=0.5)


async def test_slow_body_times_out_with_408(nursery, tiny_path, autojump_clock):
    limits = Limits(body_timeout=0.3)
    server = await start_server(nursery, await make_service([tiny_path], limits=limits))
    async with server.connection() as client:
        await client.stream.send_all(b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\n"
                                     b"Content-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
        with trio.fail_after(3):
            data = await client.read_until_closed()
    assert data.startswith(b"HTTP/1.1 408 ") and b"\r\nlmsp-version: 1.0\r\n" in data.lower()


async def test_connections_over_the_limit_get_429(nursery, tiny_path):
    server = await start_server(nursery, await make_service([tiny_path], limits=Limits(max_connections=2)))
    async with server.connection() as first, server.connection() as second:
        for client in (first, second):  # both are being served
            await client.send("GET", MODELS)
            assert (await client.read_reply()).status == 200
        async with server.connection() as third:
            data = await third.read_until_closed()
        assert data.startswith(b"HTTP/1.1 429 ") and b"retry-after: 1" in data.lower()
        assert b"\r\nlmsp-version: 1.0\r\n" in data.lower()
    async def served():  # once the server has seen the others go, there is room again
        reply = await server.request("GET", MODELS)
        return reply if reply.status != 429 else None

    reply = await wait_until(served, "room again", seconds=10, every=0.01)
    assert reply.status == 200


def _send_all_then_read(host: str, port: int, request: bytes) -> bytes:
    """A client that sends its whole request before it reads the answer (http.client does)."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    return b"".join(chunks)


@pytest.mark.parametrize("request_bytes", [
    b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n" % (5 << 20) + b" " * (5 << 20),
    b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
], ids=["413", "431"])
async def test_an_answer_before_the_request_is_read_is_not_lost(server, request_bytes):
    """The server answers before reading it all, then closes: had it closed with the rest
    unread, the kernel would have reset the connection and destroyed the answer."""
    for _ in range(3):
        data = await trio.to_thread.run_sync(_send_all_then_read, server.host, server.port, request_bytes)
        assert data.startswith((b"HTTP/1.1 413 ", b"HTTP/1.1 431 "))


async def test_a_429_for_one_connection_too_many_is_not_lost(nursery, tiny_path):
    server = await start_server(nursery, await make_service([tiny_path], limits=Limits(max_connections=1)))
    async with server.connection() as first:
        await first.send("GET", MODELS)
        assert (await first.read_reply()).status == 200
        for _ in range(3):
            data = await trio.to_thread.run_sync(
                _send_all_then_read, server.host, server.port,
                b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert data.startswith(b"HTTP/1.1 429 ")


async def test_only_so_many_refused_connections_linger(nursery, tiny_path, monkeypatch):
    """A burst of refused connections cannot hold a descriptor each for long."""
    monkeypatch.setattr(http, "MAX_LINGERING_REFUSALS", 1)
    server = await start_server(nursery, await make_service([tiny_path], limits=Limits(max_connections=1)))
    async with server.connection() as first:
        await first.send("GET", MODELS)
        assert (await first.read_reply()).status == 200
        async with server.connection() as a, server.connection() as b, server.connection() as c:
            for client in (a, b, c):  # (none of them closes: the server decides how long it waits)
                assert (await client.read_until_closed()).startswith(b"HTTP/1.1 429 ")
            assert server.service.http._refusing == 1  # one lingers, the others are closed already


async def test_unexpected_exception_is_500_internal_error_and_the_server_goes_on(server):
    async def broken(request, service):
        raise RuntimeError("secret /home/path details")

    server.service.router.add("GET", "/lmsp/v1/broken", "models:read", broken)
    reply = await server.request("GET", "/lmsp/v1/broken")
    doc = _problem(reply, 500, "internal_error")
    assert "secret" not in doc["detail"] and "/home" not in doc["detail"]
    assert (await server.request("GET", MODELS)).status == 200


async def test_a_stream_that_fails_midway_is_logged_as_failed_not_as_a_client_gone(server):
    async def chunks():
        yield b"data: 1\n\n"
        raise RuntimeError("the producer broke")

    async def streams(request, service):
        return http.StreamingResponse(chunks())

    server.service.router.add("GET", "/lmsp/v1/streams", "models:read", streams)
    async with server.connection() as client:
        await client.send("GET", "/lmsp/v1/streams")
        assert (await client.read_head()).status == 200
        with trio.fail_after(10):
            await client.read_until_closed()  # cut: no final chunk can be sent
    await wait_until(lambda: any("/lmsp/v1/streams" in line for line in server.service.log_lines), "the stream logged")
    line = [line for line in server.service.log_lines if "/lmsp/v1/streams" in line][-1]
    assert line.endswith("(stream failed)"), line


async def test_a_client_that_stops_reading_a_stream_with_keepalives_is_logged_as_gone(nursery, tiny_path,
                                                                                      autojump_clock):
    """Under trio >= 0.25 the writer's "client gone" left a nursery wrapped in an exception
    group: it was logged as a failed stream (or a failed connection), with a traceback."""
    service = await make_service([tiny_path], limits=Limits(write_timeout=0.3))
    server = await start_server(nursery, service)

    async def chunks():
        while True:
            yield b"data: " + b"x" * 65536 + b"\n\n"

    async def streams(request, service):
        return http.StreamingResponse(chunks(), idle_chunk=b": keep-alive\n\n", idle_interval=10.0)

    service.router.add("GET", "/lmsp/v1/streams", "models:read", streams)
    async with server.connection() as client:
        await client.send("GET", "/lmsp/v1/streams")  # and reads nothing
        await wait_until(lambda: any("/lmsp/v1/streams" in line for line in service.log_lines), "the stream logged")
    line = [line for line in service.log_lines if "/lmsp/v1/streams" in line][-1]
    assert line.endswith("(client gone)"), line
    assert not any(line.startswith("error") for line in service.log_lines)


async def test_a_service_whose_stderr_is_gone_goes_on_serving(nursery, tiny_path, monkeypatch):
    """`lmsp-min serve 2>&1 | tee log`, and tee ends: each log line raised BrokenPipeError,
    and the first one (the access log of the next request) ended the server."""
    from lmsp_min.service import stderr_log

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        flush = write

    server = await start_server(nursery, await make_service([tiny_path], log=stderr_log))
    monkeypatch.setattr("sys.stderr", ClosedPipe())
    for _ in range(2):
        assert (await server.request("GET", MODELS)).status == 200
        assert (await server.request("GET", "/nowhere")).status == 404


async def test_stream_is_chunked_and_flushed_per_event(server):
    model_id = (await server.request("GET", MODELS)).json()["data"][0]["id"]
    async with server.connection() as client:
        await client.send("POST", "/lmsp/v1/responses", json_body={
            "model": model_id, "input": [{"role": "user", "content": "hi"}], "stream": True,
            "max_output_tokens": 3})
        head = await client.read_head()
        assert head.status == 200
        assert head.headers["content-type"] == "text/event-stream"
        assert head.headers["transfer-encoding"] == "chunked"
        assert head.headers["lmsp-version"] == "1.0"
        chunks = [chunk async for chunk in client.read_chunks()]
    # never two events in one chunk: each was written as soon as it existed
    assert all(chunk.count(b"\nevent: ") <= 1 for chunk in chunks)
    events = parse_sse(b"".join(chunks))
    assert len(chunks) >= len(events) and events[-1].event == "response.incomplete"


async def test_a_half_closed_client_still_gets_quick_answers(server):
    async with server.connection() as client:
        await client.stream.send_all(b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
                                     b"GET /nowhere HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        await client.stream.send_eof()
        data = await client.read_until_closed()
    assert data.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 404 " in data


async def test_drain_finishes_requests_in_progress_and_closes_idle_connections(nursery, tiny_path):
    service = await make_service([tiny_path])
    server = await start_server(nursery, service)
    model_id = (await server.request("GET", MODELS)).json()["data"][0]["id"]
    async with server.connection() as idle, server.connection() as busy:
        await idle.send("GET", MODELS)
        assert (await idle.read_reply()).status == 200  # now idle, kept alive
        await busy.send("POST", "/lmsp/v1/responses", json_body={
            "model": model_id, "input": [{"role": "user", "content": "hi"}], "stream": True,
            "max_output_tokens": 30})
        head = await busy.read_head()
        drained = trio.Event()

        async def drain():
            await service.drain(grace=30)
            drained.set()

        nursery.start_soon(drain)
        with trio.fail_after(10):
            assert await idle.read_until_closed() == b""  # closed at once
        body = b"".join([chunk async for chunk in busy.read_chunks()])
        assert head.status == 200
        assert parse_sse(body)[-1].event in ("response.completed", "response.incomplete")
        with trio.fail_after(10):
            assert await busy.read_until_closed() == b""  # closed once its response is done
        with trio.fail_after(10):
            await drained.wait()
    try:
        await trio.open_tcp_stream(server.host, server.port)
    except OSError:
        pass  # nothing listens any more
    else:
        raise AssertionError("the server still accepts connections after a drain")


async def test_responses_still_generating_after_the_grace_end_failed_and_say_why(nursery, tiny_path, monkeypatch):
    # A stream gets a final event and a synchronous request a 503, not a cut connection.
    from engine import TextDelta

    service = await make_service([tiny_path])
    server = await start_server(nursery, service)
    model_id = (await server.request("GET", MODELS)).json()["data"][0]["id"]
    entry = service.registry.get(model_id)
    model = await entry.load(service.log)

    async def never_ends(prepared):
        yield TextDelta("Once")
        await trio.sleep_forever()

    monkeypatch.setattr(model, "generate_chat", never_ends)  # (the loaded model is shared by the tests)
    body = {"model": model_id, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 30}
    async with server.connection() as streamed, server.connection() as synchronous:
        await streamed.send("POST", "/lmsp/v1/responses", json_body={**body, "stream": True})
        await synchronous.send("POST", "/lmsp/v1/responses", json_body=body)
        head = await streamed.read_head()
        await wait_until(lambda: entry.admissions.generating == 2, "both waiting for the engine")
        nursery.start_soon(service.drain, 0.2)
        with trio.fail_after(10):
            events = parse_sse(b"".join([chunk async for chunk in streamed.read_chunks()]))
            reply = await synchronous.read_reply()
    assert head.status == 200 and [e.event for e in events][-2:] == ["response.output_text.delta", "response.failed"]
    assert events[-1].data["error"]["code"] == "model_unavailable"
    assert reply.status == 503 and reply.json()["code"] == "model_unavailable" and "retry-after" in reply.headers


async def test_a_request_arriving_during_a_drain_is_503(server):
    async with server.connection() as client:
        await client.stream.send_all(b"GET /lmsp/v1/models HTTP/1.1\r\n")  # a request has begun
        await wait_until(lambda: any(c.h11.trailing_data[0] for c in server.service.http.connections),
                         "the request's first line read", seconds=5)
        server.service.http.draining = True  # as drain() does
        await client.stream.send_all(b"Host: localhost\r\n\r\n")
        client.expect_reply_to("GET")
        reply = await client.read_reply()
    assert reply.status == 503 and reply.json()["code"] == "model_unavailable"
    assert reply.headers["connection"] == "close" and "retry-after" in reply.headers


async def test_head_is_get_without_the_body(server):
    full = await server.request("GET", MODELS)
    async with server.connection() as client:
        await client.stream.send_all(b"HEAD /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"
                                     b"HEAD /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\n\r\n"
                                     b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        replies = []
        for method in ("HEAD", "HEAD", "GET"):
            client.expect_reply_to(method)
            replies.append(await client.read_reply())
    head, refused, after = replies
    assert head.status == 200 and head.body == b""
    assert head.headers["content-length"] == full.headers["content-length"]
    assert refused.status == 405 and refused.headers["allow"] == "POST"
    assert after.status == 200 and after.body == full.body
    wrong = await server.request("DELETE", MODELS)
    assert wrong.headers["allow"] == "GET, HEAD"

"""Fuzzing `lmsp-min serve` over real sockets: request lines, headers, chunked framing, and
JSON bodies of every route (hypothesis, bounded: well under a minute in all).

Every answer must be a well-formed HTTP response or a clean close, within a bounded
wait; never a 5xx (but 505 to another HTTP version), never a body that echoes what was
sent at length, never a file path or a traceback; and the server healthy at the end,
its log free of unexpected exceptions.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import h11
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from server_harness import tiny_path  # noqa: F401
from waiting import wait_until_sync

ROOT = Path(__file__).resolve().parent.parent
TINY_ID = "tiny:chat-q8_0"
REPLY_TIMEOUT = 30.0  # seconds for one answer: generations are at most --ctx 64 tokens of the tiny model
LONG = "Q" * 3000  # a value sent at length, which no answer may echo whole
FUZZ = settings(max_examples=int(os.environ.get("LMSP_FUZZ_EXAMPLES", "100")), deadline=None, derandomize=True,
                database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

ROUTES = [
    ("GET", "/lmsp/v1/models"), ("GET", f"/lmsp/v1/models/{TINY_ID}"), ("POST", "/lmsp/v1/responses"),
    ("GET", "/lmsp/v1/responses/resp_x"), ("DELETE", "/lmsp/v1/responses/resp_x"), ("POST", "/lmsp/v1/tasks"),
    ("GET", "/lmsp/v1/tasks/task_x"), ("GET", "/lmsp/v1/tasks/task_x/events?after=3"),
    ("POST", "/lmsp/v1/tasks/task_x/cancel"), ("DELETE", "/lmsp/v1/tasks/task_x"), ("GET", "/v1/models"),
    ("GET", f"/v1/models/{TINY_ID}"),
    ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
    ("GET", "/v1/responses/resp_x/input_items"), ("POST", "/v1/responses/resp_x/cancel"),
    ("POST", "/v1/chat/completions"),
]
POST_ROUTES = [path for method, path in ROUTES if method == "POST"]


@pytest.fixture(scope="module")
def served(tiny_path, tmp_path_factory):
    """A `lmsp-min serve` process on the tiny model, with a store: (port, its stderr file, its home)."""
    home = tmp_path_factory.mktemp("fuzz-home")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(home / "stderr.txt", "w+")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LMSP_HOME": str(home)}
    process = subprocess.Popen(
        [sys.executable, "-m", "lmsp_min.cli", "serve", "--model", str(tiny_path), "--port", str(port),
         "--data-dir", str(home / "data"), "--ctx", "64", "--max-body-bytes", str(1 << 20)],
        env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        def up():
            assert process.poll() is None, (home / "stderr.txt").read_text()
            return _healthy(port)

        wait_until_sync(up, "the server serving", seconds=60, every=0.1)
        yield port, home / "stderr.txt", home
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lmsp/v1/models", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def exchange(port: int, data: bytes, *, half_close: bool) -> bytes:
    """Send `data` on a new connection (then shut our side, with `half_close`); every byte
    the server sends until it closes, or until it has answered and waits for more."""
    with socket.create_connection(("127.0.0.1", port), timeout=REPLY_TIMEOUT) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it closed early (a refused request): what it said is still to be read
        received = b""
        deadline = time.monotonic() + REPLY_TIMEOUT
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            except socket.timeout:
                # a server keeping the connection alive after a whole answer is fine: it waits for more
                assert _first_response(received, b"GET") is not None, f"no whole answer in {REPLY_TIMEOUT} s"
                break
            if not chunk:
                break
            received += chunk
            if not half_close and _first_response(received, data[:5]) is not None:
                break
        return received


def _first_response(received: bytes, method_hint: bytes):
    """(status, body, the bytes after it) of the first response in `received`, once it is
    whole; else None."""
    client = h11.Connection(h11.CLIENT)
    method = "HEAD" if method_hint.startswith(b"HEAD ") else "GET"
    client.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(received)
    status, body = None, b""
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            return None
        if type(event) is h11.Response:
            status = event.status_code
        elif type(event) is h11.Data:
            body += event.data
        elif type(event) is h11.EndOfMessage:
            return status, body, client.trailing_data[0]


def check(served, data: bytes, *, half_close: bool = True, other_version: bool = False) -> None:
    port, stderr, home = served
    received = exchange(port, data, half_close=half_close)
    if not received:
        return  # a clean close
    try:
        answer = _first_response(received, data[:5])
    except h11.RemoteProtocolError as exc:
        # a stream cut when the client shut its side is a clean close after a head
        assert half_close and b"text/event-stream" in received.partition(b"\r\n\r\n")[0], (exc, received[:300])
        return
    if answer is None:  # the connection closed within a streamed body: our half-close stopped it
        assert half_close and b"text/event-stream" in received.partition(b"\r\n\r\n")[0], received[:300]
        return
    status, body, rest = answer
    # after it, nothing, or the answer to a next request in what was sent (a body without
    # framing is read as one): never a second answer to the same request, such as a HEAD's body
    assert not rest or rest.startswith(b"HTTP/1.1 "), (data[:200], received[:500])
    assert status < 500 or (other_version and status == 505), (status, data[:200], body[:300])
    assert len(body) < 64 * 1024 or b"text/event-stream" in received[:400], (len(body), data[:200])
    text = received.decode("latin-1")
    assert LONG[:100] not in text, data[:200]
    for leak in ("Traceback", "site-packages", str(ROOT), str(home), 'File "'):
        assert leak not in text, (leak, text[:500])


# -- request lines ---------------------------------------------------------------------------

_token = st.text(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789!#$%&'*+-.^_`|~"),
                 min_size=1, max_size=20)
_methods = st.one_of(st.sampled_from(["GET", "POST", "HEAD", "DELETE", "PUT", "OPTIONS", "PATCH", "CONNECT",
                                      "TRACE"]), _token, st.just("G" * 5000))
_targets = st.one_of(
    st.sampled_from([path for _, path in ROUTES] + ["*", "/", "", "//", "/lmsp/v1/../v1/models", "/%00",
                                                    "/lmsp/v1/models?%zz=%", "/lmsp/v1/models/%2e%2e"]),
    st.builds(lambda host, path: f"http://{host}{path}", st.sampled_from(["127.0.0.1", "localhost:1", "evil.example",
                                                                       "", "a@b", "[::1]", "x" * 300]),
              st.sampled_from([path for _, path in ROUTES] + ["", "?q"])),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=60).map(lambda s: "/" + s),
    st.just("/" + LONG),
)
_versions = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.2", "HTTP/9.9", "HTTP/1",
                             "HTTP/1.1.1", "http/1.1", "", "HTTP/11", "ICE/1.0"])


@FUZZ
@example(method="GET", target="http://evil.example.com/lmsp/v1/models", version="HTTP/1.1", separator=" ",
         ending="\r\n")
@example(method="HEAD", target="/lmsp/v1/models", version="HTTP/2.0", separator=" ", ending="\r\n")
@given(method=_methods, target=_targets, version=_versions,
       separator=st.sampled_from([" ", "  ", "\t"]), ending=st.sampled_from(["\r\n", "\n", "\r"]))
def test_request_lines(served, method, target, version, separator, ending):
    line = separator.join(part for part in (method, target, version) if part)
    data = (line + ending + "Host: localhost" + ending + "Connection: close" + ending + ending).encode("latin-1")
    check(served, data, other_version=version not in ("HTTP/1.1", "HTTP/1.0"))


# -- headers ----------------------------------------------------------------------------------

_any_text = st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=80)
# each header with the values that reach its readers (a conversion, a comparison), and any text
_HEADER_VALUES = {
    "Host": ["localhost", "127.0.0.1:1", "[::1]", "evil.example", "", "a b", "localhost:x", LONG],
    "Content-Length": ["0", "5", "-1", "1" * 5000, "18446744073709551616", "1, 1", "1, 2", "abc", " 3"],
    "Transfer-Encoding": ["chunked", "gzip", "identity", "chunked, gzip", "gzip, chunked", ""],
    "LMSP-Version": ["1.0", "2.0", "1" * 4400, "1." + "9" * 5000, "0" * 5000 + "1", "1.x", "1.0, 2", "", LONG],
    "Authorization": ["Bearer x", "Bearer", "Basic eA==", "Bearer " + LONG, ""],
    "Content-Type": ["application/json", "application/json; charset=utf-8", "text/plain", "", LONG],
    "Idempotency-Key": ["k", "", "\x7f", LONG],
    "Last-Event-ID": ["1", "9" * 5000, "-1", "x", ""],
    "Expect": ["100-continue", "nothing"],
    "Connection": ["close", "keep-alive", "upgrade", "x"],
}
_headers = st.one_of(
    *[st.tuples(st.just(name), st.one_of(st.sampled_from(values), _any_text))
      for name, values in _HEADER_VALUES.items()],
    st.tuples(_token, _any_text),
)


@FUZZ
@example(route=("GET", "/lmsp/v1/models"), headers=[("LMSP-Version", "1" * 4400)], body=b"")  # the probe's
@example(route=("HEAD", "/lmsp/v1/models"), headers=[("Host", "a b")], body=b"")
@example(route=("GET", "/lmsp/v1/tasks/task_x/events"), headers=[("Last-Event-ID", "9" * 5000)], body=b"")
@given(route=st.sampled_from(ROUTES + [("HEAD", "/lmsp/v1/models"), ("HEAD", "/v1/models")]),
       headers=st.lists(_headers, max_size=8),
       body=st.sampled_from([b"", b"{}", b'{"model": "tiny:chat-q8_0", "input": "hi"}', b"\x00\xff", b"0\r\n\r\n"]))
def test_headers(served, route, headers, body):
    method, path = route
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost"] + [f"{name}: {value}" for name, value in headers]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    check(served, data)


# -- chunked framing --------------------------------------------------------------------------

_chunk_sizes = st.one_of(st.none(), st.sampled_from(["0", "-1", "zz", "ffffffffffffffffffff", "1" * 300, "7fffffff",
                                                     "1;ext=1", "1 ", " 1", ""]))


@st.composite
def _chunked_bodies(draw) -> bytes:
    """A JSON body (or junk) in chunks, each with its right size line or a fuzzed one."""
    payload = draw(st.sampled_from([b'{"model": "tiny:chat-q8_0", "input": "hi", "max_output_tokens": 1}',
                                    b'{"model": 1}', b"not json", b"", LONG.encode()]))
    cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=4)))
    pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)])]
    out = b""
    for piece in pieces:
        size = draw(_chunk_sizes)
        out += (f"{len(piece):x}" if size is None else size).encode() + b"\r\n" + piece + draw(
            st.sampled_from([b"\r\n", b"\r\n", b"\n", b"", b"xx\r\n"]))
    out += draw(st.sampled_from([b"0\r\n\r\n", b"0\r\nX-Trailer: 1\r\n\r\n", b"", b"0\r\n", b"5\r\nab"]))
    return out


@FUZZ
@given(path=st.sampled_from(POST_ROUTES), body=_chunked_bodies(),
       coding=st.sampled_from(["chunked", "chunked", "gzip, chunked", "chunked, chunked", "Chunked"]))
def test_chunked_framing(served, path, body, coding):
    head = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: {coding}\r\n\r\n").encode()
    check(served, head + body)


# -- JSON bodies of every route -----------------------------------------------------------------

_FIELDS = ["model", "input", "stream", "max_output_tokens", "temperature", "response_format", "tools",
           "tool_choice", "store", "previous_response_id", "extensions", "messages", "max_tokens",
           "max_completion_tokens", "n", "seed", "top_p", "stop", "background", "instructions", "metadata",
           "include", "reasoning", "type", "role", "content", "text", "name", "call_id", "parameters",
           "lmsp-min", "json_schema", "schema", LONG]
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2, 70), st.integers(), st.floats(allow_nan=False),
                     st.sampled_from([TINY_ID, "user", "assistant", "system", "message", "input_text", "function",
                                      "json_schema", "auto", "required", "hi", "", LONG, "1e400", "resp_x"]),
                     st.text(max_size=20))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(_FIELDS), inner, max_size=5)), max_leaves=20)


_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                            "content": st.one_of(st.just("hi"), _values)}), min_size=1, max_size=3)
_items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                           "content": st.one_of(st.just("hi"), st.just([{"type": "input_text", "text": "hi"}]), _values)}),
    st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output", "reasoning", "message",
                                                    "input_image", LONG]),
                           "call_id": st.sampled_from(["c1", LONG]), "name": st.just("f"),
                           "arguments": st.sampled_from(["{}", "[", LONG]), "output": _values})), min_size=1, max_size=3)


_ROUTE_FIELDS = {  # the fields each kind of route reads (a value of any kind is drawn for each)
    "/v1/chat/completions": ["max_tokens", "max_completion_tokens", "stream", "temperature", "n", "seed", "stop"],
    "/v1/responses": ["max_output_tokens", "stream", "background", "store", "temperature", "instructions"],
}
_LMSP_FIELDS = ["max_output_tokens", "stream", "store", "temperature", "extensions", "previous_response_id"]


@st.composite
def _json_bodies(draw, path: str) -> bytes:
    """Mostly a request the route reads (so some generate, some stream), with fields of any
    kind mixed in; sometimes cut or padded into JSON that is not."""
    body = {}
    model = draw(st.sampled_from([TINY_ID, TINY_ID, TINY_ID, "nope", LONG, None]))
    if model is not None:
        body["model"] = model
    valid = [{"role": "user", "content": "hi"}]
    if path == "/v1/chat/completions":
        body["messages"] = draw(st.one_of(st.just(valid), _messages))
    elif path == "/v1/responses":
        body["input"] = draw(st.one_of(st.just("hi"), st.just(valid), _items))
    else:
        body["input"] = draw(st.one_of(st.just(valid), _items))
    known = _ROUTE_FIELDS.get(path, _LMSP_FIELDS)
    body.update(draw(st.dictionaries(st.sampled_from(known), st.one_of(
        st.sampled_from([1, 2, True, False, 0.5, 0]), _scalars), max_size=3)))
    if draw(st.integers(0, 3)) == 3:  # any fields, known or not, any values
        body.update(draw(st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=4)))
    text = json.dumps(body)
    return draw(st.sampled_from([text] * 6 + [text[:len(text) // 2], text + "x", "[" * 100 + "]" * 100])).encode()


@FUZZ
@example(route=("POST", "/lmsp/v1/responses"), body=json.dumps({"model": LONG, "input": "hi"}).encode(),
         content_type="application/json")
@example(route=("POST", "/v1/chat/completions"), body=json.dumps({LONG: 1}).encode(), content_type="application/json")
@given(route=st.one_of(st.sampled_from([("POST", path) for path in POST_ROUTES]), st.sampled_from(ROUTES)),
       body=st.data(), content_type=st.sampled_from(["application/json"] * 4 + ["text/plain", None]))
def test_json_bodies(served, route, body, content_type):
    method, path = route
    if not isinstance(body, bytes):
        body = body.draw(_json_bodies(path))
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", f"Content-Length: {len(body)}", "Connection: close"]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    check(served, ("\r\n".join(lines) + "\r\n\r\n").encode() + body, half_close=False)


def test_the_server_is_healthy_after(served):
    """(Runs last in this module.) Listing and generating work; nothing unexpected was logged."""
    port, stderr, _ = served
    assert _healthy(port)
    body = json.dumps({"model": TINY_ID, "input": "hi", "max_output_tokens": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/responses", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert json.load(reply)["status"] in ("completed", "incomplete")
    log = stderr.read_text()
    assert "Traceback" not in log and not re.search(r"^error", log, re.MULTILINE), log[-3000:]

"""`lmsp_min.client` against a tiny fake LMSP server (http.server in a thread).

The fake speaks just enough of the protocol to check what the client sends and
how it reads: JSON bodies, problem documents, chunked event streams, and task
streams that it cuts mid-event to exercise resumption. A raw socket server
(RawServer) makes the failures no HTTP server library makes on purpose.
"""

import contextlib
import http.client
import http.server
import json
import queue
import re
import socket
import threading
from dataclasses import dataclass

import pytest

from lmsp_min.client import (
    Client,
    Event,
    LMSPError,
    StreamInterrupted,
    TransportError,
    function_call_output,
    function_calls,
    output_text,
    parse_sse,
)

TEXT = ["Local ", "models ", "answer ", "héllo ", "wörld."]


def stream_events(response_id: str) -> list[tuple[str, dict]]:
    item = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    done = {**item, "content": [{"type": "output_text", "text": "".join(TEXT)}]}
    return [
        ("response.created", {"response_id": response_id, "status": "in_progress"}),
        ("response.output_item.added", {"response_id": response_id, "output_index": 0, "item": item}),
        *[("response.output_text.delta", {"response_id": response_id, "item_id": "msg_1", "delta": d}) for d in TEXT],
        ("response.output_item.done", {"response_id": response_id, "output_index": 0, "item": done}),
        ("response.completed", {"response_id": response_id, "status": "completed", "usage": {"input_tokens": 3, "output_tokens": 5, "total_tokens": 8}}),
    ]


def sse(event_id: int, name: str, data: dict) -> bytes:
    return f"id: {event_id}\nevent: {name}\ndata: {json.dumps(data)}\n\n".encode()


def message_response(text: str) -> dict:
    return {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [{"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}],
        "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
        "error": None,
        "incomplete_details": None,
    }


class FakeServer:
    def __init__(self):
        self.requests: list[tuple[str, str, dict, object]] = []  # method, path, headers, body
        self.cuts: list[int] = []  # for successive task-stream connections: bytes sent before cutting
        self.history_expired = False
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

            def _handle(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                server.requests.append((method, self.path, dict(self.headers), body))
                path = self.path
                if path == "/lmsp/v1/moved":
                    return self._json(302, {}, "text/html")
                if path == "/lmsp/v1/models":
                    return self._json(200, {"object": "list", "data": [{"id": "fake:1m", "object": "model"}]})
                if path == "/lmsp/v1/responses":
                    if body["model"] != "fake:1m":
                        return self._json(404, {"type": "urn:lmsp:error:model_not_found", "title": "Model not found", "status": 404, "code": "model_not_found", "detail": "no such model"}, "application/problem+json")
                    if body.get("stream"):
                        return self._stream(b"".join(sse(i, n, d) for i, (n, d) in enumerate(stream_events("resp_1"), 1)), cut=None)
                    if body.get("tools"):
                        return self._json(200, self._tool_answer(body))
                    return self._json(200, message_response("Hello."))
                if path == "/lmsp/v1/tasks":
                    return self._json(202, {"id": "task_1", "object": "task", "status": "queued", "response_id": "resp_1", "response": None})
                if path == "/lmsp/v1/tasks/task_1":
                    return self._json(200, {"id": "task_1", "object": "task", "status": "completed", "response_id": "resp_1", "response": message_response("".join(TEXT))})
                if path == "/lmsp/v1/tasks/task_1/events":
                    if server.history_expired:
                        return self._json(410, {"status": 410, "code": "event_history_expired", "title": "Gone"}, "application/problem+json")
                    after = int(self.headers.get("Last-Event-ID") or 0)
                    events = [(i, n, d) for i, (n, d) in enumerate(stream_events("resp_1"), 1) if i > after]
                    data = b": keep-alive\n\n" + b"".join(sse(i, n, d) for i, n, d in events)
                    return self._stream(data, cut=server.cuts.pop(0) if server.cuts else None)
                self._json(404, {"status": 404, "code": "not_found", "title": "Not found"}, "application/problem+json")

            @staticmethod
            def _tool_answer(body):
                outputs = [i for i in body["input"] if i.get("type") == "function_call_output"]
                if outputs:
                    return message_response(f"It is {json.loads(outputs[0]['output'])['temperature_c']} degrees.")
                call = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Hangzhou"}'}
                return {**message_response(""), "output": [call]}

            def _json(self, status, obj, content_type="application/json"):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, data: bytes, cut: int | None):
                """A chunked event stream, cut after `cut` bytes of events if given."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if cut is not None:
                    # a chunk header that promises more than is sent, then an abrupt close
                    self.wfile.write(b"%x\r\n" % len(data) + data[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                for start in range(0, len(data), 50):
                    piece = data[start : start + 50]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,))
        self.thread.start()

    def close(self):
        self.httpd.shutdown()  # (returns once serve_forever has)
        self.httpd.server_close()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the fake server's thread did not stop within 10 s"


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


def test_parse_sse_follows_the_event_stream_rules():
    raw = [
        b": keep-alive\n",
        b"\n",
        b"id: 1\r\n",
        b"event: response.created\r\n",
        b'data: {"a":\n',
        b"data: 1}\n",
        b"\n",
        b"event: ping\n",  # no data: not dispatched
        b"\n",
        b"id: 2\n",
        b"data:plain text\n",
        b"\r\n",
        b"id: \xc2\xb2\n",  # a digit, but no number: the id stays 2
        b"data\n",  # a field without a colon has an empty value
        b"\n",
        b"id: 3\n",
        b"event: cut\n",
        b"data: {}\n",  # no blank line: the stream ended mid-event
    ]
    assert list(parse_sse(iter(raw))) == [
        Event(1, "response.created", {"a": 1}),
        Event(2, "message", "plain text"),
        Event(2, "message", ""),
    ]


def test_create_response_sends_a_sync_request(fake):
    client = Client(fake.url, token="secret")
    response = client.create_response("fake:1m", "Say hello.", max_output_tokens=8, idempotency_key="k1")
    assert output_text(response) == "Hello."
    method, path, headers, body = fake.requests[-1]
    assert (method, path) == ("POST", "/lmsp/v1/responses")
    assert headers["Authorization"] == "Bearer secret"
    assert headers["LMSP-Version"] == "1.0"
    assert headers["Idempotency-Key"] == "k1"
    assert body == {
        "model": "fake:1m",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}],
        "max_output_tokens": 8,
        "stream": False,
    }


def test_stream_response_yields_events_in_order(fake):
    events = list(Client(fake.url).stream_response("fake:1m", "Say hello."))
    assert [e.id for e in events] == list(range(1, 10))
    assert "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta") == "".join(TEXT)
    assert events[-1].event == "response.completed"
    assert fake.requests[-1][3]["stream"] is True
    assert "Authorization" not in fake.requests[-1][2]


def test_problem_documents_become_lmsp_errors(fake):
    client = Client(fake.url)
    with pytest.raises(LMSPError) as e:
        client.create_response("nope", "hi")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    with pytest.raises(LMSPError) as e:
        list(client.stream_response("nope", "hi"))
    assert e.value.code == "model_not_found"


def test_a_redirect_is_an_error_not_a_result(fake):
    with pytest.raises(LMSPError) as e:
        Client(fake.url)._json("GET", "/lmsp/v1/moved")
    assert e.value.status == 302


def test_list_models(fake):
    assert [m["id"] for m in Client(fake.url).list_models()] == ["fake:1m"]


def test_follow_task_resumes_after_dropped_connections(fake):
    client = Client(fake.url)
    task = client.create_task("fake:1m", "Say hello.")
    # cut the first connection in the middle of event 4, the second right after a keep-alive
    fake.cuts = [len(b"".join(sse(i, n, d) for i, (n, d) in enumerate(stream_events("resp_1")[:3], 1))) + 40, 16]
    events = list(client.follow_task(task["id"]))
    assert [e.id for e in events] == list(range(1, 10))  # each exactly once
    assert "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta") == "".join(TEXT)
    resumes = [h.get("Last-Event-ID") for m, p, h, b in fake.requests if p.endswith("/events")]
    assert resumes == [None, "3", "3"]


def test_follow_task_after_the_final_event_yields_nothing(fake):
    assert list(Client(fake.url).follow_task("task_1", after=9)) == []  # (9: the final event's id)


def test_follow_task_fetches_the_task_when_history_expired(fake):
    fake.history_expired = True
    events = list(Client(fake.url).follow_task("task_1", after=4))
    assert len(events) == 1 and events[0].id is None
    assert events[0].event == "response.completed"
    assert output_text(events[0].data["response"]) == "".join(TEXT)


def test_follow_task_gives_up_without_progress(fake, monkeypatch):
    monkeypatch.setattr("lmsp_min.client.time.sleep", lambda s: None)
    fake.cuts = [0] * 10
    with pytest.raises(StreamInterrupted, match="gave up after 2"):
        list(Client(fake.url).follow_task("task_1", retries=2))


def test_run_tools_round_trip(fake):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}}]
    seen = []

    def get_weather(city):
        seen.append(city)
        return {"temperature_c": 17}

    response = Client(fake.url).run_tools(
        "fake:1m", "Weather in Hangzhou?", {"get_weather": get_weather}, tools=tools, tool_choice="required",
        idempotency_key="weather-1",
    )
    assert seen == ["Hangzhou"]
    # each round is a request of its own, with a key of its own (one key for both: 422)
    assert [r[2].get("Idempotency-Key") for r in fake.requests[-2:]] == ["weather-1/1", "weather-1/2"]
    assert [r[3].get("tool_choice") for r in fake.requests[-2:]] == ["required", "auto"]
    assert output_text(response) == "It is 17 degrees."
    second = fake.requests[-1][3]["input"]
    assert [i["type"] for i in second] == ["message", "function_call", "function_call_output"]
    assert second[2] == function_call_output("call_1", {"temperature_c": 17})
    assert second[2]["output"] == '{"temperature_c": 17}'


def test_ids_are_sent_as_one_path_segment(fake):
    with pytest.raises(LMSPError) as e:
        Client(fake.url).get_task("a b/c")
    assert e.value.code == "not_found"
    assert fake.requests[-1][1] == "/lmsp/v1/tasks/a%20b%2Fc"


def test_follow_task_raises_a_problem_at_once(fake):
    with pytest.raises(LMSPError) as e:
        list(Client(fake.url).follow_task("task_2"))
    assert e.value.code == "not_found"
    assert len(fake.requests) == 1  # a problem is an answer: it is not retried


# -- failures no server library makes on purpose --------------------------------------


@dataclass(frozen=True)
class Stall:
    """A reply that sends `data`, then nothing until the client gives up."""

    data: bytes = b""


class RawServer:
    """Answers its connections, one after another, with `replies` byte for byte.

    A bytes reply is sent and the connection closed at once, whatever it
    promised; a Stall keeps the connection open after its bytes.
    """

    def __init__(self, replies: list):
        self.replies = list(replies)
        self.heads: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.url = f"http://{self.address}"
        threading.Thread(target=self._serve, daemon=True).start()

    def last_event_ids(self) -> list[str | None]:
        heads = [dict(line.split(": ", 1) for line in h.decode().split("\r\n")[1:] if line) for h in self.heads]
        return [h.get("Last-Event-ID") for h in heads]

    def _serve(self):
        while self.replies:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed
                return
            with conn:
                self.heads.append(self._request_head(conn))
                reply = self.replies.pop(0)
                if isinstance(reply, Stall):
                    conn.sendall(reply.data)
                    while conn.recv(65536):  # until the client closes
                        pass
                else:
                    conn.sendall(reply)

    @staticmethod
    def _request_head(conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length: *(\d+)", head)
        length = int(length[1]) if length else 0
        while len(body) < length:
            body += conn.recv(65536)
        return head

    def close(self):
        self.listener.close()


@pytest.fixture
def raw_server():
    servers = []

    def start(*replies) -> RawServer:
        servers.append(RawServer(list(replies)))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def unused_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        return listener.getsockname()[1]


def http_reply(status: str, body: bytes, content_type: str = "application/json", length: int | None = None) -> bytes:
    """A response whose Content-Length is `length` (the body's by default)."""
    length = len(body) if length is None else length
    return f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n".encode() + body


EVENT_STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [sse(i, n, d) for i, (n, d) in enumerate(stream_events("resp_1"), 1)]


def event_stream(data: bytes, cut: int | None = None) -> bytes:
    """`data` as one chunk of an event stream, or its first `cut` bytes and no more."""
    if cut is not None:
        return EVENT_STREAM_HEAD + b"%x\r\n" % len(data) + data[:cut]
    return EVENT_STREAM_HEAD + (b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + b"0\r\n\r\n"


def test_a_server_not_listening_is_a_transport_error():
    port = unused_port()
    with pytest.raises(TransportError) as e:
        Client(f"http://127.0.0.1:{port}").list_models()
    assert isinstance(e.value, LMSPError) and e.value.status is None and e.value.code is None
    assert isinstance(e.value.__cause__, ConnectionRefusedError)
    assert f"GET /lmsp/v1/models on 127.0.0.1:{port}: connecting failed" in str(e.value)


@pytest.mark.parametrize(
    "reply, cause, doing",
    [
        (b"", http.client.RemoteDisconnected, "waiting for the response"),  # dropped before the head
        (b"SSH-2.0-OpenSSH_9.6\r\n", http.client.BadStatusLine, "waiting for the response"),  # not HTTP
        (Stall(), TimeoutError, "waiting for the response"),
        (http_reply("200 OK", b'{"object": "res', length=200), http.client.IncompleteRead, "reading the response body"),
        (http_reply("404 Not Found", b'{"code": "mod', length=200), http.client.IncompleteRead, "reading the response body"),
        (Stall(http_reply("200 OK", b'{"object": "res', length=200)), TimeoutError, "reading the response body"),
        # a body that runs to the close of the connection cannot tell a cut: it is no JSON
        (b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"object": "res', ValueError, "the answer is not JSON"),
        (http_reply("200 OK", b"<html>", "text/html"), ValueError, "the answer is not JSON"),
    ],
    ids=["dropped before the head", "not HTTP", "no head in time", "cut body", "cut problem",
         "no body in time", "cut body without length", "HTML"],
)
def test_a_failed_exchange_is_a_transport_error(raw_server, reply, cause, doing):
    server = raw_server(reply)
    timeout = 0.3 if isinstance(reply, Stall) else 10  # (short only where it is the point: slow machines)
    with pytest.raises(TransportError) as e:
        Client(server.url, timeout=timeout).create_response("fake:1m", "hi")
    assert isinstance(e.value.__cause__, cause)
    assert str(e.value).startswith(f"POST /lmsp/v1/responses on {server.address}: {doing}")


@pytest.mark.parametrize("body, detail", [(b"", None), (b"upstream down\n", "upstream down")], ids=["empty", "text"])
def test_an_error_without_a_problem_document_keeps_its_status_line(raw_server, body, detail):
    server = raw_server(http_reply("502 Bad Gateway", body, "text/plain"))
    with pytest.raises(LMSPError) as e:
        Client(server.url).list_models()
    assert type(e.value) is LMSPError and e.value.status == 502 and e.value.code is None
    assert e.value.problem == {"status": 502, "title": "Bad Gateway", **({"detail": detail} if detail else {})}
    assert str(e.value) == f"GET /lmsp/v1/models on {server.address}: 502 Bad Gateway" + (f": {detail}" if detail else "")


@pytest.mark.parametrize("status, title", [("502", "Bad Gateway"), ("599", "(no reason given)")])
def test_an_error_whose_status_line_has_no_reason_is_named_by_its_status(raw_server, status, title):
    server = raw_server(http_reply(status, b""))
    with pytest.raises(LMSPError) as e:
        Client(server.url).list_models()
    assert e.value.problem["title"] == title
    assert str(e.value) == f"GET /lmsp/v1/models on {server.address}: {status} {title}"


IN_EVENT_4 = len(b"".join(EVENTS[:3])) + 10


@pytest.mark.parametrize(
    "reply, cause",
    [
        (event_stream(b"".join(EVENTS), cut=IN_EVENT_4), http.client.IncompleteRead),
        (Stall(event_stream(b"".join(EVENTS), cut=IN_EVENT_4)), TimeoutError),
        (event_stream(b"".join(EVENTS[:3])), None),  # ended cleanly, but before the final event
    ],
    ids=["dropped", "timed out", "ended"],
)
def test_a_cut_event_stream_is_stream_interrupted(raw_server, reply, cause):
    server = raw_server(reply)
    timeout = 0.3 if isinstance(reply, Stall) else 10
    events = []
    with pytest.raises(StreamInterrupted) as e:
        for event in Client(server.url, timeout=timeout).stream_response("fake:1m", "hi"):
            events.append(event)
    assert isinstance(e.value, TransportError)
    assert str(e.value).startswith(f"POST /lmsp/v1/responses on {server.address}: ")
    assert cause is None or isinstance(e.value.__cause__, cause)
    assert [event.id for event in events] == [1, 2, 3]


def test_event_types_the_client_does_not_know_do_not_stop_a_stream(raw_server):
    """6.3: clients MUST ignore event types they do not know (a service MAY send extra
    events): such an event, even one whose data is not JSON, neither ends nor breaks the
    stream; the known events around it arrive as they are, up to the final one."""
    extra = [b"id: 3\nevent: response.function_call_arguments.delta\ndata: {\"delta\": \"{\"}\n\n",
             b"id: 4\nevent: x-vendor.progress\nretry: 10\ndata: 42%\n\n"]
    known = [sse(i + 2 if i > 2 else i, n, d) for i, (n, d) in enumerate(stream_events("resp_1"), 1)]
    server = raw_server(event_stream(b"".join(known[:2] + extra + known[2:])))
    events = list(Client(server.url).stream_response("fake:1m", "hi"))
    assert [e.id for e in events] == list(range(1, len(known) + 3))
    assert [e.event for e in events][2:4] == ["response.function_call_arguments.delta", "x-vendor.progress"]
    assert events[3].data == "42%" and events[-1].event == "response.completed"
    assert "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta") == "".join(TEXT)


def test_follow_task_retries_every_transport_failure(raw_server, monkeypatch):
    monkeypatch.setattr("lmsp_min.client.time.sleep", lambda s: None)
    server = raw_server(
        event_stream(b"".join(EVENTS), cut=len(EVENTS[0] + EVENTS[1]) + 10),  # cut in event 3
        b"",  # dropped before the head
        b"NOT HTTP\r\n\r\n",
        Stall(),  # timed out
        http_reply("503 Service Unavailable", b'{"code": "serv', length=100),  # cut in the problem
        event_stream(b"".join(EVENTS[2:])),
    )
    events = list(Client(server.url, timeout=1.0).follow_task("task_1"))  # (the Stall's wait)
    assert [e.id for e in events] == list(range(1, 10))  # each exactly once
    assert server.last_event_ids() == [None, "2", "2", "2", "2", "2"]


def test_follow_task_retries_the_task_check_after_an_empty_stream(raw_server, monkeypatch):
    monkeypatch.setattr("lmsp_min.client.time.sleep", lambda s: None)
    task = {"id": "task_1", "object": "task", "status": "completed", "response_id": "resp_1"}
    # nothing after event 9; is the task final? the first answer to that is cut
    server = raw_server(event_stream(b""), b"", event_stream(b""), http_reply("200 OK", json.dumps(task).encode()))
    assert list(Client(server.url).follow_task("task_1", after=9)) == []
    assert len(server.heads) == 4


def test_follow_task_gives_up_with_the_last_transport_error(monkeypatch):
    monkeypatch.setattr("lmsp_min.client.time.sleep", lambda s: None)
    port = unused_port()
    with pytest.raises(StreamInterrupted, match="gave up after 2") as e:
        list(Client(f"http://127.0.0.1:{port}").follow_task("task_1", retries=2))
    assert str(e.value).startswith(f"GET /lmsp/v1/tasks/task_1/events on 127.0.0.1:{port}: ")
    assert isinstance(e.value.__cause__, TransportError)
    assert isinstance(e.value.__cause__.__cause__, ConnectionRefusedError)


# -- against the real server ------------------------------------------------------------


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 that cuts task event streams after some bytes.

    Each connection whose request is for a task's events lets through the next
    number of bytes in `cuts` (then closes both sides, as a dropped network
    would), or everything once `cuts` is empty.
    """

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.cuts: list[int] = []
        self.event_connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._handle, args=(down,), daemon=True).start()

    def _handle(self, down: socket.socket):
        up = socket.create_connection(("127.0.0.1", self.upstream_port))
        head = down.recv(65536)  # the client writes its request head at once
        limit = None
        if b"/events" in head.split(b"\r\n", 1)[0]:
            self.event_connections += 1
            limit = self.cuts.pop(0) if self.cuts else None
        up.sendall(head)
        threading.Thread(target=self._pump, args=(down, up, None), daemon=True).start()
        self._pump(up, down, limit)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, limit: int | None):
        sent = 0
        try:
            while data := source.recv(65536):
                if limit is not None and sent + len(data) >= limit:
                    sink.sendall(data[: limit - sent])
                    break
                sink.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self.listener.close()


TINY = "tiny:chat-q8_0"


@contextlib.contextmanager
def running_server(model_path, data_dir, **config):
    """lmsp-min serving `model_path` from a thread of its own (the client is blocking); yields its port."""
    import trio

    from lmsp_min.service import Service, ServiceConfig, serve

    started = queue.Queue()

    async def main():
        try:
            settings = ServiceConfig(model_paths=[model_path], models_dir=None, data_dir=data_dir, access_log=False, **config)
            async with Service.open(settings, log=lambda line: None) as service:
                async with trio.open_nursery() as nursery:
                    addresses = await nursery.start(serve, service, "127.0.0.1", 0)
                    started.put((addresses[0][1], trio.lowlevel.current_trio_token(), nursery.cancel_scope))
        except BaseException as e:
            started.put(e)  # (read only if it failed to start)
            raise

    thread = threading.Thread(target=trio.run, args=(main,))
    thread.start()
    result = started.get(timeout=120)
    if isinstance(result, BaseException):
        raise result
    port, token, scope = result
    try:
        yield port
    finally:
        trio.from_thread.run_sync(scope.cancel, trio_token=token)
        thread.join(10)
        assert not thread.is_alive(), "the server did not stop within 10 s"


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    from tiny import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("models") / "tiny-chat-q8_0.gguf")


@pytest.fixture(scope="module")
def live_server(tiny_chat, tmp_path_factory):
    with running_server(tiny_chat, tmp_path_factory.mktemp("data")) as port:
        yield port


def test_real_server_models_and_errors(live_server):
    client = Client(f"http://127.0.0.1:{live_server}")
    assert [m["id"] for m in client.list_models()] == [TINY]
    assert client.get_model(TINY)["object"] == "model"
    with pytest.raises(LMSPError) as e:
        client.create_response("nope:1b", "hi")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    with pytest.raises(LMSPError) as e:
        client.create_response(TINY, "hi", max_tokens=3)  # a typo of max_output_tokens
    assert e.value.status == 400 and e.value.code == "invalid_request"


def test_real_server_sync_and_stream_agree(live_server):
    client = Client(f"http://127.0.0.1:{live_server}")
    request = {"max_output_tokens": 12, "temperature": 0}
    response = client.create_response(TINY, "Hello!", **request)
    assert response["object"] == "response" and response["usage"]["output_tokens"] <= 12
    events = list(client.stream_response(TINY, "Hello!", **request))
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert events[0].event == "response.created" and events[-1].event in ("response.completed", "response.incomplete")
    streamed = "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta")
    assert streamed == output_text(response)  # greedy: the same text both ways


def test_real_server_task_stream_resumes_through_cut_connections(live_server):
    proxy = CuttingProxy(live_server)
    try:
        client = Client(proxy.url)
        task = client.create_task(TINY, "Tell me a long story.", max_output_tokens=48, temperature=0)
        proxy.cuts = [900, 2500]  # the first two event connections drop mid-stream
        events = list(client.follow_task(task["id"]))
        assert proxy.event_connections == 3
        assert [e.id for e in events] == list(range(1, len(events) + 1))  # each event once
        text = "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta")
        final = client.get_task(task["id"])
        assert final["status"] == events[-1].data["status"]
        assert text and text == output_text(final["response"])
    finally:
        proxy.close()


def test_real_server_stored_responses_idempotency_and_cancel(live_server):
    client = Client(f"http://127.0.0.1:{live_server}")
    first = client.create_response(TINY, "Hi", max_output_tokens=4, temperature=0, store=True, idempotency_key="k-1")
    again = client.create_response(TINY, "Hi", max_output_tokens=4, temperature=0, store=True, idempotency_key="k-1")
    assert again == first  # replayed, not generated twice
    assert client.get_response(first["id"])["output"] == first["output"]
    client.delete_response(first["id"])
    with pytest.raises(LMSPError) as e:
        client.get_response(first["id"])
    assert e.value.code == "response_not_found"

    task = client.create_task(TINY, "Tell me a very long story.", max_output_tokens=400)
    cancelled = client.cancel_task(task["id"])
    assert cancelled["id"] == task["id"]
    final = client.wait_task(task["id"], poll=0.05)
    assert final["status"] in ("cancelled", "completed", "incomplete")
    events = list(client.follow_task(task["id"]))
    assert events[-1].event == f"response.{final['status']}"


def test_real_server_tools_round_trip(live_server):
    client = Client(f"http://127.0.0.1:{live_server}")
    weather = {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather of a city.",
        # an enum, so that the tiny random model finishes its arguments in a few tokens
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]},
    }
    cities = []

    def get_weather(city):
        cities.append(city)
        return {"temperature_c": 17}

    response = client.run_tools(
        TINY, "Weather in Paris?", {"get_weather": get_weather}, tools=[weather], tool_choice="required",
        temperature=0, max_output_tokens=64,
    )
    assert len(cities) >= 1 and set(cities) <= {"Paris", "Rome"}  # arguments valid for the schema
    assert function_calls(response) == []  # the last round answered instead of calling


def test_real_server_expired_events_give_the_final_task(tiny_chat, tmp_path):
    with running_server(tiny_chat, tmp_path, event_retention=0.0) as port:
        client = Client(f"http://127.0.0.1:{port}")
        task = client.create_task(TINY, "Hi", max_output_tokens=4, temperature=0)
        final = client.wait_task(task["id"], poll=0.05)
        events = list(client.follow_task(task["id"]))  # 410 event_history_expired, then GET the task
        assert len(events) == 1 and events[0].id is None
        assert events[0].event == f"response.{final['status']}"
        assert events[0].data["response"] == final["response"]

"""Two nodes, one service: two `lmsp-min serve` processes on one PostgreSQL database.

Each node is `python -m lmsp_min.cli serve --store URL` in a subprocess, with its own
data directory and home, on loopback; PostgreSQL is the session's test server
(tests/pg_server.py). What one node starts or stores, the other serves: a task is
followed, resumed and cancelled through the node that does not run it, a stored
response continues there, and an Idempotency-Key holds across both. What a node's death
or drain leaves, another takes over: tests/test_failover.py.
"""

import http.client
import json
import time
from pathlib import Path

import pytest

from test_crash import Serve, read_events, wait_final
from tiny import SMOLLM2_TOKENIZER, load_tokenizer_meta, write_tiny_model

LEASE = "1"  # seconds: a killed node's tasks end about a second after it


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """The tiny chat model with a 4096-token window, so that a task can run long."""
    path = tmp_path_factory.mktemp("scale-out-models") / "tiny-chat-q8_0.gguf"
    return write_tiny_model(path, "llama", load_tokenizer_meta(SMOLLM2_TOKENIZER), context_length=4096)


@pytest.fixture(scope="module")
def nodes(long_model, tmp_path_factory, postgres_server):
    """Nodes A and B on one database, for the module's tests; `start(name)` starts another."""
    url = postgres_server.new_database()
    root = tmp_path_factory.mktemp("nodes")
    empty = root / "empty"
    empty.mkdir()
    started = []

    def start(name: str) -> Serve:
        node = Serve(long_model, root / name / "data", empty, "--store", url, "--store-lease", LEASE,
                     home=root / name / "home")
        started.append(node)
        return node

    yield start("A"), start("B"), start
    for node in started:
        node.kill()


def model_of(node: Serve) -> str:
    return json.loads(node.request("GET", "/lmsp/v1/models")[1])["data"][0]["id"]


def long_task(node: Serve, **fields) -> dict:
    status, body = node.request("POST", "/lmsp/v1/tasks", {
        "model": model_of(node), "input": [{"role": "user", "content": "Write a long story."}],
        "max_output_tokens": 3500, "temperature": 0, **fields})
    assert status == 202, body
    return json.loads(body)


def follow(node: Serve, task_id: str, after: int | None = None) -> tuple[http.client.HTTPConnection, object]:
    conn = http.client.HTTPConnection("127.0.0.1", node.port, timeout=30)
    conn.request("GET", f"/lmsp/v1/tasks/{task_id}/events" + (f"?after={after}" if after is not None else ""))
    reply = conn.getresponse()
    assert reply.status == 200
    return conn, reply


def test_a_task_started_on_a_is_followed_resumed_and_cancelled_on_b(nodes):
    a, b, _ = nodes
    task = long_task(a)
    conn, reply = follow(b, task["id"])
    first = read_events(reply, stop_after=6)
    assert [e[0] for e in first] == list(range(1, 7)) and first[-1][1] == "response.output_text.delta"
    resumed_conn, resumed = follow(b, task["id"], after=3)  # (a client back with Last-Event-ID 3)
    again = read_events(resumed, stop_after=3)
    assert again == first[3:6]
    resumed_conn.close()

    started = time.monotonic()
    status, body = b.request("POST", f"/lmsp/v1/tasks/{task['id']}/cancel")
    assert status == 200 and json.loads(body)["status"] == "cancelled", body
    assert time.monotonic() - started < 5  # (told by NOTIFY, not found by a poll of seconds)
    rest = read_events(reply)  # B's follower gets the rest of A's events, then the end
    conn.close()
    events = first + rest
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    assert events[-1][1] == "response.cancelled"
    assert len(events) < 3000  # stopped long before its 3500 tokens

    for node in (a, b):  # one task, the same on both nodes
        status, body = node.request("GET", f"/lmsp/v1/tasks/{task['id']}")
        assert status == 200 and json.loads(body)["status"] == "cancelled"
    replay_conn, replay = follow(a, task["id"])
    assert read_events(replay) == events
    replay_conn.close()


def user(text: str) -> list:
    return [{"role": "user", "content": text}]


def test_a_response_stored_on_a_continues_on_b(nodes):
    a, b, _ = nodes
    model = model_of(a)
    request = {"model": model, "max_output_tokens": 4, "temperature": 0, "store": True}
    status, first = a.request("POST", "/lmsp/v1/responses", {**request, "input": user("My name is Ada.")})
    assert status == 200, first
    response_id = json.loads(first)["id"]
    assert b.request("GET", f"/lmsp/v1/responses/{response_id}") == (200, first)
    status, body = b.request("POST", "/lmsp/v1/responses", {
        **request, "input": user("What is my name?"), "previous_response_id": response_id})
    assert status == 200, body
    continued = json.loads(body)
    status, body = b.request("POST", "/lmsp/v1/responses", {**request, "input": user("What is my name?")})
    alone = json.loads(body)
    # the continuation's prompt held the first turn (its input and output) too
    assert continued["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + 5
    assert a.request("GET", f"/lmsp/v1/responses/{continued['id']}")[0] == 200
    assert b.request("DELETE", f"/lmsp/v1/responses/{response_id}")[0] == 200
    assert a.request("GET", f"/lmsp/v1/responses/{response_id}")[0] == 404


def test_an_idempotency_key_holds_across_nodes(nodes):
    a, b, _ = nodes
    model = model_of(a)
    body = {"model": model, "input": user("Hello"), "max_output_tokens": 4, "temperature": 0}
    status, first = a.request("POST", "/lmsp/v1/responses", body, headers={"Idempotency-Key": "k-response"})
    assert status == 200
    headers = []
    assert b.request("POST", "/lmsp/v1/responses", body, headers={"Idempotency-Key": "k-response"},
                     reply_headers=headers) == (200, first)
    assert ("Idempotent-Replayed", "true") in headers
    status, other = b.request("POST", "/lmsp/v1/responses", {**body, "input": user("Bye")},
                              headers={"Idempotency-Key": "k-response"})
    assert status == 422 and json.loads(other)["code"] == "idempotency_key_reused"

    task_body = {**body, "max_output_tokens": 8}
    status, created = a.request("POST", "/lmsp/v1/tasks", task_body, headers={"Idempotency-Key": "k-task"})
    assert status == 202
    status, repeated = b.request("POST", "/lmsp/v1/tasks", task_body, headers={"Idempotency-Key": "k-task"})
    assert status == 202 and json.loads(repeated)["id"] == json.loads(created)["id"]
    assert wait_final(b, json.loads(created)["id"])["status"] == "incomplete"  # (its 8 tokens)

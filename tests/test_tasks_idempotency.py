"""Idempotency keys (D8): replay, 409 while running, 422 on another body, per principal."""

import json
import sqlite3

import h11

import pytest
import trio
import trio.testing

from lmsp_min import idempotency
from lmsp_min.http import Response, StreamingResponse
from lmsp_min.problems import Problem
from lmsp_min.store.sqlite import SQLiteStore
from server_harness import make_service, parse_sse, start_server, tiny_path  # noqa: F401
from waiting import wait_until

BODY = {"model": "tiny:chat-q8_0", "input": [{"role": "user", "content": "Hi."}],
        "max_output_tokens": 4, "temperature": 0}


def key(value: str) -> dict:
    return {"Idempotency-Key": value}


@pytest.fixture
async def server(nursery, tiny_path, store_location):
    """A served service on each backend (SQLite, PostgreSQL)."""
    return await start_server(nursery, await make_service([tiny_path], data_dir=store_location))


async def test_a_repeated_sync_request_replays_the_same_json(server):
    first = await server.responses(BODY, headers=key("k1"))
    assert first.status == 200 and "idempotent-replayed" not in first.headers
    again = await server.responses(BODY, headers=key("k1"))
    assert again.status == 200 and again.body == first.body
    assert again.headers["idempotent-replayed"] == "true"
    # key order and whitespace do not make another body
    reordered = dict(reversed(list(BODY.items())))
    assert (await server.responses(reordered, headers=key("k1"))).body == first.body
    # another key is another request
    other = await server.responses(BODY, headers=key("k2"))
    assert other.json()["id"] != first.json()["id"]


async def test_the_same_key_with_another_body_is_422(server):
    await server.responses(BODY, headers=key("k1"))
    reply = await server.responses({**BODY, "max_output_tokens": 5}, headers=key("k1"))
    assert reply.status == 422 and reply.json()["code"] == "idempotency_key_reused"
    reply = await server.request("POST", "/lmsp/v1/tasks", json_body=BODY, headers=key("k1"))
    assert reply.status == 422  # the same key on the other route


async def test_a_failed_request_does_not_use_up_its_key(server):
    reply = await server.responses({**BODY, "model": "nope"}, headers=key("k1"))
    assert reply.status == 404
    reply = await server.responses({**BODY, "model": "nope"}, headers=key("k1"))
    assert reply.status == 404 and "idempotent-replayed" not in reply.headers


async def test_a_repeated_task_request_returns_the_same_task(server):
    first = await server.request("POST", "/lmsp/v1/tasks", json_body=BODY, headers=key("t1"))
    again = await server.request("POST", "/lmsp/v1/tasks", json_body=BODY, headers=key("t1"))
    assert again.status == 202 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["location"] == first.headers["location"]


async def test_a_repeated_stream_replays_the_whole_stream(server):
    async def stream() -> tuple[dict, bytes]:
        async with server.connection() as client:
            await client.send("POST", "/lmsp/v1/responses", json_body={**BODY, "stream": True},
                              headers=key("s1"))
            head = await client.read_head()
            return head.headers, b"".join([chunk async for chunk in client.read_chunks()])

    headers, first = await stream()
    assert parse_sse(first)[-1].event in ("response.completed", "response.incomplete")
    replay_headers, again = await stream()
    assert again == first and replay_headers["idempotent-replayed"] == "true"
    assert replay_headers["content-type"] == "text/event-stream"


async def test_keys_belong_to_their_principal(tmp_path):
    store = await SQLiteStore.open(tmp_path)
    runs = []

    async def run():
        runs.append(1)
        return Response(200, b'{"n":%d}' % len(runs))

    for principal in ("alice", "bob"):
        reply = await idempotency.run_once(store, FakeRequest("k", principal), "R", {}, run)
        assert reply.body == b'{"n":%d}' % len(runs)
    assert len(runs) == 2
    store.close()


class FakeRequest:
    def __init__(self, key: str | None, principal: str = "alice"):
        self.header_fields = [] if key is None else [("idempotency-key", key)]
        self.principal = principal


async def test_a_repeat_while_the_first_runs_is_409(tmp_path):
    store = await SQLiteStore.open(tmp_path)
    running, release = trio.Event(), trio.Event()

    async def slow():
        running.set()
        await release.wait()
        return Response(200, b"{}")

    async def first():
        assert (await idempotency.run_once(store, FakeRequest("k"), "R", {"a": 1}, slow)).body == b"{}"

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await running.wait()  # the first holds the key
            for body, code in (({"a": 1}, "idempotency_conflict"), ({"a": 2}, "idempotency_key_reused")):
                with pytest.raises(Problem) as raised:
                    await idempotency.run_once(store, FakeRequest("k"), "R", body, slow)
                assert raised.value.code == code
            release.set()
    replay = await idempotency.run_once(store, FakeRequest("k"), "R", {"a": 1}, slow)
    assert replay.headers == [("Idempotent-Replayed", "true")]
    store.close()


async def test_a_stream_that_never_starts_releases_its_key(tmp_path):
    """Its client left before the head was sent: the HTTP layer only closes it."""
    store = await SQLiteStore.open(tmp_path)
    closed = []

    async def chunks():
        try:
            yield b"id: 1\nevent: response.created\ndata: {}\n\n"
        finally:
            closed.append(True)

    source = chunks()
    await source.asend(None)  # (started, as a generation's events are by then)
    reply = await idempotency.run_once(store, FakeRequest("k"), "R", {}, _stream(lambda: source))
    await reply.chunks.aclose()
    assert await store.claim_idempotency_key("alice", "k", "whatever") is None and closed
    store.close()


@pytest.mark.parametrize("last, answered", [("response.output_text.delta", False), ("response.completed", True)])
async def test_a_stream_its_client_leaves_keeps_its_key_only_if_answered(tmp_path, last, answered):
    """Left before the final event: the key is released, a retry runs again. Left once
    it had the final event: the client has its whole answer, a retry replays it."""
    store = await SQLiteStore.open(tmp_path)

    async def chunks():
        yield b"id: 1\nevent: response.created\ndata: {}\n\n"
        yield f"id: 2\nevent: {last}\ndata: {{}}\n\n".encode()
        await trio.lowlevel.checkpoint()  # the generation's own clean-up after its last event

    reply = await idempotency.run_once(store, FakeRequest("k"), "R", {}, _stream(chunks))
    stream = aiter(reply.chunks)
    await stream.__anext__()
    await stream.__anext__()
    await reply.chunks.aclose()  # the client left (the HTTP layer closes the stream)
    record = await store.claim_idempotency_key("alice", "k", "R")
    assert (record is not None and record.state == "done") if answered else record is None
    store.close()


@pytest.mark.parametrize("header", ["", "x" * 256, "tab\there", "caf\u00e9"])
async def test_a_malformed_key_is_400(tmp_path, header):
    store = await SQLiteStore.open(tmp_path)
    with pytest.raises(Problem) as raised:
        await idempotency.run_once(store, FakeRequest(header), "R", {}, _stream(None))
    assert raised.value.code == "invalid_request" and raised.value.param == "Idempotency-Key"
    store.close()


async def test_two_idempotency_key_headers_are_a_400_not_one_joined_key(nursery, tiny_path, tmp_path):
    server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path / "data"))
    data = json.dumps(BODY).encode()
    headers = [("Host", "localhost"), ("Content-Type", "application/json"), ("Content-Length", str(len(data))),
               ("Idempotency-Key", "a"), ("Idempotency-Key", "b")]
    async with server.connection() as client:
        connection = client.h11
        await client.stream.send_all(connection.send(h11.Request(method="POST", target="/lmsp/v1/responses",
                                                                 headers=headers))
                                     + connection.send(h11.Data(data=data)) + connection.send(h11.EndOfMessage()))
        reply = await client.read_reply()
    assert reply.status == 400 and reply.json()["code"] == "invalid_request"
    assert reply.json()["param"] == "Idempotency-Key"
    # what two headers were joined into is one key when sent as one header
    first = await server.responses(BODY, headers=key("a, b"))
    again = await server.responses(BODY, headers=key("a, b"))
    assert first.status == again.status == 200 and again.headers["idempotent-replayed"] == "true"


def _stream(chunks):
    async def run():
        return StreamingResponse(chunks())
    return run


async def test_a_client_leaving_while_its_result_is_recorded_still_has_it_recorded(server, monkeypatch):
    """The recording is shielded: cancelled before its write started, it left the key
    'running' for good, and every retry got 409."""
    store = server.service.store
    record = store.complete_idempotency_key
    recording, left = trio.Event(), trio.Event()

    async def slow_record(*args, **kwargs):
        recording.set()
        await left.wait()  # the client leaves meanwhile
        await trio.testing.wait_all_tasks_blocked()  # (and the server has seen it go)
        await record(*args, **kwargs)

    monkeypatch.setattr(store, "complete_idempotency_key", slow_record)
    async with server.connection() as client:
        await client.send("POST", "/lmsp/v1/responses", json_body=BODY, headers=key("k1"))
        await recording.wait()
    left.set()

    async def answered():
        reply = await server.responses(BODY, headers=key("k1"))
        return reply if reply.status != 409 else None

    again = await wait_until(answered, "a retry answered", seconds=10, every=0.05)
    assert again.status == 200 and again.headers["idempotent-replayed"] == "true"


async def test_a_key_whose_result_cannot_be_recorded_is_released(server, monkeypatch):
    """A failing disk: the result cannot be recorded, nor (here) the key released at
    once; the periodic recovery releases it, and a retry runs again."""
    store = server.service.store
    claim, write = store.claim_idempotency_key, store._write
    disk_full = False

    async def claim_then_fill_the_disk(*args):
        nonlocal disk_full
        record = await claim(*args)
        disk_full = True
        return record

    async def failing_write(*args, **kwargs):
        if disk_full:
            raise sqlite3.OperationalError("database or disk is full")
        return await write(*args, **kwargs)

    monkeypatch.setattr(store, "claim_idempotency_key", claim_then_fill_the_disk)
    monkeypatch.setattr(store, "_write", failing_write)
    assert (await server.responses(BODY, headers=key("k1"))).status == 500
    monkeypatch.undo()
    assert (await server.responses(BODY, headers=key("k1"))).status == 409  # still held
    await server.service.tasks.recover()  # (what Tasks.run does every RECOVER_INTERVAL)
    again = await server.responses(BODY, headers=key("k1"))
    assert again.status == 200 and "idempotent-replayed" not in again.headers


async def test_keys_are_remembered_for_24_hours(server, monkeypatch):
    """D8: the service's own periodic purge keeps a key's result for at least 24 hours."""
    import time

    first = await server.responses(BODY, headers=key("a-day"))
    now = time.time()

    async def purge_at(moment: float) -> None:
        with monkeypatch.context() as clock:
            clock.setattr(server.service.tasks, "clock", lambda: moment)
            await server.service.tasks.purge()

    await purge_at(now + 24 * 3600 - 60)
    again = await server.responses(BODY, headers=key("a-day"))
    assert again.headers["idempotent-replayed"] == "true" and again.body == first.body
    await purge_at(now + 24 * 3600 + 60)  # (then it may go: the purge above did run)
    later = await server.responses(BODY, headers=key("a-day"))
    assert "idempotent-replayed" not in later.headers and later.json()["id"] != first.json()["id"]

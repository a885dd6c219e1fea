"""Tasks (D3) over real sockets: create, follow, resume, cancel, expire, fan out, recover."""

import json
import math
import random
import sqlite3
import time
from contextlib import aclosing

import h11
import pytest
import trio
import trio.testing

from lmsp_min import tasks
from lmsp_min.generation import prepare
from lmsp_min.http import Limits
from lmsp_min.problems import Problem
from lmsp_min.problems import unavailable
from lmsp_min.store import LoggedEvent, StoreError
from lmsp_min.store.sqlite import SQLiteStore
from lmsp_min.service import _only
from lmsp_min.tasks import Tasks
from server_harness import SSE, close_service, make_service, parse_sse, start_server, tiny_path  # noqa: F401
from waiting import wait_until

TASKS = "/lmsp/v1/tasks"
FINAL = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


def task_body(max_output_tokens: int = 8, **fields) -> dict:
    return {"model": "tiny:chat-q8_0", "input": [{"role": "user", "content": "Tell me a story."}],
            "max_output_tokens": max_output_tokens, "temperature": 0, **fields}


@pytest.fixture
async def server(nursery, tiny_path, store_location):
    """A served service on each backend (SQLite, PostgreSQL)."""
    return await start_server(nursery, await make_service([tiny_path], data_dir=store_location))


async def create(server, body: dict, headers=None) -> dict:
    reply = await server.request("POST", TASKS, json_body=body, headers=headers)
    assert reply.status == 202, reply.body
    task = reply.json()
    assert reply.headers["location"] == f"{TASKS}/{task['id']}"
    return task


async def wait_final(server, task_id: str, seconds: float = 30) -> dict:
    """The task once final, polled every few milliseconds; the test fails after `seconds`."""
    async def final():
        task = (await server.request("GET", f"{TASKS}/{task_id}")).json()
        return task if task["status"] in ("completed", "incomplete", "failed", "cancelled") else None

    return await wait_until(final, f"task {task_id} final", seconds, every=0.02)


async def follow(client, task_id: str, headers=None, query: str = ""):
    """The events of a task as they arrive on one connection; None for a keep-alive comment."""
    await client.send("GET", f"{TASKS}/{task_id}/events{query}", headers=headers)
    head = await client.read_head()
    assert head.status == 200 and head.headers["content-type"] == "text/event-stream"
    assert head.headers["lmsp-version"] == "1.0"  # D1: event streams too
    buffer = b""
    async for chunk in client.read_chunks():
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            if block.startswith(b":"):
                yield None
            else:
                yield parse_sse(block + b"\n\n")[0]


async def all_events(server, task_id: str, **kwargs) -> list[SSE]:
    async with server.connection() as client:
        return [event async for event in follow(client, task_id, **kwargs) if event is not None]


def text_of(events: list[SSE]) -> str:
    return "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta")


def message_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


class Gate:
    """Lets the model's chat events through only as the test allows: a task runs for
    exactly as long as a test needs it to (no sleeps raced against the generation)."""

    def __init__(self):
        self._allowed = 0.0
        self._changed = trio.Event()

    def allow(self, n: float = 1) -> None:
        """Let `n` more events that carry text through (math.inf: all of them)."""
        self._allowed += n
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self) -> None:
        while self._allowed < 1:
            await self._changed.wait()
        self._allowed -= 1


def gated(model, monkeypatch) -> Gate:
    """Hold the model's chat events at a Gate (the same events). Only those that carry text
    wait there (each gives at least one LMSP event); the others (an empty delta, which
    gives none; Finished, which comes after the last allowed one) pass."""
    gate = Gate()
    generate_chat = model.generate_chat

    async def held(prepared):
        async with aclosing(generate_chat(prepared)) as events:
            async for event in events:
                if getattr(event, "text", ""):
                    await gate.wait()
                yield event

    monkeypatch.setattr(model, "generate_chat", held)
    return gate


async def test_a_task_runs_in_the_background_and_its_events_replay(server):
    task = await create(server, task_body(stream=True))  # `stream` is ignored
    assert task["object"] == "task" and task["status"] in ("queued", "in_progress")
    assert task["response"] is None and task["response_id"].startswith("resp_")
    assert abs(task["created_at"] - time.time()) < 60  # seconds since the epoch
    events = await all_events(server, task["id"])
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert events[0].event == "response.created" and events[-1].event in FINAL
    assert all(e.data["response_id"] == task["response_id"] for e in events)
    final = await wait_final(server, task["id"])
    assert final["status"] == events[-1].data["status"]
    assert final["response"]["id"] == task["response_id"]
    assert final["response"]["usage"]["output_tokens"] <= 8
    assert text_of(events) == message_text(final["response"])
    # a finished task's events read again, the same
    again = await all_events(server, task["id"])
    assert [(e.id, e.event, e.data) for e in again] == [(e.id, e.event, e.data) for e in events]


async def test_resume_point_after_beats_last_event_id(server):
    task = await create(server, task_body())
    events = await all_events(server, task["id"])
    n = len(events)
    by_header = await all_events(server, task["id"], headers={"Last-Event-ID": "2"})
    assert [e.id for e in by_header] == list(range(3, n + 1))
    by_query = await all_events(server, task["id"], query="?after=4")
    assert [e.id for e in by_query] == list(range(5, n + 1))
    both = await all_events(server, task["id"], query="?after=1", headers={"Last-Event-ID": "3"})
    assert [e.id for e in both] == list(range(2, n + 1))
    # `after` wins: a Last-Event-ID beside it is not even read
    beside_junk = await all_events(server, task["id"], query="?after=1", headers={"Last-Event-ID": "x"})
    assert [e.id for e in beside_junk] == list(range(2, n + 1))
    assert await all_events(server, task["id"], query=f"?after={n}") == []
    # any non-negative integer is a resume point: leading zeros, and past any event id there is
    assert [e.id for e in await all_events(server, task["id"], query="?after=0004")] == list(range(5, n + 1))
    for huge in ("1" + "0" * 18, "9" * 40):
        assert await all_events(server, task["id"], query=f"?after={huge}") == []
        assert await all_events(server, task["id"], headers={"Last-Event-ID": huge}) == []


@pytest.mark.parametrize("query, headers, param", [
    ("?after=-1", None, "after"), ("?after=abc", None, "after"), ("?after=", None, "after"),
    ("?after=1.5", None, "after"), ("", {"Last-Event-ID": "x"}, "Last-Event-ID"),
])
async def test_a_bad_resume_point_is_400(server, query, headers, param):
    task = await create(server, task_body(max_output_tokens=1))
    reply = await server.request("GET", f"{TASKS}/{task['id']}/events{query}", headers=headers)
    assert reply.status == 400 and reply.json()["code"] == "invalid_request"
    assert reply.json()["param"] == param


async def test_unknown_task_is_404(server):
    for method, path in (("GET", "/task_nope"), ("GET", "/task_nope/events"), ("POST", "/task_nope/cancel")):
        reply = await server.request(method, TASKS + path)
        assert reply.status == 404 and reply.json()["code"] == "task_not_found"


async def test_invalid_task_request_is_refused_before_any_task(server):
    reply = await server.request("POST", TASKS, json_body={"model": "tiny:chat-q8_0", "input": [],
                                                          "max_tokens": 3})
    assert reply.status == 400 and reply.json()["param"] == "max_tokens"
    reply = await server.request("POST", TASKS, json_body=task_body(model="nope"))
    assert reply.status == 404 and reply.json()["code"] == "model_not_found"
    # 6.1's refusals hold for a task as for a direct request: before any task exists
    reply = await server.request("POST", TASKS, json_body=task_body(max_output_tokens=100_000))
    assert reply.status == 400 and reply.json()["code"] == "context_length_exceeded"
    reply = await server.request("POST", TASKS, json_body=task_body(previous_response_id="resp_nope"))
    assert reply.status == 404 and reply.json()["code"] == "response_not_found"
    count = await server.service.store._read(lambda conn: conn.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])
    assert count == 0


@pytest.mark.parametrize("depth", [65, 940])  # 940: about as deep as json.loads reads
async def test_a_body_nested_too_deeply_is_400(server, depth):
    # body, input, an item, then lists in a key the validator ignores
    lists = depth - 3
    text = json.dumps(task_body(input=[{"role": "user", "content": "hi", "x": "X"}]))
    text = text.replace('"X"', "[" * lists + "]" * lists)
    reply = await server.request("POST", TASKS, body=text.encode(), headers={"Content-Type": "application/json"})
    assert reply.status == 400 and reply.json()["code"] == "invalid_request"
    assert (await server.request("POST", TASKS, json_body=task_body())).status == 202


async def test_cancel_stops_a_running_task(server, monkeypatch):
    gate = gated(server.service.registry.get("tiny:chat-q8_0").model, monkeypatch)
    gate.allow(3)  # then it waits, running, until cancelled
    task = await create(server, task_body(max_output_tokens=400, store=True))
    with trio.fail_after(30):
        async with server.connection() as client:
            events = follow(client, task["id"])
            first = await events.__anext__()
            assert first.event == "response.created"
            seen = [await events.__anext__() for _ in range(3)]
            reply = await server.request("POST", f"{TASKS}/{task['id']}/cancel")
            assert reply.status == 200
            cancelled = reply.json()
            rest = [e async for e in events if e is not None]
    assert cancelled["status"] == "cancelled" and cancelled["response"]["status"] == "cancelled"
    assert rest[-1].event == "response.cancelled" and rest[-1].data["status"] == "cancelled"
    # 6.2: usage is what was consumed until the cancel (each delta cost at least one token)
    usage = cancelled["response"]["usage"]
    deltas = sum(e.event == "response.output_text.delta" for e in seen)
    assert usage["input_tokens"] > 0 and deltas <= usage["output_tokens"] < 400
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    stored = (await server.request("GET", f"/lmsp/v1/responses/{task['response_id']}")).json()
    assert stored["status"] == "cancelled" and stored["usage"] == usage
    # cancelling a final task changes nothing
    again = await server.request("POST", f"{TASKS}/{task['id']}/cancel")
    assert again.json() == cancelled
    gate.allow(1)  # (the cancelled task may have used all three: its events reach followers after it)
    done = await create(server, task_body(max_output_tokens=1))
    final = await wait_final(server, done["id"])
    assert (await server.request("POST", f"{TASKS}/{done['id']}/cancel")).json() == final


async def test_keepalive_comments_while_idle(nursery, tiny_path, tmp_path, monkeypatch):
    server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path,
                                                            limits=Limits(stream_keepalive=0.02)))
    gate = gated(server.service.registry.get("tiny:chat-q8_0").model, monkeypatch)  # idle until opened
    task = await create(server, task_body(max_output_tokens=4))
    seen = []
    with trio.fail_after(30):
        async with server.connection() as client:
            async for event in follow(client, task["id"]):
                seen.append(event)
                if seen.count(None) == 4:
                    gate.allow(math.inf)
    assert seen.count(None) >= 4 and seen[-1].event in FINAL


async def test_a_follower_resumed_past_the_last_event_gets_keepalives_while_the_task_publishes(
        nursery, tiny_path, tmp_path, monkeypatch):
    """D3: an idle stream gets a comment at least every `stream_keepalive` seconds, also while
    the task publishes events this follower does not get (it is ahead of them)."""
    server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path,
                                                            limits=Limits(stream_keepalive=0.05)))
    gate = gated(server.service.registry.get("tiny:chat-q8_0").model, monkeypatch)
    task = await create(server, task_body(max_output_tokens=200))
    seen = []
    with trio.fail_after(30):
        async with server.connection() as client:
            async for event in follow(client, task["id"], query="?after=100000"):
                seen.append(event)
                gate.allow(math.inf if seen.count(None) == 4 else 1)  # an event published per comment
    assert seen == [None] * len(seen) and len(seen) >= 4


def test_by_default_events_are_kept_an_hour_and_idle_streams_commented_within_15_seconds(monkeypatch, tiny_path):
    """D3's defaults: events retained one hour (in a program of one's own as with `serve`),
    and a keep-alive comment at least every 15 s in an idle task stream or direct stream."""
    from lmsp_min import cli, service

    assert Limits().stream_keepalive <= 15
    assert service.ServiceConfig().event_retention == 3600
    configs = []
    monkeypatch.setattr(service, "run", lambda config, host, port: configs.append(config))
    assert cli.main(["serve", "--model", str(tiny_path)]) == 0
    assert configs[0].event_retention == 3600 and configs[0].limits.stream_keepalive <= 15


async def test_events_expire_after_the_retention_period(nursery, tiny_path, tmp_path):
    service = await make_service([tiny_path], data_dir=tmp_path, event_retention=0.2)
    server = await start_server(nursery, service)
    task = await create(server, task_body(max_output_tokens=2))
    assert (await all_events(server, task["id"]))[-1].event in FINAL
    final = await wait_final(server, task["id"])
    service.tasks.clock = lambda: time.time() + 0.3  # (the retention's clock moved on, not waited for)
    reply = await server.request("GET", f"{TASKS}/{task['id']}/events")
    assert reply.status == 410 and reply.json()["code"] == "event_history_expired"
    # ...and the periodic purge (every 0.5 s here) deletes them; the task itself stays
    async def purged():
        return not await service.store.read_events(task["id"], 0)

    await wait_until(purged, "the expired events purged", seconds=10, every=0.1)
    assert (await server.request("GET", f"{TASKS}/{task['id']}")).json() == final


async def test_fan_out_with_drops_and_resumes(server, monkeypatch):
    """50 followers, each dropping its connection at random points and resuming
    from its last id: every one reassembles exactly the final text."""
    gate = gated(server.service.registry.get("tiny:chat-q8_0").model, monkeypatch)
    task = await create(server, task_body(max_output_tokens=60))
    texts: dict[int, str] = {}
    live_or_not = set()  # was the task running when a follower (re)connected?
    connected = set()  # the followers that have connected once: the task runs on when all have

    async def follower(n: int) -> None:
        rng = random.Random(n)
        last, events = 0, []
        use_query = rng.random() < 0.5
        while not events or events[-1].event not in FINAL:
            budget = rng.randint(1, 20)
            headers = None if use_query or not last else {"Last-Event-ID": str(last)}
            query = f"?after={last}" if use_query and last else ""
            live_or_not.add(server.service.tasks.is_running(task["id"]))
            connected.add(n)
            if len(connected) == 50:
                gate.allow(math.inf)
            async with server.connection() as client:
                async for event in follow(client, task["id"], headers=headers, query=query):
                    if event is None:
                        continue
                    assert event.id == last + 1
                    events.append(event)
                    last = event.id
                    budget -= 1
                    if budget == 0:
                        break  # drop the connection mid-stream
        texts[n] = text_of(events)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for n in range(50):
                nursery.start_soon(follower, n)
        final = await wait_final(server, task["id"])
    assert len(texts) == 50 and set(texts.values()) == {message_text(final["response"])}
    assert any(live_or_not)  # followers joined the live broadcast, not only the replay


async def test_recovery_fails_interrupted_tasks_and_keeps_their_events(tmp_path):
    store = await SQLiteStore.open(tmp_path)
    await store.create_task("task_1", "alice", 1794200000, "tiny:chat-q8_0", "resp_1", "{}")
    item = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    done = dict(item, content=[{"type": "output_text", "text": "Hel"}])
    await store.append_events("task_1", [
        LoggedEvent(1, "response.created", '{"response_id":"resp_1","status":"in_progress"}'),
        LoggedEvent(2, "response.output_item.added", json.dumps({"output_index": 0, "item": item})),
        LoggedEvent(3, "response.output_item.done", json.dumps({"output_index": 0, "item": done})),
    ])
    await store.create_task("task_2", "alice", 1794200000, "tiny:chat-q8_0", "resp_2", "{}")
    cut = dict(item, id="msg_2")
    await store.append_events("task_2", [
        LoggedEvent(1, "response.output_item.added", json.dumps({"output_index": 0, "item": cut})),
        LoggedEvent(2, "response.output_text.delta", json.dumps({"item_id": "msg_2", "delta": "Wor"})),
        LoggedEvent(3, "response.output_text.delta", json.dumps({"item_id": "msg_2", "delta": "ld"})),
    ])
    await store.create_task("task_3", "alice", 1794200000, "tiny:chat-q8_0", "resp_3", "{}")  # queued
    store.close()  # the process that ran them is gone
    store = await SQLiteStore.open(tmp_path)
    assert await Tasks(store).recover() == ["task_1", "task_2", "task_3"]
    row = await store.get_task("task_1", "alice")
    response = row.object()["response"]
    assert row.status == "failed" and response["status"] == "failed"
    assert response["error"]["code"] == "generation_failed" and "stopped" in response["error"]["detail"]
    assert response["output"] == [done] and response["model"] == "tiny:chat-q8_0"
    assert response["usage"] is None  # the counts died with the process
    events = await store.read_events("task_1", 0)
    assert [e.seq for e in events] == [1, 2, 3, 4] and events[-1].event == "response.failed"
    assert json.loads(events[-1].data)["error"] == response["error"]
    # an item cut short keeps the text its deltas brought
    assert (await store.get_task("task_2", None)).object()["response"]["output"] == [
        dict(cut, content=[{"type": "output_text", "text": "World"}])]
    assert (await store.read_events("task_2", 0))[-1].seq == 4
    assert [e.event for e in await store.read_events("task_3", 0)] == ["response.failed"]
    assert await Tasks(store).recover() == []
    store.close()


async def test_a_broken_task_fails_alone_and_the_service_goes_on(server, monkeypatch):
    async def disk_full(task_id, events):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(server.service.store, "append_events", disk_full)
    task = await create(server, task_body(max_output_tokens=5))
    final = await wait_final(server, task["id"])
    assert final["status"] == "failed" and final["response"]["error"]["code"] == "internal_error"
    assert "disk" not in final["response"]["error"]["detail"]  # no internals in a detail
    events = await all_events(server, task["id"])
    assert [(e.id, e.event) for e in events] == [(1, "response.failed")]
    monkeypatch.undo()
    assert (await wait_final(server, (await create(server, task_body(max_output_tokens=2)))["id"]))[
        "status"] in ("completed", "incomplete")


async def test_a_broken_task_is_logged_with_its_cause(server, monkeypatch):
    """Under trio >= 0.25 the runner's nursery wraps what failed in an exception group:
    the log said "ExceptionGroup: Exceptions from Trio nursery (1 sub-exception)"."""
    async def disk_full(task_id, events):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(server.service.store, "append_events", disk_full)
    task = await create(server, task_body(max_output_tokens=5))
    await wait_final(server, task["id"])
    assert f"error: task {task['id']} failed: OperationalError: database or disk is full" in (
        server.service.log_lines)


@pytest.mark.slow
async def test_a_smollm2_task_says_what_a_direct_request_says(nursery, smollm2_path, tmp_path):
    server = await start_server(nursery, await make_service([smollm2_path], data_dir=tmp_path))
    model = (await server.request("GET", "/lmsp/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "input": [{"role": "user", "content": "What is the capital of France?"}],
            "max_output_tokens": 24, "temperature": 0}
    task = await create(server, body)
    events = await all_events(server, task["id"])
    final = await wait_final(server, task["id"])
    direct = (await server.responses(body)).json()
    assert text_of(events) == message_text(final["response"]) == message_text(direct)
    assert "Paris" in text_of(events)


async def test_two_processes_share_a_data_directory(nursery, tiny_path, tmp_path, monkeypatch):
    """A task one service runs is followed through another on the same data
    directory (by polling its log); when the first dies, the second fails the
    task and its followers get the final event."""
    monkeypatch.setattr(tasks, "OWNER_CHECK_INTERVAL", 0.2)
    first = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path))
    second = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path,
                                                            limits=Limits(stream_keepalive=0.2)))
    task = await create(first, task_body(max_output_tokens=40))
    events = await all_events(second, task["id"])
    assert [e.id for e in events] == list(range(1, len(events) + 1)) and events[-1].event in FINAL
    assert text_of(events) == message_text((await wait_final(second, task["id"]))["response"])

    # a task whose process is alive but will die (its runner never started here)
    store = first.service.store
    await store.create_task("task_orphan", "local", 0, "tiny:chat-q8_0", "resp_orphan", "{}")
    await store.append_events("task_orphan", [LoggedEvent(1, "response.created", "{}")])
    async with second.connection() as client:
        stream = follow(client, "task_orphan")
        assert (await stream.__anext__()).id == 1
        assert await stream.__anext__() is None  # keep-alive: it is still running elsewhere
        store._owner_lock.close()  # the first process dies (the kernel drops its lock)
        rest = [e async for e in stream if e is not None]
    assert [(e.id, e.event) for e in rest] == [(2, "response.failed")]


async def test_a_follower_through_another_process_gets_keepalives_on_time(nursery, tiny_path, tmp_path,
                                                                         monkeypatch):
    """D3: a comment at least every `stream_keepalive` seconds while idle, however long the polls'
    reads take: only the polls' sleeps were counted, so with reads of 0.2 s the comments
    came every 1 s instead of every 0.2 s."""
    first = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path))
    second = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path,
                                                            limits=Limits(stream_keepalive=0.2)))
    await first.service.store.create_task("task_elsewhere", "local", 0, "tiny:chat-q8_0", "resp_1", "{}")
    read_events = second.service.store.read_events

    async def slow_read(*args, **kwargs):
        await trio.sleep(0.2)  # (a read that takes 0.2 s: the scenario, not a wait)
        return await read_events(*args, **kwargs)

    monkeypatch.setattr(second.service.store, "read_events", slow_read)
    seen = []
    async with second.connection() as client:
        with trio.move_on_after(2.0):
            async for event in follow(client, "task_elsewhere"):
                seen.append(event)
    assert seen.count(None) == len(seen) >= 3  # (one every 0.25 to 0.5 s, 4 to 8; it was one a second)


async def test_a_task_is_cancelled_through_another_process(nursery, tiny_path, tmp_path, monkeypatch):
    first = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path))
    second = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path))
    gated(first.service.registry.get("tiny:chat-q8_0").model, monkeypatch).allow(2)  # then it waits
    task = await create(first, task_body(max_output_tokens=200))
    with trio.fail_after(30):
        async with second.connection() as client:  # wait until it runs
            stream = follow(client, task["id"])
            while (await stream.__anext__()).event != "response.output_text.delta":
                pass
    reply = await second.request("POST", f"{TASKS}/{task['id']}/cancel")
    assert reply.status == 200 and reply.json()["status"] == "cancelled"
    events = await all_events(second, task["id"])
    assert events[-1].event == "response.cancelled" and len(events) < 200


async def test_a_peer_fails_the_tasks_of_a_dead_process_without_being_asked(nursery, tiny_path, tmp_path,
                                                                            monkeypatch):
    """Within RECOVER_INTERVAL, not only when a client follows the task."""
    monkeypatch.setattr(tasks, "RECOVER_INTERVAL", 0.1)
    first = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path))
    second = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path))
    store = first.service.store
    await store.create_task("task_orphan", "local", 0, "tiny:chat-q8_0", "resp_orphan", "{}")
    store._owner_lock.close()  # the first process dies (the kernel drops its lock)
    with trio.fail_after(10):
        assert (await wait_final(second, "task_orphan"))["status"] == "failed"


async def test_a_task_whose_runner_could_not_end_it_is_failed_later(server, monkeypatch):
    """A failing disk kept the runner from writing any end: the task is not left
    in_progress for good, and its events end with a final one."""
    async def disk_full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(server.service.store, "finish_task", disk_full)
    task = await create(server, task_body(max_output_tokens=5))
    await wait_until(lambda: not server.service.tasks.is_running(task["id"]), "the runner ended", seconds=10)
    assert (await server.request("GET", f"{TASKS}/{task['id']}")).json()["status"] == "in_progress"
    monkeypatch.undo()  # the disk has room again
    events = await all_events(server, task["id"])
    assert events[-1].event == "response.failed"
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    final = await wait_final(server, task["id"])
    assert final["status"] == "failed" and final["response"]["error"]["code"] == "internal_error"


async def test_a_task_whose_runner_failed_says_so_whoever_writes_its_end(server, monkeypatch):
    """The disk was full for the runner's end, then had room: the task says its runner
    failed (internal_error), not that the service is shutting down."""
    finish_task = server.service.store.finish_task
    full = [sqlite3.OperationalError("database or disk is full")] * 2

    async def full_twice(*args, **kwargs):
        if full:
            raise full.pop()
        return await finish_task(*args, **kwargs)

    monkeypatch.setattr(server.service.store, "finish_task", full_twice)
    task = await create(server, task_body(max_output_tokens=5))
    await wait_until(lambda: not server.service.tasks.is_running(task["id"]), "the runner ended", seconds=10)
    await server.service.tasks.recover()  # (as the next periodic recovery would)
    final = await wait_final(server, task["id"])
    assert final["status"] == "failed" and final["response"]["error"]["code"] == "internal_error"


async def test_a_follower_is_cut_off_when_the_task_end_cannot_be_committed(server, monkeypatch):
    """The database took the task's events, then was lost for its end (and for the failed
    end its runner tries next): the follower's stream is cut, not closed as if complete (it
    was closed cleanly without a final event). Resuming once the database is back, it gets
    the rest, the final event included."""
    gate = gated(server.service.registry.get("tiny:chat-q8_0").model, monkeypatch)

    async def lost(*args, **kwargs):
        raise unavailable()

    monkeypatch.setattr(server.service.store, "finish_task", lost)
    task = await create(server, task_body(max_output_tokens=5))
    seen = []
    with trio.fail_after(30):
        async with server.connection() as client:
            with pytest.raises(h11.RemoteProtocolError, match="incomplete chunked read"):
                async for event in follow(client, task["id"]):
                    seen += [event] if event is not None else []
                    gate.allow(math.inf)  # (it follows the task as it runs)
    assert seen and seen[-1].event not in FINAL
    assert any(line.startswith(f"error: a response stream was cut: task {task['id']}")
               for line in server.service.log_lines)
    monkeypatch.undo()  # the database is back
    rest = await all_events(server, task["id"], headers={"Last-Event-ID": str(seen[-1].id)})
    assert [e.id for e in rest] == list(range(seen[-1].id + 1, seen[-1].id + 1 + len(rest)))
    assert rest[-1].event == "response.failed"


async def test_an_expiry_purge_cannot_cut_a_replay_short(tmp_path):
    store = await SQLiteStore.open(tmp_path)
    await store.create_task("task_1", "local", 0, "tiny:chat-q8_0", "resp_1", "{}")
    events = [LoggedEvent(seq, "response.output_text.delta", "{}") for seq in range(1, 1500)]
    await store.append_events("task_1", events)
    await store.finish_task("task_1", "completed", "{}", [LoggedEvent(1500, "response.completed", "{}")])
    async with aclosing(await Tasks(store).events("task_1", "local", 0)) as replay:
        replayed = await replay.__anext__()
        await store.purge(2e9, 0, 0)  # every ended task's events expire now
        replayed += [event async for batch in replay for event in batch]
    assert [event.seq for event in replayed] == list(range(1, 1501))
    store.close()


async def test_events_purged_just_after_the_expiry_check_are_410(tmp_path, monkeypatch):
    """6.4: events older than the retention period are 410 event_history_expired. Purged
    between the check and the replay's read, they were a 200 stream without any event,
    which a client takes for "nothing after the resume point" (client.follow_task)."""
    store = await SQLiteStore.open(tmp_path)
    await store.create_task("task_1", "local", 0, "tiny:chat-q8_0", "resp_1", "{}")
    await store.finish_task("task_1", "completed", "{}", [LoggedEvent(1, "response.completed", "{}")])
    read_events = store.read_events

    async def purged_first(*args, **kwargs):
        await store.purge(2e9, 0, 0)  # every ended task's events expire now
        return await read_events(*args, **kwargs)

    monkeypatch.setattr(store, "read_events", purged_first)
    with pytest.raises(Problem) as raised:
        async with aclosing(await Tasks(store).events("task_1", "local", 0)) as replay:
            assert [chunk async for chunk in replay] == []
    assert (raised.value.status, raised.value.code) == (410, "event_history_expired")
    store.close()


async def test_a_damaged_database_is_a_store_error_at_start(tmp_path):
    store = await SQLiteStore.open(tmp_path)
    for n in range(200):  # pages beyond the first few
        await store.create_task(f"task_{n}", "local", 0, "tiny:chat-q8_0", f"resp_{n}", "x" * 500)
    store.close()
    path = tmp_path / "lmsp-min.sqlite3"
    with open(path, "r+b") as file:
        for offset in range(4096, path.stat().st_size, 4096):
            file.seek(offset)
            file.write(bytes(random.Random(offset).randrange(256) for _ in range(4096)))
    store = await SQLiteStore.open(tmp_path)
    with pytest.raises(StoreError, match="cannot be read"):
        await Tasks(store).run()
    store.close()


async def test_task_events_are_those_of_a_direct_stream(nursery, tiny_path):
    """The same greedy request, streamed directly and run as a task (here on the
    in-memory database of --no-store): the same events, ids and text."""
    server = await start_server(nursery, await make_service([tiny_path]))
    body = task_body(max_output_tokens=12)
    direct = parse_sse((await server.responses({**body, "stream": True})).body)
    task = await create(server, body)
    followed = await all_events(server, task["id"])
    assert [(e.id, e.event) for e in followed] == [(e.id, e.event) for e in direct]
    assert text_of(followed) == text_of(direct)
    counts = ("input_tokens", "output_tokens", "total_tokens")  # cached_tokens differ: the task reuses the stream's KV
    assert [followed[-1].data["usage"][k] for k in counts] == [direct[-1].data["usage"][k] for k in counts]


async def test_a_service_that_stops_fails_its_running_tasks_at_once(tiny_path, tmp_path, monkeypatch):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path))
        gated(server.service.registry.get("tiny:chat-q8_0").model, monkeypatch).allow(3)  # then it waits
        task = await create(server, task_body(max_output_tokens=300))
        async with server.connection() as client:
            stream = follow(client, task["id"])
            with trio.fail_after(30):
                seen = [await stream.__anext__() for _ in range(4)]
            nursery.cancel_scope.cancel()  # the service stops (and closes its store)
    store = await SQLiteStore.open(tmp_path)
    row = await store.get_task(task["id"], None)
    response = row.object()["response"]
    # D1: 503 model_unavailable, "the service is shutting down", as a direct response gets
    assert row.status == "failed" and response["error"]["code"] == "model_unavailable"
    deltas = sum(e.event == "response.output_text.delta" for e in seen)
    assert response["usage"]["input_tokens"] > 0 and deltas <= response["usage"]["output_tokens"] < 300
    events = await store.read_events(task["id"], 0)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.seq for e in events[:4]] == [e.id for e in seen] and events[-1].event == "response.failed"
    assert await Tasks(store).recover() == []  # nothing was left for a restart to do
    store.close()


async def test_a_task_created_once_the_service_has_stopped_at_once_ends_as_it_stops(tiny_path, tmp_path,
                                                                                   monkeypatch):
    """The row of a task was written just after a forced stop closed the tasks' nursery:
    its start raised RuntimeError, the task stayed running for good, and its row queued."""
    service = await make_service([tiny_path], data_dir=tmp_path)
    generation = await prepare(task_body(), "local", service)
    create_task = service.store.create_task
    created, stopped = [], trio.Event()

    async def after_the_stop(task_id, *args):
        await stopped.wait()
        await create_task(task_id, *args)
        created.append(task_id)

    monkeypatch.setattr(service.store, "create_task", after_the_stop)
    refused = []

    async def start() -> None:  # (a request's handler)
        with pytest.raises(Problem) as raised:
            await service.tasks.start(generation, task_body())
        refused.append(raised.value)

    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as forced_stop:
            async with trio.open_nursery() as service_nursery:
                await service_nursery.start(service.tasks.run)
                nursery.start_soon(start)
                await trio.testing.wait_all_tasks_blocked()
                forced_stop.cancel()
        stopped.set()
    # D1: 503 model_unavailable, the service is shutting down; for the row too, as for a running task
    assert [(problem.status, problem.code) for problem in refused] == [(503, "model_unavailable")]
    assert not service.tasks.is_running(created[0])
    row = await service.store.get_task(created[0], None)
    assert row.status == "failed" and row.object()["response"]["error"]["code"] == "model_unavailable"
    assert [e.event for e in await service.store.read_events(created[0], 0)] == ["response.failed"]
    await close_service(service)


async def test_a_runner_failing_as_a_forced_stop_cancels_it_lets_the_service_stop(tiny_path, tmp_path,
                                                                                    monkeypatch):
    """A task's event write fails (a full disk) just as a forced stop cancels its runner:
    the runner's nursery raised both in one group, which escaped Tasks.run (serve
    printed a traceback at exit). The error is the task's, logged; the stop goes on."""
    service = await make_service([tiny_path], data_dir=tmp_path)
    generation = await prepare(task_body(max_output_tokens=50), "local", service)
    append_events = service.store.append_events
    writing, stopping = trio.Event(), trio.Event()

    async def append_then_fail(task_id, events):
        await append_events(task_id, events)
        writing.set()
        with trio.CancelScope(shield=True):  # as a store write: it finishes, then fails
            await stopping.wait()
            await trio.testing.wait_all_tasks_blocked()  # (the runner's other tasks have their cancel)
            raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(service.store, "append_events", append_then_fail)
    with trio.CancelScope() as forced_stop:
        async with trio.open_nursery() as service_nursery:
            await service_nursery.start(service.tasks.run)
            task = await service.tasks.start(generation, task_body())
            await writing.wait()
            forced_stop.cancel()
            stopping.set()
    assert forced_stop.cancelled_caught  # and nothing else came out
    assert any("database or disk is full" in line for line in service.log_lines)
    monkeypatch.setattr(service.store, "append_events", append_events)  # the disk has room again
    assert await Tasks(service.store).recover() == [task.id]  # as the next start does
    assert (await service.store.get_task(task.id, None)).status == "failed"
    await close_service(service)


async def test_a_draining_service_sends_followers_the_final_event(nursery, tiny_path, tmp_path, monkeypatch):
    """SIGTERM drains the service: its tasks end failed first, so that the clients
    following them get the final event before their streams close."""
    server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path))
    gated(server.service.registry.get("tiny:chat-q8_0").model, monkeypatch).allow(3)  # then it waits
    task = await create(server, task_body(max_output_tokens=300, store=True))
    async with server.connection() as client:
        stream = follow(client, task["id"])
        with trio.fail_after(30):
            seen = [await stream.__anext__() for _ in range(4)]
        async with trio.open_nursery() as draining:
            draining.start_soon(server.service.drain, 5.0)
            rest = [event async for event in stream if event is not None]
    # D1: 503 model_unavailable, "the service is shutting down", as for a direct response
    assert rest[-1].event == "response.failed" and rest[-1].data["error"]["code"] == "model_unavailable"
    assert set(rest[-1].data) == {"response_id", "status", "error"}  # (6.3)
    # with store: true, the failed response is stored like any other (6.2, D6), with what it consumed
    stored = await server.service.store.get_response(task["response_id"], "local")
    response = json.loads(stored.body)
    deltas = sum(e.event == "response.output_text.delta" for e in seen + rest)
    assert response["status"] == "failed" and response["error"] == rest[-1].data["error"]
    assert response["usage"]["input_tokens"] > 0 and deltas <= response["usage"]["output_tokens"] < 300


async def test_a_failing_recovery_is_logged_and_the_service_goes_on(nursery, tiny_path, tmp_path, monkeypatch):
    """An OSError (no file descriptor left to look at a peer's lock) ended the server."""
    monkeypatch.setattr(tasks, "RECOVER_INTERVAL", 0.05)
    lines = []
    server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path, log=lines.append))

    async def no_descriptor_left(*args):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(server.service.store, "interrupted_tasks", no_descriptor_left)
    await wait_until(lambda: any("Too many open files" in line for line in lines), "the failure logged", seconds=10)
    monkeypatch.undo()
    assert (await wait_final(server, (await create(server, task_body(max_output_tokens=2)))["id"]))["status"] in (
        "completed", "incomplete")


async def test_an_error_of_trio_ends_the_periodic_work_instead_of_spinning(monkeypatch):
    """After an abnormal teardown trio's calls raised on every round, and the loop that
    logged them went round at full speed (6.6 million lines in a few seconds)."""
    lines = []
    store = await SQLiteStore.open(None)
    real_sleep = trio.sleep
    failures = 3

    async def broken_sleep(seconds):
        nonlocal failures
        if failures:
            failures -= 1
            raise RuntimeError("must be called from async context")
        await real_sleep(seconds)

    monkeypatch.setattr(trio, "sleep", broken_sleep)
    with pytest.raises(BaseException) as raised:  # (an exception group since trio 0.25)
        with trio.fail_after(2):  # (the old loop logged the errors, then slept its 5 s)
            await Tasks(store, log=lines.append).run()
    assert isinstance(_only(raised.value, RuntimeError), RuntimeError)
    assert failures == 2 and lines == []
    store.close()


async def test_failing_periodic_work_is_logged_once_a_round(monkeypatch):
    monkeypatch.setattr(tasks, "RECOVER_INTERVAL", 0.05)
    lines = []
    store = await SQLiteStore.open(None)

    async def disk_full(*args):
        raise sqlite3.OperationalError("database or disk is full")

    async with trio.open_nursery() as nursery:
        await nursery.start(Tasks(store, event_retention=0.0, log=lines.append).run)  # (a purge every 0.5 s)
        monkeypatch.setattr(store, "purge", disk_full)
        monkeypatch.setattr(store, "interrupted_tasks", disk_full)
        start = trio.current_time()
        await wait_until(lambda: any(line.startswith("error: purging what expired failed") for line in lines),
                         "the failed purge logged", seconds=5)
        rounds = (trio.current_time() - start) / 0.05
        nursery.cancel_scope.cancel()
    recoveries = sum(line.startswith("error: recovering tasks failed: OperationalError") for line in lines)
    assert len(lines) == recoveries + 1 and 1 <= recoveries <= rounds + 1  # (one a round, not a spin)
    store.close()


async def test_a_task_that_cannot_be_created_releases_its_admission(server, monkeypatch):
    """The task owns its generation from `Tasks.start` on: a row that cannot be written
    (a full disk) releases the model's admission at once, with the garbage collector off."""
    import gc

    async def disk_full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(server.service.store, "create_task", disk_full)
    entry = server.service.registry.get("tiny:chat-q8_0")
    gc.disable()
    try:
        reply = await server.request("POST", TASKS, json_body=task_body())
        assert reply.status == 500 and entry.admitted == 0
    finally:
        gc.enable()
    monkeypatch.undo()
    task = await create(server, task_body(max_output_tokens=2))
    await wait_final(server, task["id"])
    assert entry.admitted == 0

"""What a client sees when the PostgreSQL store fails under a node (issue 43): tables
locked by another session and a frozen server are 503s within --store-timeout, never a
hang as long as the fault; after a crash of the server, an event id a follower holds
still means what it meant.

Each test has a PostgreSQL server of its own (tests/pg_server.py), which it locks,
freezes (SIGSTOP of every process of it) or crashes (`pg_ctl -m immediate`). Its WAL
writer wakes every 10 s only, so that a commit that did not wait for the WAL flush is
certainly still in memory, and lost, when the server crashes.
"""

import math
import os
import signal
from contextlib import contextmanager

import psycopg
import pytest
import trio

from server_harness import make_service, start_server, tiny_path  # noqa: F401
from test_tasks import TASKS, all_events, create, follow, gated, task_body, wait_final
from waiting import wait_until

TIMEOUT = 2.0  # the --store-timeout of these tests' nodes
# What a 503 may take beyond the timeout on a loaded 2-core machine (a bound, not a guess
# at how long it takes: the fault itself lasts until the test ends it).
SLACK = 4.0


@pytest.fixture
def own_server():
    from pg_server import started

    server = started(settings={"wal_writer_delay": "10s"})
    yield server
    server.stop()


async def node(nursery, tiny_path, url: str):
    return await start_server(nursery, await make_service([tiny_path], data_dir=url, store_timeout=TIMEOUT))


async def stored_response(server) -> str:
    """The path of a response stored through `server`."""
    reply = await server.request("POST", "/lmsp/v1/responses", json_body=task_body(store=True))
    assert reply.status == 200, reply.body
    return f"/lmsp/v1/responses/{reply.json()['id']}"


async def assert_503_within_the_timeout(server, path: str) -> None:
    """A read, a task and a stored response, each a 503 with Retry-After within the bound."""
    for method, target, body in (("GET", path, None), ("POST", TASKS, task_body()),
                                 ("POST", "/lmsp/v1/responses", task_body(store=True))):
        with trio.fail_after(TIMEOUT + SLACK):
            reply = await server.request(method, target, json_body=body)
        assert reply.status == 503 and reply.json()["code"] == "model_unavailable", (target, reply.body)
        assert reply.headers["retry-after"]


@contextmanager
def frozen(server):
    """Every process of the PostgreSQL server stopped (SIGSTOP), the postmaster first so
    that it starts none; all of them continued at the end, however the test ends."""
    processes = server.processes()
    try:
        for pid in processes:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in reversed(processes):
            os.kill(pid, signal.SIGCONT)


async def test_tables_another_session_locks_are_a_503_within_the_store_timeout(nursery, tiny_path, own_server):
    url = own_server.new_database()
    server = await node(nursery, tiny_path, url)
    path = await stored_response(server)
    with psycopg.connect(url) as locker:  # (in a transaction: the locks are held until it ends)
        locker.execute("LOCK TABLE responses, tasks IN ACCESS EXCLUSIVE MODE")
        await assert_503_within_the_timeout(server, path)
        locker.rollback()
    again = await server.request("GET", path)
    assert again.status == 200


async def test_a_frozen_database_is_a_503_within_the_store_timeout_then_recovers(nursery, tiny_path, own_server):
    server = await node(nursery, tiny_path, own_server.new_database())
    path = await stored_response(server)
    with frozen(own_server):
        await assert_503_within_the_timeout(server, path)
        assert (await server.request("GET", "/lmsp/v1/models")).status == 200  # what needs no database
    # (the calls abandoned to the freeze end now, their connections closed; the next ones connect afresh)
    await wait_until(lambda: _status(server, path, 200), "the stored response served again", every=0.1)
    reply = await server.request("POST", TASKS, json_body=task_body())
    assert reply.status == 202
    await wait_final(server, reply.json()["id"])


async def _status(server, path: str, status: int) -> bool:
    return (await server.request("GET", path)).status == status


async def test_after_a_database_crash_an_event_id_a_follower_saw_means_what_it_saw(nursery, tiny_path, own_server,
                                                                                  monkeypatch):
    """A follower reads a task's first events; the server crashes (`pg_ctl -m immediate`)
    right after; the runner finds no database and stops; the node's recovery ends the task
    `failed` once the server is back. Resuming from its Last-Event-ID, the follower gets
    that `response.failed` under a new id, and the log holds what it saw under the ids it
    saw them (today's code lost them with the crash and wrote the failure under the first)."""
    server = await node(nursery, tiny_path, own_server.new_database())
    gate = gated(server.service.registry.get("tiny:chat-q8_0").model, monkeypatch)
    gate.allow(3)
    task = await create(server, task_body(max_output_tokens=400))
    seen = {}
    with trio.fail_after(60):
        async with server.connection() as client:
            events = follow(client, task["id"])
            while sum(event == "response.output_text.delta" for event, _ in seen.values()) < 3:
                event = await events.__anext__()
                if event is not None:
                    seen[event.id] = (event.event, event.data)
        await trio.to_thread.run_sync(own_server.stop_server)
        gate.allow(math.inf)  # (its next event finds no database: the runner gives up)
        await wait_until(lambda: not server.service.tasks.is_running(task["id"]), "the runner stopped")
        await trio.to_thread.run_sync(own_server.restart_server)
        assert (await wait_final(server, task["id"]))["status"] == "failed"
        resumed = await all_events(server, task["id"], headers={"Last-Event-ID": str(max(seen))})
        log = {event.id: (event.event, event.data) for event in await all_events(server, task["id"])}
    assert [(event.id, event.event) for event in resumed] == [(max(seen) + 1, "response.failed")]
    assert {seq: log.get(seq) for seq in seen} == seen

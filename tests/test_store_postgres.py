"""What is PostgreSQL's own in the store: the schema's version and concurrent
migrations, leases, notices across nodes (LISTEN/NOTIFY), purges one node at a
time, and a database that goes away and comes back (503s, then nothing lost).

Each test has a new database on the session's server (tests/pg_server.py); two
PostgresStores on it are two nodes, and so are two services in one process (the last
tests: what a gate holds still, and a database that goes away under a served node).
"""

import math
import threading

import psycopg
import pytest
import trio

from lmsp_min.problems import Problem
from lmsp_min.store import LoggedEvent, StoreError
from lmsp_min.store.open import open_store
from lmsp_min.store.postgres import MIGRATIONS, PURGE_LOCK, PostgresStore
from server_harness import make_service, start_server, tiny_path  # noqa: F401
from test_store import response_body
from test_tasks import all_events, create, follow, gated, task_body, wait_final
from waiting import wait_until


def sql(url: str, statement: str, params=()) -> list:
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


async def test_the_schema_is_versioned_and_a_newer_one_refused(postgres_url):
    store = await open_store(postgres_url + "&password=hunter2")  # (trust: the password is not asked)
    assert store.location.startswith("PostgreSQL, postgresql://") and "hunter2" not in store.location
    store.close()
    assert sql(postgres_url, "SELECT version FROM lmsp_schema") == [(len(MIGRATIONS),)]
    (await open_store(postgres_url)).close()  # opening again migrates nothing
    sql(postgres_url, "UPDATE lmsp_schema SET version = version + 1")
    with pytest.raises(StoreError, match="newer"):
        await open_store(postgres_url)


def test_nodes_starting_together_migrate_once(postgres_url):
    stores, errors = [], []

    def open_one():
        try:
            stores.append(PostgresStore(postgres_url, lease=10))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and len(stores) == 6
    assert sql(postgres_url, "SELECT version FROM lmsp_schema") == [(len(MIGRATIONS),)]
    assert len(sql(postgres_url, "SELECT owner FROM owners")) == 6
    for store in stores:
        store.close()
    assert sql(postgres_url, "SELECT owner FROM owners") == []  # a clean close gives its lease up


async def test_an_unreachable_database_is_a_clear_error_at_start(postgres_server):
    with pytest.raises(StoreError, match="cannot connect") as caught:
        await open_store(postgres_server.url("no_such_database") + "&password=secret")
    assert "secret" not in str(caught.value)


async def test_only_the_work_of_owners_whose_lease_expired_is_recovered(postgres_url):
    first = await open_store(postgres_url, lease=60)
    second = await open_store(postgres_url, lease=60)
    await first.create_task("task_1", "alice", 0, "tiny:llama", "resp_1", "{}")
    await first.append_events("task_1", [LoggedEvent(1, "response.created", "{}")])
    await first.claim_idempotency_key("alice", "k", "fp")
    assert await second.interrupted_tasks() == []
    assert await second.release_abandoned_keys() == 0
    # the first node stops renewing (killed, or cut off), and its lease runs out
    sql(postgres_url, "UPDATE owners SET lease_until = clock_timestamp() - interval '1 second' WHERE owner = %s",
        (first.owner,))
    [(row, events)] = await second.interrupted_tasks()
    assert row.id == "task_1" and [e.seq for e in events] == [1]
    assert await second.release_abandoned_keys() == 1
    assert await second.finish_task("task_1", "failed", response_body("resp_1", "failed"),
                                    [LoggedEvent(2, "response.failed", "{}")])
    # the first node comes back: its task was ended, and what it appends is refused
    assert not await first.finish_task("task_1", "completed", response_body("resp_1"),
                                       [LoggedEvent(2, "response.completed", "{}")])
    with pytest.raises(Exception, match="ended by another node"):
        await first.append_events("task_1", [LoggedEvent(2, "response.output_text.delta", "{}")])
    assert [e.event for e in await first.read_events("task_1", 0)] == ["response.created", "response.failed"]
    first.close()
    second.close()


async def test_a_node_is_told_of_another_nodes_events_and_cancels(postgres_url):
    runner = await open_store(postgres_url)
    follower = await open_store(postgres_url)
    await runner.create_task("task_1", "alice", 0, "tiny:llama", "resp_1", "{}")
    with follower.watch("task_1") as watch, trio.fail_after(10):
        await runner.append_events("task_1", [LoggedEvent(1, "response.created", "{}")])
        await watch.wait(60)  # (returns at the notice: the test would fail after 10 s)
        assert [e.seq for e in await follower.read_events("task_1", 0)] == [1]
        await runner.append_events("task_1", [LoggedEvent(2, "e", "{}")])
        await watch.wait(60)  # (the notice may come before the wait: it is kept for it)
        assert [e.seq for e in await follower.read_events("task_1", 1)] == [2]
    with trio.fail_after(10):
        await follower.request_cancel("task_1")
        requested = []
        while "task_1" not in requested:  # (the first answer may be the start's look in the database)
            requested = await runner.next_cancel_requests()
    runner.close()
    follower.close()


async def test_purges_run_on_one_node_at_a_time(postgres_url):
    store = await open_store(postgres_url)
    await store.create_task("task_1", "alice", 0, "tiny:llama", "resp_1", "{}")
    await store.finish_task("task_1", "completed", response_body("resp_1"),
                            [LoggedEvent(1, "response.completed", "{}")])
    with psycopg.connect(postgres_url, autocommit=True) as other_node:
        other_node.execute("SELECT pg_advisory_lock(%s)", (PURGE_LOCK,))  # another node is purging
        assert await store.purge(2e9, 0, 0) == 0
        assert len(await store.read_events("task_1", 0)) == 1
        other_node.execute("SELECT pg_advisory_unlock(%s)", (PURGE_LOCK,))
    assert await store.purge(2e9, 0, 0) == 1
    assert (await store.get_task("task_1", None)).events_expired
    store.close()


@pytest.fixture
def own_server(tmp_path):
    """A PostgreSQL server of the test's own, which it stops and starts again."""
    from pg_server import started

    server = started()
    yield server
    server.stop()


async def test_a_lost_database_is_a_503_then_nothing_is_lost(own_server):
    url = own_server.new_database()
    store = await open_store(url)
    await store.put_response("resp_1", "alice", [], response_body("resp_1"))
    await trio.to_thread.run_sync(own_server.stop_server)
    with pytest.raises(Problem) as caught:
        await store.get_response("resp_1", "alice")
    assert caught.value.status == 503 and caught.value.code == "model_unavailable"
    with pytest.raises(Problem):
        await store.put_response("resp_2", "alice", [], response_body("resp_2"))
    await trio.to_thread.run_sync(own_server.restart_server)
    assert (await store.get_response("resp_1", "alice")).body == response_body("resp_1")
    await store.put_response("resp_2", "alice", [], response_body("resp_2"))
    # the listener reconnects too: another node's events wake this one's watches again
    await wait_until(lambda: store._listening, "the listener reconnected", seconds=20)
    other = await open_store(url)
    await other.create_task("task_1", "alice", 0, "tiny:llama", "resp_3", "{}")
    with store.watch("task_1") as watch, trio.fail_after(10):
        await other.append_events("task_1", [LoggedEvent(1, "response.created", "{}")])
        await watch.wait(60)
        assert len(await store.read_events("task_1", 0)) == 1
    other.close()
    store.close()


# What PostgreSQL raises when it cannot extend a table's file: SQLSTATE 53100, disk_full.
_DISK_FULL_ON_INSERT = [
    "CREATE FUNCTION disk_full() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
    " RAISE EXCEPTION 'could not extend file: No space left on device' USING ERRCODE = 'disk_full'; END $$",
    "CREATE TRIGGER disk_full BEFORE INSERT ON responses FOR EACH ROW EXECUTE FUNCTION disk_full()",
]


async def test_a_full_disk_is_a_503_said_once_and_reads_go_on(postgres_url):
    lines = []
    store = await open_store(postgres_url, log=lines.append)
    await store.put_response("resp_1", "alice", [], response_body("resp_1"))
    for statement in _DISK_FULL_ON_INSERT:  # (the error is the server's own, as a full disk's)
        sql(postgres_url, statement)
    for response_id in ("resp_2", "resp_3"):
        with pytest.raises(Problem) as caught:  # (it was psycopg.errors.DiskFull: a 500)
            await store.put_response(response_id, "alice", [], response_body(response_id))
        assert caught.value.status == 503 and ("Retry-After", "30") in caught.value.headers
    assert (await store.get_response("resp_1", "alice")).body == response_body("resp_1")
    assert [line.split(" (")[0] for line in lines] == ["error: the database's disk is full"]
    sql(postgres_url, "DROP TRIGGER disk_full ON responses")  # room again
    await store.put_response("resp_2", "alice", [], response_body("resp_2"))
    assert lines[-1].startswith("the database's disk has room again")
    store.close()


async def test_a_node_whose_lease_ran_out_during_an_outage_keeps_its_tasks(own_server, monkeypatch):
    """The database away stops every node's renewals: the first node back does not fail
    the tasks of a node whose lease ran out meanwhile and which has not renewed it yet."""
    url = own_server.new_database()
    first = await open_store(url, lease=30)
    lost: list[str] = []
    second = await open_store(url, lease=30, log=lost.append)
    await first.create_task("task_1", "alice", 0, "tiny:llama", "resp_1", "{}")
    await wait_until(lambda: first._listening and second._listening, "both nodes listening")
    renew, renewing = first._renew_lease, threading.Event()

    def held_renewal(conn):  # (the first node, back, has not renewed yet: the race)
        renewing.wait(30)
        renew(conn)

    monkeypatch.setattr(first, "_renew_lease", held_renewal)
    # its last renewal was two thirds of a lease ago: what is left runs out during the outage
    sql(url, "UPDATE owners SET lease_until = clock_timestamp() + interval '0.1 second' WHERE owner = %s",
        (first.owner,))
    await trio.to_thread.run_sync(own_server.stop_server)
    await wait_until(lambda: lost, "the second node saw the database go")
    await trio.to_thread.run_sync(own_server.restart_server)
    expired = "SELECT lease_until < clock_timestamp() FROM owners WHERE owner = %s"
    await wait_until(lambda: sql(url, expired, (first.owner,)) == [(True,)], "the first node's lease ran out")
    assert await second.interrupted_tasks() == []
    renewing.set()
    await wait_until(lambda: sql(url, expired, (first.owner,)) == [(False,)], "renewed", seconds=20)
    assert await second.interrupted_tasks() == []
    assert await first.finish_task("task_1", "completed", response_body("resp_1"),
                                   [LoggedEvent(1, "response.completed", "{}")])
    first.close()
    second.close()


# -- two services in one process, on one database: what a gate can hold still ----------------------


async def test_a_cancel_through_another_node_stops_the_generation_where_it_is(nursery, tiny_path, postgres_url,
                                                                             monkeypatch):
    """Node A's generation is held at a gate after three text events; node B's cancel reaches
    it by NOTIFY and stops it there: the gate never lets another token through, and the
    task ends `cancelled` with exactly the events A had logged."""
    a = await start_server(nursery, await make_service([tiny_path], data_dir=postgres_url))
    b = await start_server(nursery, await make_service([tiny_path], data_dir=postgres_url))
    gate = gated(a.service.registry.get("tiny:chat-q8_0").model, monkeypatch)
    gate.allow(3)
    task = await create(a, task_body(max_output_tokens=400))
    with trio.fail_after(30):
        async with b.connection() as client:
            events = follow(client, task["id"])
            seen = []
            while sum(e.event == "response.output_text.delta" for e in seen) < 3:
                event = await events.__anext__()
                if event is not None:
                    seen.append(event)
            reply = await b.request("POST", f"/lmsp/v1/tasks/{task['id']}/cancel")
            rest = [e async for e in events if e is not None]
    assert reply.status == 200 and reply.json()["status"] == "cancelled"
    assert rest[-1].event == "response.cancelled"
    assert sum(e.event == "response.output_text.delta" for e in seen + rest) == 3  # not one token more
    assert (await a.request("GET", f"/lmsp/v1/tasks/{task['id']}")).json()["status"] == "cancelled"


async def test_a_key_running_on_one_node_is_a_409_on_the_other(nursery, tiny_path, postgres_url, monkeypatch):
    a = await start_server(nursery, await make_service([tiny_path], data_dir=postgres_url))
    b = await start_server(nursery, await make_service([tiny_path], data_dir=postgres_url))
    gate = gated(a.service.registry.get("tiny:chat-q8_0").model, monkeypatch)  # A's response runs until let go
    key = {"Idempotency-Key": "k-1"}
    first = {}

    async def on_a():
        first["reply"] = await a.responses(task_body(), headers=key)

    with trio.fail_after(30):
        async with trio.open_nursery() as requests:
            requests.start_soon(on_a)
            # (until A has claimed the key; its response then waits at the gate)
            await wait_until(lambda: trio.to_thread.run_sync(sql, postgres_url, "SELECT key FROM idempotency"),
                             "A's key claimed", every=0.01)
            reply = await b.responses(task_body(), headers=key)
            assert reply.status == 409 and reply.json()["code"] == "idempotency_conflict"
            gate.allow(math.inf)
    assert first["reply"].status == 200
    replayed = await b.responses(task_body(), headers=key)
    assert replayed.status == 200 and replayed.body == first["reply"].body
    assert replayed.headers["idempotent-replayed"] == "true"


async def test_a_node_stalled_past_its_lease_at_its_tasks_end_publishes_the_end_the_taker_wrote(
        nursery, tiny_path, postgres_url, monkeypatch):
    """A has logged every event of its task but the last when it stalls past its lease (held at
    its final commit here: a frozen VM, a partition). B takes the task over and ends it. A, back,
    must not publish an end of its own, which no database took: its follower gets B's end, from
    the database, and A's log says why."""
    a = await start_server(nursery, await make_service([tiny_path], data_dir=postgres_url, store_lease=1))
    b = await start_server(nursery, await make_service([tiny_path], data_dir=postgres_url, store_lease=1))
    store, finish, stalled, back = a.service.store, a.service.store.finish_task, trio.Event(), trio.Event()

    async def stall_then_finish(*args, **kwargs):
        monkeypatch.setattr(store, "_renew_lease", lambda conn: None)  # (its lease runs out meanwhile)
        stalled.set()
        await back.wait()
        return await finish(*args, **kwargs)

    monkeypatch.setattr(store, "finish_task", stall_then_finish)
    task = await create(a, task_body())
    try:
        with trio.fail_after(30):
            await stalled.wait()
            async with a.connection() as client:
                events = follow(client, task["id"])
                await wait_final(b, task["id"])  # B took it over, and ended it
                back.set()
                seen = [event async for event in events if event is not None]
    finally:
        back.set()  # (A's end is shielded from the test's stop: never leave it stalled)
    replayed = await all_events(b, task["id"])
    assert [(e.id, e.event, e.data) for e in seen] == [(e.id, e.event, e.data) for e in replayed]
    assert any(f"task {task['id']} taken over" in line for line in b.service.log_lines)
    assert any(f"task {task['id']} was taken over by another node" in line for line in a.service.log_lines)


async def test_a_node_without_its_database_answers_503_then_recovers(nursery, tiny_path, own_server):
    server = await start_server(nursery, await make_service([tiny_path], data_dir=own_server.new_database()))
    stored = await server.request("POST", "/lmsp/v1/responses", json_body=task_body(store=True))
    assert stored.status == 200
    path = f"/lmsp/v1/responses/{stored.json()['id']}"
    await trio.to_thread.run_sync(own_server.stop_server)
    for method, target, body in (("GET", path, None), ("POST", "/lmsp/v1/tasks", task_body()),
                                 ("POST", "/lmsp/v1/responses", task_body(store=True))):
        reply = await server.request(method, target, json_body=body)
        assert reply.status == 503 and reply.headers["content-type"] == "application/problem+json", reply.body
        assert reply.json()["code"] == "model_unavailable" and reply.headers["retry-after"]
    # what needs no database is still served
    assert (await server.request("GET", "/lmsp/v1/models")).status == 200
    assert (await server.request("POST", "/lmsp/v1/responses", json_body=task_body())).status == 200
    await trio.to_thread.run_sync(own_server.restart_server)
    again = await server.request("GET", path)
    assert again.status == 200 and again.body == stored.body  # nothing acknowledged was lost
    task = await server.request("POST", "/lmsp/v1/tasks", json_body=task_body())
    assert task.status == 202


async def test_a_database_that_restarts_between_two_requests_costs_none_a_503(own_server):
    """The listener notices the restart and closes the pool's idle connections, which
    the restart broke: the next operation connects afresh."""
    store = await open_store(own_server.new_database())
    await store.put_response("resp_1", "alice", [], response_body("resp_1"))
    with trio.fail_after(30):
        await wait_until(lambda: store._listening, "the listener listening")
        await trio.to_thread.run_sync(own_server.stop_server)
        await wait_until(lambda: not store._listening, "the restart noticed")
        await trio.to_thread.run_sync(own_server.restart_server)
    assert (await store.get_response("resp_1", "alice")).body == response_body("resp_1")
    store.close()

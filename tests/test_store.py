"""The store on its own, on both backends (each test taking `store` or `store_location`):
each operation, principals, expiry; then what is SQLite's own (schema, durability modes,
owners' lock files). tests/test_store_postgres.py has what is PostgreSQL's own."""

import json
import sqlite3
import time

import pytest
import trio

from lmsp_min.problems import Problem
from lmsp_min.store import LoggedEvent, StoreError
from lmsp_min.store.open import open_store
from lmsp_min.store.sqlite import DB_NAME, MIGRATIONS, SQLiteStore


def response_body(response_id: str, status: str = "completed", text: str = "hi") -> str:
    return json.dumps({
        "id": response_id, "object": "response", "created_at": 1794200000,
        "status": status, "model": "tiny:llama",
        "output": [{"id": "msg_1", "type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": text}]}],
        "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4},
        "error": None, "incomplete_details": None,
    }, separators=(",", ":"))


@pytest.fixture
async def store(store_location):
    s = await open_store(store_location)
    yield s
    s.close()


def test_schema_is_versioned_and_wal(tmp_path):
    s = SQLiteStore.open_sync(tmp_path)
    s.close()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    SQLiteStore.open_sync(tmp_path).close()  # opening again migrates nothing and keeps data


async def test_a_later_migration_is_applied_once_and_keeps_the_data(tmp_path, monkeypatch):
    s = await SQLiteStore.open(tmp_path)
    await s.put_response("resp_1", "alice", [], response_body("resp_1"))
    s.close()
    monkeypatch.setattr("lmsp_min.store.sqlite.MIGRATIONS", [*MIGRATIONS, ["ALTER TABLE responses ADD COLUMN note TEXT"]])
    for _ in range(2):  # the second opening finds nothing to do
        s = await SQLiteStore.open(tmp_path)
        assert (await s.get_response("resp_1", "alice")).body == response_body("resp_1")
        s.close()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) + 1
    assert "note" in [row[1] for row in conn.execute("PRAGMA table_info(responses)")]
    conn.close()


def test_newer_schema_is_refused(tmp_path):
    """And leaves no lock file: the connection and the lock file were closed only when the
    half-made Store was garbage-collected, and the lock file stayed on disk."""
    SQLiteStore.open_sync(tmp_path).close()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer"):
        SQLiteStore.open_sync(tmp_path)
    assert list((tmp_path / "owners").iterdir()) == []


def test_a_damaged_database_is_refused_and_leaves_no_lock_file(tmp_path):
    SQLiteStore.open_sync(tmp_path).close()
    (tmp_path / DB_NAME).write_bytes(b"not a database" * 512)
    with pytest.raises(StoreError, match="not a database"):
        SQLiteStore.open_sync(tmp_path)
    assert list((tmp_path / "owners").iterdir()) == []


async def test_no_store_database_lives_in_memory():
    s = await SQLiteStore.open(None)
    assert not s.persistent and s.path is None
    await s.put_response("resp_1", "alice", [], response_body("resp_1"))
    await s.create_task("task_1", "alice", 0, "tiny:llama", "resp_2", "{}")
    await s.append_events("task_1", [LoggedEvent(1, "response.created", "{}")])

    async def read(n):
        assert (await s.get_response("resp_1", "alice")).body == response_body("resp_1")
        assert len(await s.read_events("task_1", 0)) >= 1

    async with trio.open_nursery() as nursery:  # readers and writers share one connection
        for n in range(5):
            nursery.start_soon(read, n)
            nursery.start_soon(s.append_events, "task_1", [LoggedEvent(n + 2, "e", "{}")])
    # no other owner: only our own unfinished task (Tasks knows whether it still runs)
    assert [row.id for row, _ in await s.interrupted_tasks()] == ["task_1"]
    s.close()


async def test_responses_round_trip_exactly_and_per_principal(store):
    body = response_body("resp_1", text="héllo \u2603")
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]}]
    await store.put_response("resp_1", "alice", items, body)
    got = await store.get_response("resp_1", "alice")
    assert got.body == body and got.input == items and got.output[0]["id"] == "msg_1"
    assert await store.get_response("resp_1", "bob") is None
    assert await store.get_response("resp_2", "alice") is None
    assert not await store.delete_response("resp_1", "bob")
    assert await store.delete_response("resp_1", "alice")
    assert await store.get_response("resp_1", "alice") is None
    assert not await store.delete_response("resp_1", "alice")


async def test_data_survives_reopening(store_location):
    s = await open_store(store_location)
    await s.put_response("resp_1", "alice", [], response_body("resp_1"))
    s.close()
    s = await open_store(store_location)
    assert (await s.get_response("resp_1", "alice")).body == response_body("resp_1")
    s.close()


async def test_task_lifecycle_and_event_log(store):
    await store.create_task("task_1", "alice", 1794200000, "tiny:llama", "resp_1", '{"model":"m"}')
    row = await store.get_task("task_1", "alice")
    assert row.object() == {"id": "task_1", "object": "task", "status": "queued",
                            "created_at": 1794200000, "response_id": "resp_1", "response": None}
    assert await store.get_task("task_1", "bob") is None
    assert (await store.get_task("task_1", None)).principal == "alice"
    await store.set_task_status("task_1", "in_progress")
    events = [LoggedEvent(i, "response.output_text.delta", json.dumps({"delta": str(i)}))
              for i in range(1, 6)]
    await store.append_events("task_1", events[:2])
    await store.append_events("task_1", events[2:])
    assert await store.read_events("task_1", 0) == events
    assert await store.read_events("task_1", 3) == events[3:]
    assert await store.read_events("task_1", 1, limit=2) == events[1:3]
    # its owner (this store) is alive: listed as ours, for Tasks to check against what it runs
    assert [(row.id, row.owner) for row, _ in await store.interrupted_tasks()] == [("task_1", store.owner)]

    final = LoggedEvent(6, "response.completed", '{"status":"completed"}')
    body = response_body("resp_1")
    await store.finish_task("task_1", "completed", body, [final], stored=("alice", []))
    row = await store.get_task("task_1", "alice")
    assert row.status == "completed" and row.object()["response"] == json.loads(body)
    assert (await store.read_events("task_1", 5)) == [final]
    assert (await store.get_response("resp_1", "alice")).body == body
    assert await store.interrupted_tasks() == []


async def test_purge_expires_events_of_ended_tasks_only(store):
    for task_id in ("task_old", "task_running"):
        await store.create_task(task_id, "alice", 0, "tiny:llama", "resp_" + task_id, "{}")
        await store.append_events(task_id, [LoggedEvent(1, "response.created", "{}")])
    await store.finish_task("task_old", "completed", response_body("resp_task_old"),
                            [LoggedEvent(2, "response.completed", "{}")])
    assert await store.purge(time.time(), 3600, 86400) == 0  # it ended just now
    assert await store.purge(time.time() + 3601, 3600, 86400) == 1
    assert (await store.get_task("task_old", None)).events_expired
    assert await store.read_events("task_old", 0) == []
    assert len(await store.read_events("task_running", 0)) == 1
    assert not (await store.get_task("task_running", None)).events_expired


async def test_deleting_a_task_and_purging_by_retention(store):
    for n in (1, 2):
        await store.put_response(f"resp_{n}", "alice", [], response_body(f"resp_{n}"))  # created at 1794200000
        await store.create_task(f"task_{n}", "alice", 0, "tiny:llama", f"resp_t{n}", "{}")
        await store.append_events(f"task_{n}", [LoggedEvent(1, "response.created", "{}")])
    await store.create_task("task_running", "alice", 0, "tiny:llama", "resp_r", "{}")
    assert not await store.delete_task("task_1", "alice")  # not final
    for n in (1, 2):
        await store.finish_task(f"task_{n}", "completed", response_body(f"resp_t{n}"),
                                [LoggedEvent(2, "response.completed", "{}")])
    assert not await store.delete_task("task_1", "bob")
    assert await store.delete_task("task_1", "alice")
    assert await store.get_task("task_1", None) is None and await store.read_events("task_1", 0) == []
    assert not await store.delete_task("task_1", "alice")
    assert await store.purge_stored(older_than=1794199999) == (0, 0)  # all younger
    assert await store.purge_stored(older_than=time.time() + 1) == (2, 1)
    assert await store.get_response("resp_1", "alice") is None
    assert await store.get_task("task_2", None) is None and await store.read_events("task_2", 0) == []
    assert (await store.get_task("task_running", None)).status == "queued"  # a running task is never purged


async def test_idempotency_claim_complete_release(store):
    assert await store.claim_idempotency_key("alice", "k", "fp1") is None
    running = await store.claim_idempotency_key("alice", "k", "fp1")
    assert running.state == "running" and running.fingerprint == "fp1"
    assert await store.claim_idempotency_key("bob", "k", "fp1") is None  # keys are per principal
    await store.complete_idempotency_key("alice", "k", status=200,
                                         content_type="application/json", body=b'{"a":1}')
    done = await store.claim_idempotency_key("alice", "k", "fp2")
    assert (done.state, done.status, done.body, done.fingerprint) == ("done", 200, b'{"a":1}', "fp1")
    await store.release_idempotency_key("alice", "k")  # a finished record is never released
    assert (await store.claim_idempotency_key("alice", "k", "fp1")).state == "done"
    await store.release_idempotency_key("bob", "k")
    assert await store.claim_idempotency_key("bob", "k", "fp1") is None
    assert await store.release_abandoned_keys() == 0  # this store is alive
    await store.purge(time.time() + 86401, 3600, 86400)
    assert await store.claim_idempotency_key("alice", "k", "fp1") is None


async def test_concurrent_readers_and_writer(store):
    await store.create_task("task_1", "alice", 0, "tiny:llama", "resp_1", "{}")

    async def write():
        for i in range(1, 201):
            await store.append_events("task_1", [LoggedEvent(i, "e", "{}")])

    async def read():
        last = 0
        while last < 200:
            events = await store.read_events("task_1", last)
            assert [e.seq for e in events] == list(range(last + 1, last + 1 + len(events)))
            last += len(events)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        for _ in range(3):
            nursery.start_soon(read)


async def test_a_database_another_process_holds_locked_is_a_503_within_the_store_timeout(tmp_path):
    store = await SQLiteStore.open(tmp_path, timeout=0.5)
    await store.put_response("resp_1", "alice", [], response_body("resp_1"))
    other = sqlite3.connect(tmp_path / DB_NAME, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # (another process's write, holding the write lock)
    with trio.fail_after(5), pytest.raises(Problem) as caught:
        await store.put_response("resp_2", "alice", [], response_body("resp_2"))
    assert caught.value.status == 503 and caught.value.headers == [("Retry-After", "2")]
    assert (await store.get_response("resp_1", "alice")).body == response_body("resp_1")  # (WAL: reads go on)
    other.execute("ROLLBACK")
    other.close()
    await store.put_response("resp_3", "alice", [], response_body("resp_3"))
    store.close()


def test_an_unusable_data_dir_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="cannot open the database"):
        SQLiteStore.open_sync(tmp_path / "file" / "data")


async def test_only_the_work_of_dead_owners_is_recovered(tmp_path):
    """Two processes share a data directory: neither recovers the other's running
    work while it lives; once one is gone (closed, or killed: its flock is
    dropped either way), the other recovers its tasks and claims."""
    first = await SQLiteStore.open(tmp_path)
    second = await SQLiteStore.open(tmp_path)
    await first.create_task("task_1", "alice", 0, "tiny:llama", "resp_1", "{}")
    await first.claim_idempotency_key("alice", "k", "fp")
    assert await second.interrupted_tasks() == []
    assert await second.release_abandoned_keys() == 0
    first._owner_lock.close()  # what the kernel does when the process dies
    assert [row.id for row, _ in await second.interrupted_tasks()] == ["task_1"]
    assert await second.release_abandoned_keys() == 1
    assert list(second._owners.iterdir()) == [second._owners / f"{second.owner}.lock"]
    first.close()
    second.close()


def test_lock_files_of_dead_owners_are_swept_at_start(tmp_path):
    dead = SQLiteStore.open_sync(tmp_path)
    dead._owner_lock.close()  # killed: its file stays, unlocked
    alive = SQLiteStore.open_sync(tmp_path)
    third = SQLiteStore.open_sync(tmp_path)
    assert sorted(p.stem for p in third._owners.iterdir()) == sorted([alive.owner, third.owner])
    for store in (dead, alive, third):
        store.close()


def test_two_processes_opening_a_new_data_dir_together(tmp_path):
    import threading

    stores, errors = [], []

    def open_one():
        try:
            stores.append(SQLiteStore.open_sync(tmp_path))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(stores) == 4
    for store in stores:
        store.close()

"""The PostgreSQL store (lmsp_min/store/__init__.py's interface): several nodes, one service.

`lmsp-min serve --store postgresql://USER[:PASS]@HOST[:PORT]/DB` on each node:
the nodes share the stored responses, tasks, event logs and idempotency records,
so that a task started on one is followed, resumed and cancelled on another
(docs/scale-out.md). psycopg 3 (the `postgres` extra) is imported only then.

Connections. Each operation runs in a worker thread on a connection of a small
pool (opened when needed, at most POOL_SIZE), in one transaction when it writes.
One more connection, in a thread of its own (the listener), LISTENs and renews
this node's lease. A connection that breaks is closed, never reused; while the
database cannot be reached every operation raises `unavailable()` (a 503
problem document for the request), and the next one after it is back succeeds:
what was committed (everything a client was told of) is in the database.

Live across nodes, without polling. A transaction that appends a task's events
(or ends it) also NOTIFYs `lmsp_events` with the task's id; a cancel NOTIFYs
`lmsp_cancel`. PostgreSQL delivers them at commit to every listening node; the
listener hands each to the trio loop (`run_sync_soon`), which wakes the
followers' `Watch`es of that task, or cancels the task if this node runs it.
While the listener is reconnecting, watches fall back to polling; once it is
back, every watch and the cancel check look again, so nothing sent meanwhile
is missed.

Leases. A node's `owners` row says until when it is alive (`lease_until`, by the
database's clock, so nodes' clocks do not matter); the listener renews it every
third of the lease. Tasks and idempotency claims record their owner; a node
whose lease has expired (killed, or cut off from the database) is gone: another
node's recovery marks its unfinished tasks `failed` with a problem saying so,
and their logged events replay. A node that comes back after that finds its
tasks ended: `finish_task` writes nothing, and an event it appends after the
other node's final one collides with it (the key is (task_id, seq)).

Durability: commits are synchronous (the database's WAL is flushed) for what a
client is told of; task events and claims commit with `synchronous_commit =
off`, the same promise as SQLite's NORMAL mode: a crash of the database server
(not of a node) can lose the tail of a running task's log, and that task then
fails anyway.

The schema is versioned in `lmsp_schema`: `MIGRATIONS[i]` takes it from version
i to i + 1. Nodes starting together migrate one at a time (an advisory lock
around the migration, in one transaction: PostgreSQL's DDL is transactional).
Event retention purges run on one node at a time (another advisory lock).
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import psycopg
import trio

from lmsp_min.store import (FINAL_STATUSES, POLL_INTERVAL, IdempotencyRecord, LoggedEvent, Store, StoredResponse,
                            StoreError, TaskRow, Watch, unavailable)

POOL_SIZE = 4
# Advisory lock keys ('lmsp' and a number), held for one transaction each.
MIGRATION_LOCK = 0x6C6D7370_0001
PURGE_LOCK = 0x6C6D7370_0002
EVENTS_CHANNEL = "lmsp_events"
CANCEL_CHANNEL = "lmsp_cancel"
# libpq: how long a connection waits to be made, and how long a request may stay unanswered
# by the network (a partition) before the connection counts as broken.
CONNECT_OPTIONS = {"connect_timeout": 5, "tcp_user_timeout": 5000, "keepalives": 1, "keepalives_idle": 5,
                   "keepalives_interval": 2, "keepalives_count": 2, "application_name": "lmsp-min"}

MIGRATIONS: list[list[str]] = [
    # version 1: the tables of the SQLite store (lmsp_min/store/sqlite.py says what each
    # column holds), and the owners' leases
    [
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            principal TEXT NOT NULL,
            created_at BIGINT NOT NULL,
            model TEXT NOT NULL,
            status TEXT NOT NULL,
            input TEXT NOT NULL,
            body TEXT NOT NULL
        )""",
        "CREATE INDEX responses_by_age ON responses (created_at)",
        """CREATE TABLE tasks (
            id TEXT PRIMARY KEY,
            principal TEXT NOT NULL,
            owner TEXT NOT NULL,
            created_at BIGINT NOT NULL,
            model TEXT NOT NULL,
            response_id TEXT NOT NULL,
            status TEXT NOT NULL,
            request TEXT NOT NULL,
            response TEXT,
            ended_at DOUBLE PRECISION,
            events_expired BOOLEAN NOT NULL DEFAULT FALSE,
            cancel_requested BOOLEAN NOT NULL DEFAULT FALSE
        )""",
        "CREATE INDEX tasks_unfinished ON tasks (owner) WHERE status IN ('queued', 'in_progress')",
        "CREATE INDEX tasks_by_end ON tasks (ended_at) WHERE NOT events_expired",
        "CREATE INDEX tasks_by_response ON tasks (response_id)",
        "CREATE INDEX tasks_by_ended ON tasks (ended_at) WHERE ended_at IS NOT NULL",
        """CREATE TABLE task_events (
            task_id TEXT NOT NULL,
            seq INTEGER NOT NULL,
            event TEXT NOT NULL,
            data TEXT NOT NULL,
            time DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (task_id, seq)
        )""",
        """CREATE TABLE idempotency (
            principal TEXT NOT NULL,
            key TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            state TEXT NOT NULL,
            owner TEXT NOT NULL,
            status INTEGER,
            content_type TEXT,
            body BYTEA,
            task_id TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (principal, key)
        )""",
        "CREATE INDEX idempotency_by_age ON idempotency (created_at)",
        # A node (a Store) is alive until `lease_until`; no row: gone.
        """CREATE TABLE owners (
            owner TEXT PRIMARY KEY,
            lease_until TIMESTAMPTZ NOT NULL
        )""",
    ],
]

# An owner is gone when it holds no lease that is still running.
_GONE = ("NOT EXISTS (SELECT 1 FROM owners o WHERE o.owner = {0}.owner"
         " AND o.lease_until > clock_timestamp())")


def describe(url: str) -> str:
    """The database a URL names, for messages (never its password)."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.Error:
        return "the --store URL (which cannot be parsed)"
    return f"postgresql://{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"


class LeaseLost(RuntimeError):
    """This node's lease expired while it ran a task, and another node ended the task."""


class _NotifiedWatch(Watch):
    def __init__(self, store: "PostgresStore"):
        self._store = store
        self._changed = trio.Event()

    def notify(self) -> None:
        self._changed.set()

    async def wait(self, timeout: float) -> None:
        if not self._store._listening:  # (reconnecting: no notice can come)
            timeout = min(timeout, POLL_INTERVAL)
        with trio.move_on_after(max(0.0, timeout)):
            await self._changed.wait()
        self._changed = trio.Event()


class PostgresStore(Store):
    """The PostgreSQL database. Build it with `await PostgresStore.open(url, lease=...)`."""

    def __init__(self, url: str, lease: float, log: Callable[[str], None] | None = None):
        self.url = url
        self.owner = os.urandom(8).hex()
        self.lease = lease
        self.liveness_period = lease
        self._log = log or (lambda line: None)
        self._idle: list[psycopg.Connection] = []
        self._limiter = trio.CapacityLimiter(POOL_SIZE)
        self._claims_held: set[tuple[str, str]] = set()  # (see SQLiteStore)
        self._watches: dict[str, set[_NotifiedWatch]] = {}
        self._cancels_named: set[str] = set()
        self._cancels_unknown = True  # look in the database (at start, after a reconnection)
        self._cancel_notice = trio.Event()
        self._listening = False
        self._stopping = threading.Event()
        self._listener: threading.Thread | None = None
        self._token = None
        try:
            conn = self._connect()
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to {describe(url)}: {str(exc).strip()}") from None
        try:
            _migrate(conn)
            _renew_lease(conn, self.owner, lease)
        except BaseException:
            conn.close()
            raise
        self._idle.append(conn)

    @classmethod
    async def open(cls, url: str, *, lease: float = 10.0, log=None) -> "PostgresStore":
        store = await trio.to_thread.run_sync(cls, url, lease, log)
        store._token = trio.lowlevel.current_trio_token()
        store._listener = threading.Thread(target=store._listen, name="lmsp-min store listener", daemon=True)
        store._listener.start()
        return store

    @property
    def location(self) -> str:
        return f"PostgreSQL, {describe(self.url)}, lease {self.lease:g} s"

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(self.url, autocommit=True, **CONNECT_OPTIONS)

    def close(self) -> None:
        """Stop listening, give up the lease (the other nodes recover at once whatever this
        node could not end), close the connections."""
        self._stopping.set()
        conn = self._idle.pop() if self._idle else None
        try:
            if conn is None:
                conn = self._connect()
            conn.execute("SELECT pg_notify(%s, '')", (self._wake_channel,))
            conn.execute("DELETE FROM owners WHERE owner = %s", (self.owner,))
        except psycopg.Error:
            pass  # (the database is gone: the lease expires by itself)
        finally:
            if conn is not None:
                conn.close()
        if self._listener is not None:
            self._listener.join(timeout=10)
        self._close_idle()

    @property
    def _wake_channel(self) -> str:
        return f"lmsp_wake_{self.owner}"

    # -- running statements in worker threads ---------------------------------------

    async def _write(self, fn: Callable[..., Any], *args: Any, durable: bool = True) -> Any:
        """`fn(conn, *args)` in one transaction, in a worker thread; `durable=False`
        commits without waiting for the WAL flush."""
        return await trio.to_thread.run_sync(self._in_thread, fn, args, True, durable, limiter=self._limiter)

    async def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(self._in_thread, fn, args, False, True, limiter=self._limiter)

    def _in_thread(self, fn: Callable[..., Any], args: tuple, transaction: bool, durable: bool) -> Any:
        try:
            conn = self._idle.pop()
        except IndexError:  # (none idle: the limiter keeps the pool at POOL_SIZE)
            try:
                conn = self._connect()
            except psycopg.OperationalError as exc:
                raise unavailable() from exc
        try:
            if not transaction:
                return fn(conn, *args)
            with conn.transaction():
                if not durable:
                    conn.execute("SET LOCAL synchronous_commit = off")
                return fn(conn, *args)
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise unavailable() from exc
            raise
        finally:
            if conn.broken or conn.closed:
                conn.close()
            else:
                self._idle.append(conn)

    # -- the listener (its own thread and connection) -------------------------------

    def _listen(self) -> None:
        """LISTEN, renew the lease, hand notices to the trio loop; reconnect when the
        connection breaks (every watch then looks again), until `close`."""
        pause = 0.1
        while not self._stopping.is_set():
            conn = None
            try:
                conn = self._connect()
                for channel in (EVENTS_CHANNEL, CANCEL_CHANNEL, self._wake_channel):
                    conn.execute(f'LISTEN "{channel}"')
                _renew_lease(conn, self.owner, self.lease)
                renew_at = time.monotonic() + self.lease / 3
                self._listening = True
                self._to_trio(self._look_again)
                pause = 0.1
                while not self._stopping.is_set():
                    wait = min(1.0, max(0.0, renew_at - time.monotonic()))
                    for notice in conn.notifies(timeout=wait, stop_after=1):
                        self._to_trio(self._notice, notice.channel, notice.payload)
                    if time.monotonic() >= renew_at:
                        _renew_lease(conn, self.owner, self.lease)
                        renew_at = time.monotonic() + self.lease / 3
            except Exception as exc:  # the database is unreachable, or restarting
                if self._listening:
                    self._log(f"error: the store's database connection was lost ({type(exc).__name__}); "
                              "reconnecting")
                    self._listening = False
                    self._to_trio(self._look_again)  # (watches poll meanwhile)
                    self._close_idle()  # (broken too, most likely: the next operations connect afresh)
                self._stopping.wait(pause)
                pause = min(2 * pause, 2.0)
            finally:
                if conn is not None:
                    conn.close()
        self._listening = False

    def _close_idle(self) -> None:
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                return
            conn.close()

    def _to_trio(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    def _notice(self, channel: str, payload: str) -> None:
        """(in the trio loop) A NOTIFY of another node, or of this one."""
        if channel == EVENTS_CHANNEL:
            for watch in self._watches.get(payload, ()):
                watch.notify()
        elif channel == CANCEL_CHANNEL:
            self._cancels_named.add(payload)
            self._cancel_notice.set()

    def _look_again(self) -> None:
        """(in the trio loop) Notices may have been missed: every watch and the cancel
        check read the database again."""
        for watches in self._watches.values():
            for watch in watches:
                watch.notify()
        self._cancels_unknown = True
        self._cancel_notice.set()

    @contextmanager
    def watch(self, task_id: str) -> Iterator[Watch]:
        watch = _NotifiedWatch(self)
        self._watches.setdefault(task_id, set()).add(watch)
        try:
            yield watch
        finally:
            watches = self._watches[task_id]
            watches.discard(watch)
            if not watches:
                del self._watches[task_id]

    async def next_cancel_requests(self, running: Callable[[], bool] = lambda: True) -> list[str]:
        await self._cancel_notice.wait()  # (told by NOTIFY: nothing to poll, idle or not)
        self._cancel_notice = trio.Event()
        named, self._cancels_named = self._cancels_named, set()
        if self._cancels_unknown:
            self._cancels_unknown = False
            try:
                return await self.cancel_requests()
            except BaseException:  # (the database is away: look again on the next call)
                self._cancels_unknown = True
                self._cancel_notice.set()
                raise
        return list(named)

    # -- stored responses -----------------------------------------------------------

    async def put_response(self, response_id: str, principal: str, input_items: list, body: str) -> None:
        response = json.loads(body)
        await self._write(_insert_response, response_id, principal, response["created_at"], response["model"],
                          response["status"], json.dumps(input_items), body)

    async def get_response(self, response_id: str, principal: str) -> StoredResponse | None:
        row = await self._read(lambda conn: conn.execute(
            "SELECT id, principal, input, body FROM responses WHERE id = %s AND principal = %s",
            (response_id, principal)).fetchone())
        return None if row is None else StoredResponse(row[0], row[1], json.loads(row[2]), row[3])

    async def delete_response(self, response_id: str, principal: str) -> bool:
        return await self._write(lambda conn: conn.execute(
            "DELETE FROM responses WHERE id = %s AND principal = %s", (response_id, principal)).rowcount == 1)

    # -- tasks ----------------------------------------------------------------------

    async def create_task(self, task_id: str, principal: str, created_at: int, model: str,
                          response_id: str, request: str) -> None:
        await self._write(lambda conn: conn.execute(
            "INSERT INTO tasks (id, principal, owner, created_at, model, response_id, status, request)"
            " VALUES (%s, %s, %s, %s, %s, %s, 'queued', %s)",
            (task_id, principal, self.owner, created_at, model, response_id, request)))

    async def set_task_status(self, task_id: str, status: str) -> None:
        await self._write(lambda conn: conn.execute(
            "UPDATE tasks SET status = %s WHERE id = %s", (status, task_id)), durable=False)

    async def append_events(self, task_id: str, events: list[LoggedEvent]) -> None:
        def append(conn: psycopg.Connection) -> None:
            try:
                _insert_events(conn, task_id, events, time.time())
            except psycopg.errors.UniqueViolation:  # after the final event another node wrote
                raise LeaseLost(f"task {task_id} was ended by another node (this node's lease expired)") from None
            conn.execute("SELECT pg_notify(%s, %s)", (EVENTS_CHANNEL, task_id))

        await self._write(append, durable=False)

    async def finish_task(self, task_id: str, status: str, response: str, final_events: list[LoggedEvent],
                          stored: tuple[str, list] | None = None) -> bool:
        assert status in FINAL_STATUSES, status

        def finish(conn: psycopg.Connection) -> bool:
            (current,) = conn.execute("SELECT status FROM tasks WHERE id = %s FOR UPDATE", (task_id,)).fetchone()
            if current in FINAL_STATUSES:
                return False
            now = time.time()
            _insert_events(conn, task_id, final_events, now)
            conn.execute("UPDATE tasks SET status = %s, response = %s, ended_at = %s WHERE id = %s",
                         (status, response, now, task_id))
            if stored is not None:
                body = json.loads(response)
                _insert_response(conn, body["id"], stored[0], body["created_at"], body["model"], body["status"],
                                 json.dumps(stored[1]), response)
            conn.execute("SELECT pg_notify(%s, %s)", (EVENTS_CHANNEL, task_id))
            return True

        return await self._write(finish)

    async def get_task(self, task_id: str, principal: str | None) -> TaskRow | None:
        return await self._read(_select_task, task_id, principal)

    async def get_task_of_response(self, response_id: str, principal: str) -> TaskRow | None:
        def select(conn: psycopg.Connection) -> TaskRow | None:
            row = conn.execute("SELECT id FROM tasks WHERE response_id = %s AND principal = %s",
                               (response_id, principal)).fetchone()
            return None if row is None else _select_task(conn, row[0], principal)

        return await self._read(select)

    async def read_events(self, task_id: str, after: int, limit: int | None = None) -> list[LoggedEvent]:
        rows = await self._read(lambda conn: conn.execute(
            "SELECT seq, event, data FROM task_events WHERE task_id = %s AND seq > %s ORDER BY seq LIMIT %s",
            (task_id, after, limit)).fetchall())
        return [LoggedEvent(*row) for row in rows]

    async def request_cancel(self, task_id: str) -> None:
        def request(conn: psycopg.Connection) -> None:
            conn.execute("UPDATE tasks SET cancel_requested = TRUE WHERE id = %s", (task_id,))
            conn.execute("SELECT pg_notify(%s, %s)", (CANCEL_CHANNEL, task_id))

        await self._write(request, durable=False)

    async def cancel_requests(self) -> list[str]:
        rows = await self._read(lambda conn: conn.execute(
            "SELECT id FROM tasks WHERE owner = %s AND cancel_requested AND status IN ('queued', 'in_progress')",
            (self.owner,)).fetchall())
        return [task_id for (task_id,) in rows]

    async def interrupted_tasks(self, running: Callable[[str], bool] = lambda task_id: False
                                ) -> list[tuple[TaskRow, list[LoggedEvent]]]:
        def select(conn: psycopg.Connection) -> list[tuple[TaskRow, list[LoggedEvent]]]:
            rows = conn.execute(
                "SELECT id, owner FROM tasks t WHERE status IN ('queued', 'in_progress')"
                f" AND (owner = %s OR {_GONE.format('t')}) ORDER BY created_at", (self.owner,)).fetchall()
            result = []
            for task_id in [task_id for task_id, owner in rows if owner != self.owner or not running(task_id)]:
                events = conn.execute("SELECT seq, event, data FROM task_events WHERE task_id = %s ORDER BY seq",
                                      (task_id,)).fetchall()
                result.append((_select_task(conn, task_id, None), [LoggedEvent(*e) for e in events]))
            return result

        return await self._read(select)

    async def delete_task(self, task_id: str, principal: str) -> bool:
        def delete(conn: psycopg.Connection) -> bool:
            deleted = conn.execute("DELETE FROM tasks WHERE id = %s AND principal = %s AND status = ANY(%s)",
                                   (task_id, principal, list(FINAL_STATUSES))).rowcount == 1
            if deleted:
                conn.execute("DELETE FROM task_events WHERE task_id = %s", (task_id,))
            return deleted

        return await self._write(delete)

    # -- expiry ---------------------------------------------------------------------

    async def purge_stored(self, older_than: float) -> tuple[int, int]:
        """As the interface says, by one node at a time (else (0, 0), as `purge`)."""
        def purge(conn: psycopg.Connection) -> tuple[int, int]:
            if not conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (PURGE_LOCK,)).fetchone()[0]:
                return 0, 0
            responses = conn.execute("DELETE FROM responses WHERE created_at <= %s", (older_than,)).rowcount
            ended = [task_id for (task_id,) in conn.execute(
                "DELETE FROM tasks WHERE ended_at IS NOT NULL AND ended_at <= %s AND status = ANY(%s) RETURNING id",
                (older_than, list(FINAL_STATUSES)))]
            conn.execute("DELETE FROM task_events WHERE task_id = ANY(%s)", (ended,))
            return responses, len(ended)

        return await self._write(purge)

    async def purge(self, now: float, event_retention: float, idempotency_ttl: float) -> int:
        """As the interface says, by one node at a time: a node that finds another
        purging leaves it to that one (and returns 0)."""
        def purge(conn: psycopg.Connection) -> int:
            if not conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (PURGE_LOCK,)).fetchone()[0]:
                return 0
            expired = [task_id for (task_id,) in conn.execute(
                "UPDATE tasks SET events_expired = TRUE WHERE NOT events_expired AND ended_at IS NOT NULL"
                " AND ended_at <= %s RETURNING id", (now - event_retention,))]
            conn.execute("DELETE FROM task_events WHERE task_id = ANY(%s)", (expired,))
            conn.execute("DELETE FROM idempotency WHERE state = 'done' AND created_at <= %s",
                         (now - idempotency_ttl,))
            conn.execute("DELETE FROM owners WHERE lease_until < clock_timestamp()")  # (no row: gone too)
            return len(expired)

        return await self._write(purge)

    # -- idempotency ----------------------------------------------------------------

    async def claim_idempotency_key(self, principal: str, key: str, fingerprint: str) -> IdempotencyRecord | None:
        select = ("SELECT fingerprint, state, status, content_type, body, task_id FROM idempotency"
                  " WHERE principal = %s AND key = %s")

        def claim(conn: psycopg.Connection) -> IdempotencyRecord | None:
            row = conn.execute(select, (principal, key)).fetchone()
            if row is None:
                # Two nodes claiming together: the second waits for the first's commit, then
                # inserts nothing, and reads the first's claim.
                inserted = conn.execute(
                    "INSERT INTO idempotency (principal, key, fingerprint, state, owner, created_at)"
                    " VALUES (%s, %s, %s, 'running', %s, %s) ON CONFLICT DO NOTHING",
                    (principal, key, fingerprint, self.owner, time.time())).rowcount
                if inserted:
                    self._claims_held.add((principal, key))
                    return None
                row = conn.execute(select, (principal, key)).fetchone()
            status, content_type, body = row[2], row[3], row[4]
            return IdempotencyRecord(row[0], row[1], status, content_type,
                                     bytes(body) if body is not None else None, row[5])

        return await self._write(claim, durable=False)

    async def complete_idempotency_key(self, principal: str, key: str, *, status: int,
                                       content_type: str | None = None, body: bytes | None = None,
                                       task_id: str | None = None) -> None:
        try:
            await self._write(lambda conn: conn.execute(
                "UPDATE idempotency SET state = 'done', status = %s, content_type = %s, body = %s, task_id = %s"
                " WHERE principal = %s AND key = %s", (status, content_type, body, task_id, principal, key)))
        finally:
            self._claims_held.discard((principal, key))

    async def release_idempotency_key(self, principal: str, key: str) -> None:
        try:
            await self._write(lambda conn: conn.execute(
                "DELETE FROM idempotency WHERE principal = %s AND key = %s AND state = 'running'",
                (principal, key)), durable=False)
        finally:
            self._claims_held.discard((principal, key))

    async def release_abandoned_keys(self) -> int:
        def abandoned(conn: psycopg.Connection) -> list[tuple[str, str, str]]:
            claims = conn.execute(
                f"SELECT principal, key, owner, owner <> %s AND {_GONE.format('i')} FROM idempotency i"
                " WHERE state = 'running'", (self.owner,)).fetchall()
            return [(principal, key, owner) for principal, key, owner, gone in claims
                    if gone or (owner == self.owner and (principal, key) not in self._claims_held)]

        found = await self._read(abandoned)
        if not found:
            return 0

        def release(conn: psycopg.Connection) -> int:
            return sum(conn.execute("DELETE FROM idempotency WHERE principal = %s AND key = %s AND owner = %s"
                                    " AND state = 'running'", claim).rowcount for claim in found)

        return await self._write(release)


def _migrate(conn: psycopg.Connection) -> None:
    """Bring the schema up to date in one transaction, under an advisory lock: nodes
    starting together wait for each other, and the later ones find nothing to do."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS lmsp_schema (version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM lmsp_schema").fetchone()
        if row is None:
            conn.execute("INSERT INTO lmsp_schema (version) VALUES (0)")
        version = 0 if row is None else row[0]
        if version > len(MIGRATIONS):
            raise StoreError(f"the database is at schema version {version}, newer than this lmsp-min "
                             f"understands ({len(MIGRATIONS)}); use a newer lmsp-min or another database")
        for statements in MIGRATIONS[version:]:
            for statement in statements:
                conn.execute(statement)
        conn.execute("UPDATE lmsp_schema SET version = %s", (len(MIGRATIONS),))


def _renew_lease(conn: psycopg.Connection, owner: str, lease: float) -> None:
    conn.execute(
        "INSERT INTO owners (owner, lease_until) VALUES (%s, clock_timestamp() + make_interval(secs => %s))"
        " ON CONFLICT (owner) DO UPDATE SET lease_until = EXCLUDED.lease_until", (owner, lease))


def _insert_response(conn: psycopg.Connection, response_id: str, principal: str, created_at: int, model: str,
                     status: str, input_json: str, body: str) -> None:
    conn.execute("INSERT INTO responses (id, principal, created_at, model, status, input, body)"
                 " VALUES (%s, %s, %s, %s, %s, %s, %s)",
                 (response_id, principal, created_at, model, status, input_json, body))


def _insert_events(conn: psycopg.Connection, task_id: str, events: list[LoggedEvent], now: float) -> None:
    with conn.cursor() as cursor:
        cursor.executemany("INSERT INTO task_events (task_id, seq, event, data, time) VALUES (%s, %s, %s, %s, %s)",
                           [(task_id, e.seq, e.event, e.data, now) for e in events])


def _select_task(conn: psycopg.Connection, task_id: str, principal: str | None) -> TaskRow | None:
    row = conn.execute(
        "SELECT id, principal, owner, created_at, model, response_id, status, request, response, ended_at,"
        " events_expired FROM tasks WHERE id = %s", (task_id,)).fetchone()
    if row is None or (principal is not None and row[1] != principal):
        return None
    return TaskRow(*row)

"""The PostgreSQL store, `--store postgresql://USER[:PASS]@HOST[:PORT]/DB`: several nodes share one
database and act as one service (docs/scale-out.md says what they share; this module, how). The
statements are sql.py's; psycopg 3 (the `postgres` extra) is imported only here.

A pool of POOL_SIZE connections serves the operations' worker threads; one more, in a thread of its
own (the listener), LISTENs and renews this node's lease. Appending a task's events (or ending it)
NOTIFYs `lmsp_events` with its id, a cancel `lmsp_cancel`; the listener hands each notice to the
trio loop, which wakes that task's `Watch`es or looks for cancels (while it reconnects, they poll;
back, all look again).

Leases: a node's `owners` row says until when it is alive (the database's clock), renewed every
third of a lease. Once it expired, another node's recovery claims its unfinished tasks (`claim_task`:
one UPDATE, one winner) and continues them; back, the node finds them another's (`finish_task` writes
nothing, an event it appends is refused: `TaskTakenOver`, or `LeaseLost` after another's end). A
draining node hands its tasks over (`hand_over_task`) and says so on `lmsp_handover`. An
outage stops every renewal at once, so a node back from one judges no other gone for a lease, while
the others (retrying every quarter of a lease) renew theirs: leases run out meanwhile are no deaths.

Durability: what a client is told, and every task event, commits with the WAL flushed (a recovery
after a server crash must not write its `response.failed` under an id a follower saw); claims,
releases, cancels and status changes with `synchronous_commit = off` (a retry or the recovery
redoes them). Migrations and purges run on one node at a time (advisory locks).

Next: lmsp_min/tasks.py, which runs tasks over either store.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager, suppress
from typing import Any, Callable, Iterator

import psycopg
import trio

from lmsp_min.problems import Problem, unavailable
from lmsp_min.store import STORE_TIMEOUT, LoggedEvent, StoreError, TaskTakenOver, Watch
from lmsp_min.store.sql import CANCEL_CHANNEL, EVENTS_CHANNEL, HANDOVER_CHANNEL, Dialect, SQLStore, schema, \
    takeover_columns

POOL_SIZE = 4
# Advisory lock keys ('lmsp' and a number), held for one transaction each.
MIGRATION_LOCK = 0x6C6D7370_0001
PURGE_LOCK = 0x6C6D7370_0002
# libpq: how long a request may stay unanswered by the network (a partition) before the
# connection counts as broken (its other timeouts follow --store-timeout: `_connect`).
CONNECT_OPTIONS = {"tcp_user_timeout": 5000, "keepalives": 1, "keepalives_idle": 5,
                   "keepalives_interval": 2, "keepalives_count": 2, "application_name": "lmsp-min"}

POSTGRES = Dialect(
    bigint="BIGINT", double="DOUBLE PRECISION", blob="BYTEA", boolean="BOOLEAN", true="TRUE", false="FALSE",
    without_rowid="", lock_row=" FOR UPDATE", share_row=" FOR SHARE", notify="SELECT pg_notify(?, ?)",
    version_setup=(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})",  # (the others wait here)
                   "CREATE TABLE IF NOT EXISTS lmsp_schema (version INTEGER NOT NULL)",
                   "INSERT INTO lmsp_schema SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM lmsp_schema)"),
    version="SELECT version FROM lmsp_schema", set_version="UPDATE lmsp_schema SET version = {}")

MIGRATIONS: list[list[str]] = [
    [  # version 1: SQLite's three, and the owners: a node (a Store) is alive until `lease_until`
        *(statement for step in schema(POSTGRES) for statement in step),
        "CREATE INDEX tasks_unfinished ON tasks (owner) WHERE status IN ('queued', 'in_progress')",
        "CREATE INDEX tasks_by_response ON tasks (response_id)",
        "CREATE TABLE owners (owner TEXT PRIMARY KEY, lease_until TIMESTAMPTZ NOT NULL)",
    ],
    takeover_columns(),  # version 2: what a node taking over another's task reads
]


def describe(url: str) -> str:
    """The database a URL names, for messages (never its password)."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.Error:
        return "the --store URL (which cannot be parsed)"
    return f"postgresql://{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"


class LeaseLost(TaskTakenOver):
    """This node's lease expired while it ran a task, and another node ended the task."""


class _Connection(psycopg.Connection):
    """A connection that takes sqlite3's `?` placeholders (psycopg's own are `%s`) and
    has sqlite3's `executemany`: sql.py's statements are written once, for both."""

    def execute(self, query: str, params: Any = None, **kwargs: Any) -> psycopg.Cursor:
        return super().execute(query.replace("?", "%s"), params, **kwargs)

    def executemany(self, query: str, params_seq: list) -> psycopg.Cursor:
        cursor = self.cursor()
        cursor.executemany(query.replace("?", "%s"), params_seq)
        return cursor


class PostgresStore(SQLStore):
    """The PostgreSQL database, which open.py's `open_store` builds in a worker thread."""

    dialect = POSTGRES
    elsewhere = "another database"
    durable_events = True  # (see "Durability" above)
    takes_over = True  # (see "Leases" above)

    def __init__(self, url: str, lease: float, log: Callable[[str], None] | None = None,
                 token: trio.lowlevel.TrioToken | None = None, timeout: float = STORE_TIMEOUT):
        super().__init__(timeout, log)
        self.url = url
        self.lease = self.liveness_period = lease
        self._idle: list[_Connection] = []
        self._write_limiter = self._read_limiter = trio.CapacityLimiter(POOL_SIZE)  # (one pool for both)
        self._watches: dict[str, set[Watch]] = {}
        self._cancel_notice = trio.Event()  # (set: a cancel may have been asked, look)
        self._handover_notice = trio.Event()  # (set: a node handed tasks over, take them)
        self._listening = False
        # (time.monotonic) before it no other node is judged gone: inf while the database is away, then
        # a lease from the listener's return, for the others to renew theirs
        self._judge_from = 0.0
        self._stopping = threading.Event()
        self._wake_channel = f"lmsp_wake_{self.owner}"  # (what `close` tells the listener on)
        self._token = token  # (of the trio loop the listener hands notices to; None: no listener)
        self._listener = threading.Thread(target=self._listen, name="lmsp-min store listener", daemon=True)
        try:
            self._idle.append(self._connect())
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to {describe(url)}: {str(exc).strip()}") from None
        try:
            self._run_in_transaction(self._migrate, (MIGRATIONS,), durable=True)
            self._run_in_transaction(self._renew_lease, (), durable=True)
        except BaseException:
            self._close_idle()
            raise
        if token is not None:
            self._listener.start()

    @property
    def location(self) -> str:
        return f"PostgreSQL, {describe(self.url)}, lease {self.lease:g} s"

    def _connect(self) -> _Connection:
        # --store-timeout: the connect timeout (libpq counts whole seconds, 2 at least), and the server's
        # limits on a statement and on a lock wait (a server that answers nothing: sql.py's `_in_thread`)
        milliseconds = max(1, round(self.timeout * 1000))
        # and on a transaction left open: a node frozen mid-transaction (a stopped process, a stalled VM),
        # which the server's TCP keep-alives cannot tell from a live one, holds a task's row no longer
        options = (f"-c statement_timeout={milliseconds} -c lock_timeout={milliseconds}"
                   f" -c idle_in_transaction_session_timeout={milliseconds}")
        return _Connection.connect(self.url, autocommit=True, connect_timeout=max(2, math.ceil(self.timeout)),
                                   options=options, **CONNECT_OPTIONS)

    def close(self) -> None:
        """Stop listening, give up the lease (the others recover at once what this node left), close."""
        self._stopping.set()
        try:
            self._run_in_transaction(self._give_up_lease, (), durable=True)
        except (psycopg.Error, Problem):
            pass  # (the database is gone: the lease expires by itself)
        if self._listener.is_alive():
            self._listener.join(timeout=10)
        self._close_idle()

    @contextmanager
    def _pooled(self) -> Iterator[_Connection]:
        """An idle connection (or a new one: the limiters keep the pool at POOL_SIZE); what fails on one
        that breaks is a 503. It is closed, as is one whose call outlived its deadline (abandoned)."""
        started = time.monotonic()
        try:
            conn = self._idle.pop()
        except IndexError:
            try:
                conn = self._connect()
            except psycopg.OperationalError as exc:
                raise unavailable() from exc
        try:
            yield conn
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise unavailable() from exc
            raise
        finally:
            if conn.broken or conn.closed or time.monotonic() - started > self.timeout:
                conn.close()
            else:
                self._idle.append(conn)

    def _run_read(self, fn: Callable[..., Any], args: tuple) -> Any:
        with self._pooled() as conn:
            return fn(conn, *args)

    def _run_in_transaction(self, fn: Callable[..., Any], args: tuple, durable: bool) -> Any:
        """`durable=False` commits without waiting for the WAL flush."""
        with self._pooled() as conn, conn.transaction():
            if not durable:
                conn.execute("SET LOCAL synchronous_commit = off")
            return fn(conn, *args)

    def _close_idle(self) -> None:
        while self._idle:
            with suppress(IndexError):  # (a worker thread may take the last one meanwhile)
                self._idle.pop().close()

    def _renew_lease(self, conn: _Connection) -> None:
        conn.execute("INSERT INTO owners (owner, lease_until) VALUES (?, clock_timestamp() + make_interval(secs => ?))"
                     " ON CONFLICT (owner) DO UPDATE SET lease_until = EXCLUDED.lease_until", (self.owner, self.lease))

    def _give_up_lease(self, conn: _Connection) -> None:
        conn.execute("SELECT pg_notify(?, '')", (self._wake_channel,))
        conn.execute("DELETE FROM owners WHERE owner = ?", (self.owner,))

    def _is_disk_full(self, exc: Exception) -> bool:
        return isinstance(exc, psycopg.errors.DiskFull) or super()._is_disk_full(exc)  # (SQLSTATE 53100)

    def _timed_out(self, exc: Exception) -> bool:
        return isinstance(exc, (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable))  # (statement, lock)

    def _gone_among(self, conn: _Connection, owners: set[str]) -> set[str]:
        """Those whose lease expired (or was given up: no row); none for a lease after an outage."""
        if time.monotonic() < self._judge_from:
            return set()
        alive = conn.execute("SELECT owner FROM owners WHERE lease_until > clock_timestamp()").fetchall()
        return owners - {owner for (owner,) in alive}

    def _may_purge(self, conn: _Connection) -> bool:
        """One node at a time (the others leave it to that one), which forgets the expired leases."""
        if not conn.execute("SELECT pg_try_advisory_xact_lock(?)", (PURGE_LOCK,)).fetchone()[0]:
            return False
        conn.execute("DELETE FROM owners WHERE lease_until < clock_timestamp()")
        return True

    async def append_events(self, task_id: str, events: list[LoggedEvent]) -> None:
        try:
            await super().append_events(task_id, events)
        except psycopg.errors.UniqueViolation:  # after the final event another node wrote
            raise LeaseLost(f"task {task_id} was ended by another node (this node's lease expired)") from None

    def _listen(self) -> None:
        """LISTEN, renew the lease, hand notices to the trio loop; reconnect when it breaks, until `close`."""
        pause = 0.1
        while not self._stopping.is_set():
            conn = None
            try:
                conn = self._connect()
                for channel in (EVENTS_CHANNEL, CANCEL_CHANNEL, HANDOVER_CHANNEL, self._wake_channel):
                    conn.execute(f'LISTEN "{channel}"')
                self._renew_lease(conn)
                renew_at = time.monotonic() + self.lease / 3
                if self._judge_from == math.inf:  # (back from an outage: the others renew meanwhile)
                    self._judge_from = time.monotonic() + self.lease
                self._listening = True
                self._to_trio(self._look_again)
                pause = 0.1
                while not self._stopping.is_set():
                    wait = min(1.0, max(0.0, renew_at - time.monotonic()))
                    for notice in conn.notifies(timeout=wait, stop_after=1):
                        self._to_trio(self._notice, notice.channel, notice.payload)
                    if time.monotonic() >= renew_at:
                        self._renew_lease(conn)
                        renew_at = time.monotonic() + self.lease / 3
            except Exception as exc:  # the database is unreachable, or restarting
                if self._listening:
                    self._log(f"error: the store's database connection was lost ({type(exc).__name__}); "
                              "reconnecting")
                    self._listening = False
                    self._judge_from = math.inf
                    self._to_trio(self._look_again)  # (watches poll meanwhile)
                    self._close_idle()  # (broken too, most likely: the next operations connect afresh)
                self._stopping.wait(pause)
                pause = min(2 * pause, 2.0, self.lease / 4)  # (back well within the lease the others grant)
            finally:
                if conn is not None:
                    conn.close()
        self._listening = False

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
            self._cancel_notice.set()
        elif channel == HANDOVER_CHANNEL:
            self._handover_notice.set()

    def _look_again(self) -> None:
        """(in the trio loop) Notices may have been missed: every watch and the cancel check look again."""
        for watches in self._watches.values():
            for watch in watches:
                watch.notify()
        self._cancel_notice.set()

    @contextmanager
    def watch(self, task_id: str) -> Iterator[Watch]:
        watch = Watch(lambda: self._listening)  # (reconnecting: no notice can come, it polls)
        self._watches.setdefault(task_id, set()).add(watch)
        try:
            yield watch
        finally:
            watches = self._watches[task_id]
            watches.discard(watch)
            if not watches:
                del self._watches[task_id]

    @property
    def reachable(self) -> bool:
        return self._listening

    async def wait_for_handover(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            await self._handover_notice.wait()
        self._handover_notice = trio.Event()

    async def next_cancel_requests(self, running: Callable[[], bool] = lambda: True) -> list[str]:
        await self._cancel_notice.wait()  # (told by NOTIFY: nothing to poll, idle or not)
        self._cancel_notice = trio.Event()
        try:
            return await self.cancel_requests()
        except BaseException:  # (the database is away: look again on the next call)
            self._cancel_notice.set()
            raise

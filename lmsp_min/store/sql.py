"""The store's operations, written once in SQL for both backends.

`SQLStore` implements lmsp_min/store/__init__.py's `Store` in statements with sqlite3's `?`
placeholders (PostgreSQL's connections take them too); what the two spell differently its backend's
`Dialect` says. `schema` below is brought up to date by `_migrate` through each backend's
`MIGRATIONS`, which a later release extends.

Next: lmsp_min/store/sqlite.py and lmsp_min/store/postgres.py, the backends.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import trio

from lmsp_min.problems import disk_full, too_slow
from lmsp_min.store import (FINAL_STATUSES, STORE_TIMEOUT, IdempotencyRecord, LoggedEvent, Store, StoredResponse,
                             StoreError, TaskRow, TaskTakenOver)

_FINAL_LIST = ", ".join(f"'{status}'" for status in sorted(FINAL_STATUSES))  # (for SQL's IN)
# What a commit tells the other processes of a task (PostgreSQL's NOTIFY channels).
EVENTS_CHANNEL = "lmsp_events"  # it has new events, or ended
CANCEL_CHANNEL = "lmsp_cancel"  # a cancel was asked
HANDOVER_CHANNEL = "lmsp_handover"  # a draining node handed its tasks over: take them now
# The owner of a task a draining node handed over: no node's, so any other takes it over.
HANDED_OVER = "handed-over"
# The keyword that lets trio stop waiting for a worker thread, which goes on alone: trio 0.23
# renamed it (pyproject allows 0.22).
_ABANDON = ("abandon_on_cancel" if "abandon_on_cancel" in inspect.signature(trio.to_thread.run_sync).parameters
            else "cancellable")


@dataclass(frozen=True)
class Dialect:
    """How one database spells what the statements here need."""

    bigint: str  # the type of an integer wider than 32 bits
    double: str  # of a float
    blob: str  # of bytes
    boolean: str  # of a boolean, whose values are spelt `true` and `false`
    true: str
    false: str
    without_rowid: str  # ends a CREATE TABLE whose rows are kept in its primary key's order
    lock_row: str  # ends a SELECT of the row that its transaction then updates
    share_row: str  # ends a SELECT of a row that must not change until its transaction ends
    notify: str | None  # tells the other processes (channel, task id) at commit; None: they poll
    # The schema's version: read by `version` after `version_setup` (which keeps processes that
    # start together from migrating at once), set by `set_version` (a format string).
    version_setup: tuple[str, ...]
    version: str
    set_version: str


def schema(d: Dialect) -> list[list[str]]:
    """The schema both databases have, in the three steps it grew by (SQLite's versions)."""
    tables = [
        # A stored response: `body` is the response object exactly as it was served (its output, usage,
        # status, error...); `input` the effective input items (previous_response_id's turns included).
        f"""CREATE TABLE responses (
            id TEXT PRIMARY KEY, principal TEXT NOT NULL, created_at {d.bigint} NOT NULL,
            model TEXT NOT NULL, status TEXT NOT NULL, input TEXT NOT NULL, body TEXT NOT NULL
        )""",
        # A task: `owner` the Store (process) running it; `model` the id of the model it runs; `request`
        # the request's parameters (no input: Tasks._start); `response` the final response object once
        # final; `ended_at` starts the event retention clock; `events_expired`: its events were purged.
        f"""CREATE TABLE tasks (
            id TEXT PRIMARY KEY, principal TEXT NOT NULL, owner TEXT NOT NULL, created_at {d.bigint} NOT NULL,
            model TEXT NOT NULL, response_id TEXT NOT NULL, status TEXT NOT NULL, request TEXT NOT NULL,
            response TEXT, ended_at {d.double}, events_expired {d.boolean} NOT NULL DEFAULT {d.false}
        )""",
        f"CREATE INDEX tasks_by_end ON tasks (ended_at) WHERE events_expired = {d.false}",
        # A task's event log: `data` is the event's JSON text exactly as served.
        f"""CREATE TABLE task_events (
            task_id TEXT NOT NULL, seq INTEGER NOT NULL, event TEXT NOT NULL, data TEXT NOT NULL,
            time {d.double} NOT NULL, PRIMARY KEY (task_id, seq)
        ){d.without_rowid}""",
        # An Idempotency-Key: `fingerprint` identifies route + body; while `state` is 'running' (in process
        # `owner`) repeats get 409; once 'done', `status`/`content_type`/`body` are the exact result to
        # replay, or `task_id` the task to return again.
        f"""CREATE TABLE idempotency (
            principal TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL, state TEXT NOT NULL,
            owner TEXT NOT NULL, status INTEGER, content_type TEXT, body {d.blob}, task_id TEXT,
            created_at {d.double} NOT NULL, PRIMARY KEY (principal, key)
        ){d.without_rowid}""",
        "CREATE INDEX idempotency_by_age ON idempotency (created_at)",
    ]
    return [
        tables,
        # a cancel asked of a task that another process (its owner) runs, which looks for these
        [f"ALTER TABLE tasks ADD COLUMN cancel_requested {d.boolean} NOT NULL DEFAULT {d.false}"],
        # what purge_stored looks up: stored responses by age, final tasks by end
        ["CREATE INDEX responses_by_age ON responses (created_at)",
         "CREATE INDEX tasks_by_ended ON tasks (ended_at) WHERE ended_at IS NOT NULL"],
    ]


def takeover_columns() -> list[str]:
    """What another node needs to continue a task (a later step than `schema`'s, in both).

    `tasks.resume`: the request (its input too) and the prompt's token ids, while the task is
    unfinished (cleared when it ends: the row keeps no input after that). `task_events.tokens`:
    the output token ids an event brought, with the sampler's count of random draws after them."""
    return ["ALTER TABLE tasks ADD COLUMN resume TEXT", "ALTER TABLE task_events ADD COLUMN tokens TEXT"]


class SQLStore(Store):
    """`Store` in SQL. A backend adds how a worker thread takes a connection and a transaction (how
    many at once: its limiters), how it knows an owner is gone, and what its errors say."""

    dialect: Dialect
    elsewhere: str  # where to go instead of a database with a newer schema
    damaged: type[Exception] | tuple = ()  # what says a database cannot be read (SQLite's damaged file)
    # Whether a task's events wait for the disk before followers see them: a backend whose crash loses
    # commits that did not would make a recovery write other events under ids a follower holds.
    durable_events: bool
    _write_limiter: trio.CapacityLimiter
    _read_limiter: trio.CapacityLimiter

    def __init__(self, timeout: float = STORE_TIMEOUT, log: Callable[[str], None] | None = None) -> None:
        self.owner = os.urandom(8).hex()
        self.timeout = timeout  # seconds one call may take, its turn for a thread included (--store-timeout)
        self._log = log or (lambda line: None)
        self._disk_is_full = False  # an operation found the disk full (said once, until a write succeeds)
        # (principal, key) of the claims this Store's requests hold now: see release_abandoned_keys
        self._claims_held: set[tuple[str, str]] = set()

    @abstractmethod
    def _run_in_transaction(self, fn: Callable[..., Any], args: tuple, durable: bool) -> Any:
        """(In a worker thread) `fn(conn, *args)` in one transaction; durable=False: not waiting for the disk."""

    @abstractmethod
    def _run_read(self, fn: Callable[..., Any], args: tuple) -> Any:
        """`fn(conn, *args)` on a connection that reads."""

    @abstractmethod
    def _gone_among(self, conn: Any, owners: set[str]) -> set[str]:
        """Those of `owners` (never this Store) whose process is known to be gone."""

    def _may_purge(self, conn: Any) -> bool:
        return True  # (unless the backend's processes purge in turn)

    def _is_disk_full(self, exc: Exception) -> bool:
        """Whether `exc` says the disk is full: ENOSPC (or a quota's EDQUOT), or the backend's own word."""
        return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)

    def _timed_out(self, exc: Exception) -> bool:
        """Whether `exc` says the database's own deadline passed (a lock held too long, say)."""
        return False

    async def _write(self, fn: Callable[..., Any], *args: Any, durable: bool = True) -> Any:
        result = await self._in_thread(self._run_in_transaction, (fn, args, durable), self._write_limiter)
        if self._disk_is_full:
            self._disk_is_full = False
            self._log(f"the database's disk has room again ({self.location}): writes go on")
        return result

    async def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._in_thread(self._run_read, (fn, args), self._read_limiter)

    async def _in_thread(self, run: Callable[..., Any], args: tuple, limiter: trio.CapacityLimiter) -> Any:
        """`run(*args)` in a worker thread, waited for `timeout` seconds at most, its turn in `limiter`
        included. Past it (or the database's own deadline) the caller gets a 503, and the thread (which
        nothing can stop) ends by itself, keeping its place in `limiter` (and its connection). Shielded
        from the caller's cancellation: a caller that gets the result of a write acts on it (the runner
        publishes the events it committed). A full disk (a read may need room too: PostgreSQL's sorts)
        is `disk_full()`, logged once, not a traceback per request."""
        with trio.move_on_after(self.timeout) as deadline:
            deadline.shield = True
            try:
                return await trio.to_thread.run_sync(run, *args, limiter=limiter, **{_ABANDON: True})
            except Exception as exc:
                if self._timed_out(exc):
                    raise too_slow(self.timeout) from exc
                if not self._is_disk_full(exc):
                    raise
                if not self._disk_is_full:
                    self._disk_is_full = True
                    self._log(f"error: the database's disk is full ({self.location}): writes get 503 until there "
                              f"is room, reads go on ({type(exc).__name__}: {exc})")
                raise disk_full() from exc
        raise too_slow(self.timeout)

    def _notify(self, conn: Any, channel: str, task_id: str) -> None:
        if self.dialect.notify is not None:
            conn.execute(self.dialect.notify, (channel, task_id))

    def _migrate(self, conn: Any, migrations: list[list[str]]) -> None:
        """Bring the schema up to date in `conn`'s transaction (DDL is transactional in both)."""
        for statement in self.dialect.version_setup:
            conn.execute(statement)
        (version,) = conn.execute(self.dialect.version).fetchone()
        if version > len(migrations):
            raise StoreError(f"the database is at schema version {version}, newer than this lmsp-min "
                             f"understands ({len(migrations)}); use a newer lmsp-min or {self.elsewhere}")
        if version < len(migrations):
            for statements in migrations[version:]:
                for statement in statements:
                    conn.execute(statement)
            conn.execute(self.dialect.set_version.format(len(migrations)))

    async def put_response(self, response_id: str, principal: str, input_items: list, body: str) -> None:
        await self._write(_insert_response, response_id, principal, input_items, body)

    async def get_response(self, response_id: str, principal: str) -> StoredResponse | None:
        row = await self._read(lambda conn: conn.execute(
            "SELECT id, principal, input, body FROM responses WHERE id = ? AND principal = ?",
            (response_id, principal)).fetchone())
        return None if row is None else StoredResponse(row[0], row[1], json.loads(row[2]), row[3])

    async def delete_response(self, response_id: str, principal: str) -> bool:
        return await self._write(lambda conn: conn.execute(
            "DELETE FROM responses WHERE id = ? AND principal = ?", (response_id, principal)).rowcount == 1)

    async def create_task(self, task_id: str, principal: str, created_at: int, model: str,
                          response_id: str, request: str, resume: str | None = None) -> None:
        await self._write(lambda conn: conn.execute(
            "INSERT INTO tasks (id, principal, owner, created_at, model, response_id, status, request, resume)"
            " VALUES (?, ?, ?, ?, ?, ?, 'queued', ?, ?)",
            (task_id, principal, self.owner, created_at, model, response_id, request, resume)))

    async def set_task_status(self, task_id: str, status: str) -> None:
        await self._write(lambda conn: conn.execute(
            "UPDATE tasks SET status = ? WHERE id = ?", (status, task_id)), durable=False)

    async def append_events(self, task_id: str, events: list[LoggedEvent]) -> None:
        def append(conn: Any) -> None:
            # (the row held until the commit: a takeover waits for these events, or they for it)
            row = conn.execute(f"SELECT owner FROM tasks WHERE id = ?{self.dialect.share_row}", (task_id,)).fetchone()
            if row is None or row[0] != self.owner:
                raise TaskTakenOver(f"task {task_id} was taken over by another node (this node's lease expired)")
            _insert_events(conn, task_id, events, time.time())
            self._notify(conn, EVENTS_CHANNEL, task_id)

        await self._write(append, durable=self.durable_events)

    async def finish_task(self, task_id: str, status: str, response: str, final_events: list[LoggedEvent],
                          stored: tuple[str, list] | None = None) -> bool:
        assert status in FINAL_STATUSES, status

        def finish(conn: Any) -> bool:
            # (the row locked: of two processes ending it together, the second sees it final)
            current, owner = conn.execute(f"SELECT status, owner FROM tasks WHERE id = ?{self.dialect.lock_row}",
                                          (task_id,)).fetchone()
            # (ended by its owner, or by anyone once its owner is gone: never under a living node that
            # took it over)
            if current in FINAL_STATUSES or (owner != self.owner and not self._gone_among(conn, {owner})):
                return False
            now = time.time()
            _insert_events(conn, task_id, final_events, now)
            conn.execute("UPDATE tasks SET status = ?, response = ?, ended_at = ?, resume = NULL WHERE id = ?",
                         (status, response, now, task_id))
            if stored is not None:
                _insert_response(conn, json.loads(response)["id"], *stored, response)
            self._notify(conn, EVENTS_CHANNEL, task_id)
            return True

        return await self._write(finish)

    async def get_task(self, task_id: str, principal: str | None) -> TaskRow | None:
        return await self._read(_select_task, task_id, principal)

    async def get_task_of_response(self, response_id: str, principal: str) -> TaskRow | None:
        return await self._read(_select_task, response_id, principal, "response_id")

    async def read_events(self, task_id: str, after: int, limit: int | None = None) -> list[LoggedEvent]:
        return await self._read(_select_events, task_id, after, limit)

    async def request_cancel(self, task_id: str) -> None:
        def request(conn: Any) -> None:
            conn.execute(f"UPDATE tasks SET cancel_requested = {self.dialect.true} WHERE id = ?", (task_id,))
            self._notify(conn, CANCEL_CHANNEL, task_id)

        await self._write(request, durable=False)

    async def cancel_requests(self) -> list[str]:
        rows = await self._read(lambda conn: conn.execute(
            f"SELECT id FROM tasks WHERE owner = ? AND cancel_requested = {self.dialect.true}"
            " AND status IN ('queued', 'in_progress')", (self.owner,)).fetchall())
        return [task_id for (task_id,) in rows]

    async def interrupted_tasks(self, running: Callable[[str], bool] = lambda task_id: False
                                ) -> list[tuple[TaskRow, list[LoggedEvent]]]:
        def select(conn: Any) -> list[tuple[TaskRow, list[LoggedEvent]]]:
            # oldest first: created_at counts seconds, and a task's id grows with its creation
            rows = conn.execute("SELECT id, owner FROM tasks WHERE status IN ('queued', 'in_progress')"
                                " ORDER BY created_at, id").fetchall()
            ended = self._gone_among(conn, {owner for _, owner in rows} - {self.owner}) | {self.owner}
            return [(_select_task(conn, task_id, None), _select_events(conn, task_id, 0))
                    for task_id, owner in rows if owner in ended and not running(task_id)]

        try:
            return await self._read(select)
        except self.damaged as exc:  # (the first read at start: said as for a database that cannot open)
            raise StoreError(f"the database cannot be read: {exc}") from None

    async def claim_task(self, task_id: str, owner: str) -> tuple[str | None, list[LoggedEvent]] | None:
        def claim(conn: Any) -> tuple[str | None, list[LoggedEvent]] | None:
            # One UPDATE whose condition is checked again on the row once locked: of nodes racing
            # for the task, the first takes it and the others find it theirs no longer.
            if not conn.execute("UPDATE tasks SET owner = ? WHERE id = ? AND owner = ?"
                                " AND status IN ('queued', 'in_progress')", (self.owner, task_id, owner)).rowcount:
                return None
            (resume,) = conn.execute("SELECT resume FROM tasks WHERE id = ?", (task_id,)).fetchone()
            # (read here, after the claim: none can be appended by the old owner any more)
            events = conn.execute("SELECT seq, event, data, tokens FROM task_events WHERE task_id = ? ORDER BY seq",
                                  (task_id,)).fetchall()
            return resume, [LoggedEvent(*row) for row in events]

        return await self._write(claim)

    async def hand_over_task(self, task_id: str) -> bool:
        def hand_over(conn: Any) -> bool:
            handed = conn.execute("UPDATE tasks SET owner = ? WHERE id = ? AND owner = ?"
                                  " AND status IN ('queued', 'in_progress')",
                                  (HANDED_OVER, task_id, self.owner)).rowcount == 1
            self._notify(conn, HANDOVER_CHANNEL, task_id)
            return handed

        return await self._write(hand_over)

    async def delete_task(self, task_id: str, principal: str) -> bool:
        def delete(conn: Any) -> bool:
            deleted = conn.execute(f"DELETE FROM tasks WHERE id = ? AND principal = ? AND status IN ({_FINAL_LIST})",
                                   (task_id, principal)).rowcount == 1
            if deleted:
                conn.execute("DELETE FROM task_events WHERE task_id = ?", (task_id,))
            return deleted

        return await self._write(delete)

    async def purge_stored(self, older_than: float) -> tuple[int, int]:
        def purge(conn: Any) -> tuple[int, int]:
            if not self._may_purge(conn):
                return 0, 0
            responses = conn.execute("DELETE FROM responses WHERE created_at <= ?", (older_than,)).rowcount
            ended = conn.execute(f"SELECT id FROM tasks WHERE ended_at IS NOT NULL AND ended_at <= ?"
                                 f" AND status IN ({_FINAL_LIST})", (older_than,)).fetchall()
            conn.executemany("DELETE FROM task_events WHERE task_id = ?", ended)
            conn.executemany("DELETE FROM tasks WHERE id = ?", ended)
            return responses, len(ended)

        return await self._write(purge)

    async def purge(self, now: float, event_retention: float, idempotency_ttl: float) -> int:
        def purge(conn: Any) -> int:
            if not self._may_purge(conn):
                return 0
            expired = conn.execute(f"SELECT id FROM tasks WHERE events_expired = {self.dialect.false}"
                                   " AND ended_at IS NOT NULL AND ended_at <= ?", (now - event_retention,)).fetchall()
            conn.executemany("DELETE FROM task_events WHERE task_id = ?", expired)
            conn.executemany(f"UPDATE tasks SET events_expired = {self.dialect.true} WHERE id = ?", expired)
            conn.execute("DELETE FROM idempotency WHERE state = 'done' AND created_at <= ?", (now - idempotency_ttl,))
            return len(expired)

        return await self._write(purge)

    async def claim_idempotency_key(self, principal: str, key: str, fingerprint: str) -> IdempotencyRecord | None:
        def claim(conn: Any) -> IdempotencyRecord | None:
            if conn.execute("INSERT INTO idempotency (principal, key, fingerprint, state, owner, created_at)"
                            " VALUES (?, ?, ?, 'running', ?, ?) ON CONFLICT DO NOTHING",
                            (principal, key, fingerprint, self.owner, time.time())).rowcount:
                self._claims_held.add((principal, key))
                return None
            # Claimed before, or by another process just now (PostgreSQL's INSERT waits for
            # that one's commit, then inserts nothing): the record of the request that owns it.
            return IdempotencyRecord(*conn.execute(
                "SELECT fingerprint, state, status, content_type, body, task_id FROM idempotency"
                " WHERE principal = ? AND key = ?", (principal, key)).fetchone())

        # Not fsynced: a claim lost in a power cut only lets the retry run again.
        return await self._write(claim, durable=False)

    async def complete_idempotency_key(self, principal: str, key: str, *, status: int,
                                       content_type: str | None = None, body: bytes | None = None,
                                       task_id: str | None = None) -> None:
        try:
            await self._write(lambda conn: conn.execute(
                "UPDATE idempotency SET state = 'done', status = ?, content_type = ?, body = ?, task_id = ?"
                " WHERE principal = ? AND key = ?", (status, content_type, body, task_id, principal, key)))
        finally:  # done, or (failed) abandoned
            self._claims_held.discard((principal, key))

    async def release_idempotency_key(self, principal: str, key: str) -> None:
        try:
            await self._write(lambda conn: conn.execute(
                "DELETE FROM idempotency WHERE principal = ? AND key = ? AND state = 'running'",
                (principal, key)), durable=False)
        finally:
            self._claims_held.discard((principal, key))

    async def release_abandoned_keys(self) -> int:
        def abandoned(conn: Any) -> list[tuple[str, str, str]]:
            claims = conn.execute("SELECT principal, key, owner FROM idempotency WHERE state = 'running'").fetchall()
            gone = self._gone_among(conn, {owner for _, _, owner in claims} - {self.owner})
            return [(principal, key, owner) for principal, key, owner in claims
                    if owner in gone or (owner == self.owner and (principal, key) not in self._claims_held)]

        found = await self._read(abandoned)
        if not found:
            return 0  # (the usual case: no write, no write lock)
        # (still 'running': a claim of ours found abandoned is never held again, a dead
        # owner stays dead, and one completed meanwhile is 'done')
        return await self._write(lambda conn: conn.executemany(
            "DELETE FROM idempotency WHERE principal = ? AND key = ? AND owner = ? AND state = 'running'",
            found).rowcount)


def _insert_response(conn: Any, response_id: str, principal: str, input_items: list, body: str) -> None:
    response = json.loads(body)
    conn.execute("INSERT INTO responses (id, principal, created_at, model, status, input, body)"
                 " VALUES (?, ?, ?, ?, ?, ?, ?)", (response_id, principal, response["created_at"], response["model"],
                                                   response["status"], json.dumps(input_items), body))


def _insert_events(conn: Any, task_id: str, events: list[LoggedEvent], now: float) -> None:
    conn.executemany("INSERT INTO task_events (task_id, seq, event, data, time, tokens) VALUES (?, ?, ?, ?, ?, ?)",
                     [(task_id, e.seq, e.event, e.data, now, e.tokens) for e in events])


def _select_task(conn: Any, value: str, principal: str | None, column: str = "id") -> TaskRow | None:
    """The task whose `column` (id, or response_id) is `value`, if of `principal` (None: any)."""
    row = conn.execute("SELECT id, principal, owner, created_at, model, response_id, status, request, response,"
                       f" ended_at, events_expired FROM tasks WHERE {column} = ?", (value,)).fetchone()
    if row is None or (principal is not None and row[1] != principal):
        return None
    return TaskRow(*row[:10], bool(row[10]))


def _select_events(conn: Any, task_id: str, after: int, limit: int | None = None) -> list[LoggedEvent]:
    # (all of them: no LIMIT, which SQLite would say with -1 and PostgreSQL with NULL)
    query = "SELECT seq, event, data FROM task_events WHERE task_id = ? AND seq > ? ORDER BY seq"
    rows = conn.execute(query if limit is None else f"{query} LIMIT {int(limit)}", (task_id, after)).fetchall()
    return [LoggedEvent(*row) for row in rows]

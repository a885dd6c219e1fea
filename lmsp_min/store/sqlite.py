"""The embedded store (lmsp_min/store/__init__.py's interface).

One SQLite database (stdlib `sqlite3`) under `--data-dir`, in WAL mode so that
readers never wait for the writer. The trio loop never touches the database:
every call runs in a worker thread. Writes go through ONE connection, used by
one thread at a time (a capacity limiter of 1), so transactions never fight
over the write lock; reads use a small pool of their own connections.

Durability. The promise is: nothing a client was told is stored is ever lost.
- Writes a client is told about (a stored response, a created or finished task,
  an idempotency result) commit with `synchronous=FULL`: the WAL is fsynced
  before the call returns, so they survive a kill -9 and a power cut.
- Task events commit with `synchronous=NORMAL`: the commit is in the WAL file
  (the OS page cache) when the call returns, which survives a kill -9 of the
  service. Only a power cut can lose the tail of a running task's log, and that
  task is then marked failed on restart anyway. The FULL commit that ends a task
  fsyncs the same WAL file, so a finished task's log is as durable as its result.
  This keeps following a task cheap (an fsync is milliseconds; see
  benchmarks/tasks.py) without weakening any promise.

`--no-store` runs the same code on an in-memory database (one connection for
reads and writes): tasks still work, nothing outlives the process, and nothing
is left behind on disk however the process ends.

Owners. Several processes may share a data directory (SQLite allows it), so
"the process that was running this task died" must mean exactly that, not "a
process started". Each Store is an owner with a random id and holds an
exclusive `flock` on its own file `owners/<id>.lock` while it is open; the
kernel drops the lock when the process dies, however it dies (kill -9
included). Tasks and idempotency claims record their owner; at start-up only
those of owners whose lock can be taken are recovered. (Without `fcntl`, on
Windows, every other owner counts as dead: one process per data directory.)

Size. Stored responses and final tasks are deleted once older than the
retention (`purge_stored`, run periodically by tasks.py), and what is stored of
a request is what its answer needs (docs/protocol.md D3, D6). The pages deleted
rows held go to SQLite's freelist, which later writes reuse before the file
grows: the file stays as large as one retention window's data at its fullest.

The schema is versioned with `PRAGMA user_version`: `MIGRATIONS[i]` takes a
database from version i to i + 1, so a later release appends to the list.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Callable

import trio

from lmsp_min.store import (FINAL_STATUSES, IdempotencyRecord, LoggedEvent, Store, StoredResponse, StoreError,
                            TaskRow)

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

DB_NAME = "lmsp-min.sqlite3"
OWNERS_DIR = "owners"

MIGRATIONS: list[list[str]] = [
    # version 1
    [
        # A stored response: `body` is the response object exactly as it was served
        # (its output, usage, status, error and incomplete_details); `input` the
        # effective input items (earlier turns of previous_response_id included).
        """CREATE TABLE responses (
            id TEXT PRIMARY KEY,
            principal TEXT NOT NULL,
            created_at INTEGER NOT NULL,
            model TEXT NOT NULL,
            status TEXT NOT NULL,
            input TEXT NOT NULL,
            body TEXT NOT NULL
        )""",
        # A task: `owner` the Store (process) running it; `model` the id of the
        # model it runs; `request` the request's parameters (tasks.py keeps no
        # input there, see Tasks._start); `response` the final
        # response object once the task is final; `ended_at` starts the event
        # retention clock; `events_expired` is set when its events were purged.
        """CREATE TABLE tasks (
            id TEXT PRIMARY KEY,
            principal TEXT NOT NULL,
            owner TEXT NOT NULL,
            created_at INTEGER NOT NULL,
            model TEXT NOT NULL,
            response_id TEXT NOT NULL,
            status TEXT NOT NULL,
            request TEXT NOT NULL,
            response TEXT,
            ended_at REAL,
            events_expired INTEGER NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX tasks_by_status ON tasks (status)",
        "CREATE INDEX tasks_by_end ON tasks (ended_at) WHERE events_expired = 0",
        # A task's event log: `data` is the event's JSON text exactly as served.
        """CREATE TABLE task_events (
            task_id TEXT NOT NULL,
            seq INTEGER NOT NULL,
            event TEXT NOT NULL,
            data TEXT NOT NULL,
            time REAL NOT NULL,
            PRIMARY KEY (task_id, seq)
        ) WITHOUT ROWID""",
        # An Idempotency-Key: `fingerprint` identifies route + body; while `state` is
        # 'running' (in process `owner`) repeats get 409; once 'done', `status`/`content_type`/`body` are
        # the exact result to replay, or `task_id` the task to return again.
        """CREATE TABLE idempotency (
            principal TEXT NOT NULL,
            key TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            state TEXT NOT NULL,
            owner TEXT NOT NULL,
            status INTEGER,
            content_type TEXT,
            body BLOB,
            task_id TEXT,
            created_at REAL NOT NULL,
            PRIMARY KEY (principal, key)
        ) WITHOUT ROWID""",
        "CREATE INDEX idempotency_by_age ON idempotency (created_at)",
    ],
    # version 2: a cancel asked of a task that another process (its owner) runs;
    # the owner looks for these while it runs tasks
    [
        "ALTER TABLE tasks ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0",
    ],
    # version 3: what purge_stored looks up (stored responses by age, final tasks by end)
    [
        "CREATE INDEX responses_by_age ON responses (created_at)",
        "CREATE INDEX tasks_by_ended ON tasks (ended_at) WHERE ended_at IS NOT NULL",
    ],
]

_FINAL_LIST = ", ".join(f"'{status}'" for status in sorted(FINAL_STATUSES))  # (for SQL's IN)


def _connect(path: str) -> sqlite3.Connection:
    # isolation_level=None: no implicit transactions; we say BEGIN/COMMIT ourselves.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    conn.execute("PRAGMA busy_timeout = 30000")
    return conn


def _use_wal(conn: sqlite3.Connection) -> None:
    """Put the database in WAL mode (nothing to do once it is).

    On a new database opened by several processes at once, two connections switching
    together can deadlock, each holding the shared lock the other's switch waits for:
    SQLite then answers one of them "database is locked" at once, without waiting for
    busy_timeout (once in 200 to 300 rounds of 16 threads opening a new directory), and
    that one tries again.
    """
    for attempt in range(100):
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == 99:
                raise
            time.sleep(0.01)


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring the schema up to date, one version per transaction. The version is
    read inside the write transaction, so two processes starting together on one
    data directory apply each migration once."""
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                raise StoreError(
                    f"the database is at schema version {version}, newer than this lmsp-min "
                    f"understands ({len(MIGRATIONS)}); use a newer lmsp-min or another --data-dir"
                )
            if version < len(MIGRATIONS):
                for statement in MIGRATIONS[version]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if version >= len(MIGRATIONS):
            return


class SQLiteStore(Store):
    """The SQLite database, with an async method per operation of the interface.

    Build it with `await SQLiteStore.open(data_dir)` (or `SQLiteStore.open_sync` outside trio);
    `data_dir=None` is the in-memory database of `--no-store`.
    """

    def __init__(self, path: Path | None, readers: int = 2):
        self.path = path  # None: in memory
        self.owner = os.urandom(8).hex()
        self._synchronous = "FULL"
        self._idle_readers: list[sqlite3.Connection] = []
        self._all_readers: list[sqlite3.Connection] = []
        self._write_limiter = trio.CapacityLimiter(1)
        # (principal, key) of the idempotency claims this Store's requests hold now: a
        # 'running' claim of ours that is not here was left by a request that could
        # neither complete nor release it (a failing disk), see release_abandoned_keys
        self._claims_held: set[tuple[str, str]] = set()
        self._owners = self._owner_lock = self._writer = None
        try:
            if path is None:
                self._writer = _connect(":memory:")
                self._read_limiter = self._write_limiter  # one connection does everything
                self._idle_readers.append(self._writer)
            else:
                self._owners = path.parent / OWNERS_DIR
                self._owners.mkdir(exist_ok=True)
                lock_path = self._owners / f"{self.owner}.lock"
                if fcntl is None:
                    self._owner_lock = open(lock_path, "w")
                else:  # locked under another name, then renamed: never seen unlocked
                    self._owner_lock = open(lock_path.with_suffix(".new"), "w")
                    fcntl.flock(self._owner_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    lock_path.with_suffix(".new").rename(lock_path)
                for lock_file in self._owners.glob("*.lock"):  # (the dead leave theirs behind)
                    self._is_dead(lock_file.stem)
                self._writer = _connect(str(path))
                _use_wal(self._writer)
                self._read_limiter = trio.CapacityLimiter(readers)
            self._writer.execute("PRAGMA synchronous = FULL")
            _migrate(self._writer)
        except BaseException:  # a newer schema, a damaged file: nothing is left open, nor on disk
            self.close()
            raise

    @classmethod
    def open_sync(cls, data_dir: Path | str | None) -> "SQLiteStore":
        if data_dir is None:
            return cls(None)
        data_dir = Path(data_dir)
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            return cls(data_dir / DB_NAME)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the database in {data_dir}: {exc}") from None

    @classmethod
    async def open(cls, data_dir: Path | str | None) -> "SQLiteStore":
        return await trio.to_thread.run_sync(cls.open_sync, data_dir)

    @property
    def location(self) -> str:
        return "in memory" if self.path is None else f"SQLite, {self.path}"

    @property
    def persistent(self) -> bool:
        """False for the in-memory database of `--no-store`."""
        return self.path is not None

    def close(self) -> None:
        for conn in self._all_readers:
            conn.close()
        self._all_readers.clear()
        self._idle_readers.clear()
        if self._writer is not None:
            self._writer.close()
        if self._owner_lock is not None:
            self._owner_lock.close()
            (self._owners / f"{self.owner}.lock").unlink(missing_ok=True)

    def _dead_among(self, owners: set[str]) -> set[str]:
        """The owners whose process has ended (one look at each one's lock)."""
        return {owner for owner in owners if self._is_dead(owner)}

    def _is_dead(self, owner: str) -> bool:
        """Whether the process of `owner` is gone (its lock file can be locked, or is
        missing); the file of a dead owner is removed."""
        if owner == self.owner or self._owners is None:
            return False
        path = self._owners / f"{owner}.lock"
        if fcntl is not None:
            try:
                with open(path) as file:
                    fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except FileNotFoundError:
                return True
            except OSError:  # locked (BlockingIOError), or not known to be dead (no descriptor left)
                return False
        path.unlink(missing_ok=True)
        return True

    # -- running statements in worker threads ---------------------------------------

    async def _write(self, fn: Callable[..., Any], *args: Any, durable: bool = True) -> Any:
        """Run `fn(conn, *args)` in one write transaction, in a worker thread.

        `durable=True` commits with synchronous=FULL (fsync), else NORMAL.
        """
        return await trio.to_thread.run_sync(
            self._write_in_thread, fn, args, durable, limiter=self._write_limiter
        )

    def _write_in_thread(self, fn: Callable[..., Any], args: tuple, durable: bool) -> Any:
        conn = self._writer
        synchronous = "FULL" if durable else "NORMAL"
        if synchronous != self._synchronous:
            conn.execute(f"PRAGMA synchronous = {synchronous}")
            self._synchronous = synchronous
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(conn, *args)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # (after some errors, a full disk, SQLite has rolled back)
                conn.execute("ROLLBACK")
            raise
        return result

    async def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(
            self._read_in_thread, fn, args, limiter=self._read_limiter
        )

    def _read_in_thread(self, fn: Callable[..., Any], args: tuple) -> Any:
        try:
            conn = self._idle_readers.pop()
        except IndexError:
            conn = _connect(str(self.path))  # (never in memory: its one connection is idle)
            self._all_readers.append(conn)
        try:
            return fn(conn, *args)
        finally:
            self._idle_readers.append(conn)

    # -- stored responses -----------------------------------------------------------

    async def put_response(
        self, response_id: str, principal: str, input_items: list, body: str
    ) -> None:
        """Store a final response (`body` is its JSON as served), durably."""
        response = json.loads(body)
        await self._write(
            _insert_response, response_id, principal, response["created_at"],
            response["model"], response["status"], json.dumps(input_items), body,
        )

    async def get_response(self, response_id: str, principal: str) -> StoredResponse | None:
        """The stored response, or None if unknown or owned by another principal."""
        row = await self._read(
            lambda conn: conn.execute(
                "SELECT id, principal, input, body FROM responses WHERE id = ? AND principal = ?",
                (response_id, principal),
            ).fetchone()
        )
        if row is None:
            return None
        return StoredResponse(row[0], row[1], json.loads(row[2]), row[3])

    async def delete_response(self, response_id: str, principal: str) -> bool:
        return await self._write(
            lambda conn: conn.execute(
                "DELETE FROM responses WHERE id = ? AND principal = ?", (response_id, principal)
            ).rowcount == 1
        )

    # -- tasks ----------------------------------------------------------------------

    async def create_task(
        self, task_id: str, principal: str, created_at: int, model: str, response_id: str,
        request: str,
    ) -> None:
        await self._write(
            lambda conn: conn.execute(
                "INSERT INTO tasks (id, principal, owner, created_at, model, response_id, status,"
                " request) VALUES (?, ?, ?, ?, ?, ?, 'queued', ?)",
                (task_id, principal, self.owner, created_at, model, response_id, request),
            )
        )

    async def set_task_status(self, task_id: str, status: str) -> None:
        """A non-final status change (queued -> in_progress)."""
        await self._write(
            lambda conn: conn.execute("UPDATE tasks SET status = ? WHERE id = ?", (status, task_id)),
            durable=False,
        )

    async def append_events(self, task_id: str, events: list[LoggedEvent]) -> None:
        """Append events to a task's log (one transaction, survives a kill -9)."""
        await self._write(_insert_events, task_id, events, time.time(), durable=False)

    async def finish_task(
        self,
        task_id: str,
        status: str,
        response: str,
        final_events: list[LoggedEvent],
        stored: tuple[str, list] | None = None,
    ) -> bool:
        """End a task in one durable transaction: its last events, its final
        status and response, and (`stored` = (principal, input items)) the stored
        response when the task's request asked for `store: true`.
        False (nothing written) if the task had already ended: two processes
        recovering the same dead owner's tasks end each only once."""
        assert status in FINAL_STATUSES, status

        def finish(conn: sqlite3.Connection) -> bool:
            (current,) = conn.execute("SELECT status FROM tasks WHERE id = ?", (task_id,)).fetchone()
            if current in FINAL_STATUSES:
                return False
            now = time.time()
            _insert_events(conn, task_id, final_events, now)
            conn.execute(
                "UPDATE tasks SET status = ?, response = ?, ended_at = ? WHERE id = ?",
                (status, response, now, task_id),
            )
            if stored is not None:
                body = json.loads(response)
                _insert_response(
                    conn, body["id"], stored[0], body["created_at"], body["model"],
                    body["status"], json.dumps(stored[1]), response,
                )
            return True

        return await self._write(finish)

    async def get_task(self, task_id: str, principal: str | None) -> TaskRow | None:
        """The task, or None if unknown or (principal given) owned by another principal."""
        return await self._read(_select_task, task_id, principal)

    async def get_task_of_response(self, response_id: str, principal: str) -> TaskRow | None:
        """The task that generates (or generated) the response `response_id`, or None: the
        OpenAI dialect names a background response by its response id, not by its task's."""
        def select(conn: sqlite3.Connection) -> TaskRow | None:
            row = conn.execute("SELECT id FROM tasks WHERE response_id = ? AND principal = ?",
                               (response_id, principal)).fetchone()
            return None if row is None else _select_task(conn, row[0], principal)

        return await self._read(select)

    async def request_cancel(self, task_id: str) -> None:
        """Ask the process that runs a task to cancel it (Tasks.cancel, for another owner's task)."""
        await self._write(
            lambda conn: conn.execute("UPDATE tasks SET cancel_requested = 1 WHERE id = ?", (task_id,)),
            durable=False,
        )

    async def cancel_requests(self) -> list[str]:
        """The ids of our unfinished tasks that another process asked to cancel."""
        rows = await self._read(
            lambda conn: conn.execute(
                "SELECT id FROM tasks WHERE owner = ? AND cancel_requested = 1"
                " AND status IN ('queued', 'in_progress')",
                (self.owner,),
            ).fetchall()
        )
        return [task_id for (task_id,) in rows]

    async def read_events(self, task_id: str, after: int, limit: int | None = None) -> list[LoggedEvent]:
        """Up to `limit` (None: all) logged events with seq > `after`, in order, in one read."""
        rows = await self._read(
            lambda conn: conn.execute(
                "SELECT seq, event, data FROM task_events WHERE task_id = ? AND seq > ?"
                " ORDER BY seq LIMIT ?",
                (task_id, after, -1 if limit is None else limit),
            ).fetchall()
        )
        return [LoggedEvent(*row) for row in rows]

    async def interrupted_tasks(self, running: Callable[[str], bool] = lambda task_id: False
                                ) -> list[tuple[TaskRow, list[LoggedEvent]]]:
        """Tasks left queued or in progress by a process that died, with their logs, and
        this Store's own unfinished tasks that are not `running` (asked after the rows are
        read: a task of ours is running before its row exists, until it is final)."""

        def select(conn: sqlite3.Connection) -> list[tuple[TaskRow, list[LoggedEvent]]]:
            rows = conn.execute(
                "SELECT id, owner FROM tasks WHERE status IN ('queued', 'in_progress')"
                " ORDER BY created_at"
            ).fetchall()
            ended = self._dead_among({owner for _, owner in rows}) | {self.owner}
            result = []
            for task_id in [task_id for task_id, owner in rows if owner in ended and not running(task_id)]:
                events = conn.execute(
                    "SELECT seq, event, data FROM task_events WHERE task_id = ? ORDER BY seq",
                    (task_id,),
                ).fetchall()
                result.append((_select_task(conn, task_id, None), [LoggedEvent(*e) for e in events]))
            return result

        try:
            return await self._read(select)
        except sqlite3.DatabaseError as exc:  # a damaged file: say so, as for one that cannot open
            raise StoreError(f"the database cannot be read: {exc}") from None

    async def delete_task(self, task_id: str, principal: str) -> bool:
        """Delete a final task of `principal` with its event log, in one transaction.
        False (nothing deleted) if there is no such task, or it is not final: a running
        task is cancelled first (Tasks.delete says 409). Its stored response, if it made
        one, is a resource of its own (delete_response)."""

        def delete(conn: sqlite3.Connection) -> bool:
            deleted = conn.execute(
                f"DELETE FROM tasks WHERE id = ? AND principal = ? AND status IN ({_FINAL_LIST})",
                (task_id, principal),
            ).rowcount == 1
            if deleted:
                conn.execute("DELETE FROM task_events WHERE task_id = ?", (task_id,))
            return deleted

        return await self._write(delete)

    # -- expiry ---------------------------------------------------------------------

    async def purge_stored(self, older_than: float) -> tuple[int, int]:
        """Delete the stored responses created, and the final tasks (with their event logs)
        ended, at or before `older_than` (Unix seconds): the --store-retention purge.
        Returns (responses, tasks) deleted. The pages they held go to SQLite's freelist,
        which later writes reuse: the file stays as large as its fullest retention window."""

        def purge(conn: sqlite3.Connection) -> tuple[int, int]:
            responses = conn.execute("DELETE FROM responses WHERE created_at <= ?", (older_than,)).rowcount
            ended = [task_id for (task_id,) in conn.execute(
                f"SELECT id FROM tasks WHERE ended_at IS NOT NULL AND ended_at <= ? AND status IN ({_FINAL_LIST})",
                (older_than,),
            )]
            for task_id in ended:
                conn.execute("DELETE FROM task_events WHERE task_id = ?", (task_id,))
                conn.execute("DELETE FROM tasks WHERE id = ?", (task_id,))
            return responses, len(ended)

        return await self._write(purge)

    async def purge(self, now: float, event_retention: float, idempotency_ttl: float) -> int:
        """Delete the events of tasks that ended more than `event_retention` seconds
        ago and finished idempotency records older than `idempotency_ttl`.
        Returns how many tasks had their events purged."""

        def purge(conn: sqlite3.Connection) -> int:
            expired = [
                task_id for (task_id,) in conn.execute(
                    "SELECT id FROM tasks WHERE events_expired = 0 AND ended_at IS NOT NULL"
                    " AND ended_at <= ?",
                    (now - event_retention,),
                )
            ]
            for task_id in expired:
                conn.execute("DELETE FROM task_events WHERE task_id = ?", (task_id,))
                conn.execute("UPDATE tasks SET events_expired = 1 WHERE id = ?", (task_id,))
            conn.execute(
                "DELETE FROM idempotency WHERE state = 'done' AND created_at <= ?",
                (now - idempotency_ttl,),
            )
            return len(expired)

        return await self._write(purge)

    # -- idempotency ----------------------------------------------------------------

    async def claim_idempotency_key(
        self, principal: str, key: str, fingerprint: str
    ) -> IdempotencyRecord | None:
        """Claim `key` for a new request: None if this request now owns it (it is
        recorded as running), else the record of the request that owns it."""

        def claim(conn: sqlite3.Connection) -> IdempotencyRecord | None:
            row = conn.execute(
                "SELECT fingerprint, state, status, content_type, body, task_id FROM idempotency"
                " WHERE principal = ? AND key = ?",
                (principal, key),
            ).fetchone()
            if row is not None:
                return IdempotencyRecord(*row)
            conn.execute(
                "INSERT INTO idempotency (principal, key, fingerprint, state, owner, created_at)"
                " VALUES (?, ?, ?, 'running', ?, ?)",
                (principal, key, fingerprint, self.owner, time.time()),
            )
            self._claims_held.add((principal, key))
            return None

        # Not fsynced: a claim lost in a power cut only lets the retry run again.
        return await self._write(claim, durable=False)

    async def complete_idempotency_key(
        self,
        principal: str,
        key: str,
        *,
        status: int,
        content_type: str | None = None,
        body: bytes | None = None,
        task_id: str | None = None,
    ) -> None:
        """Record the result to replay for `key` (durably: the client sees it next)."""
        try:
            await self._write(
                lambda conn: conn.execute(
                    "UPDATE idempotency SET state = 'done', status = ?, content_type = ?, body = ?,"
                    " task_id = ? WHERE principal = ? AND key = ?",
                    (status, content_type, body, task_id, principal, key),
                )
            )
        finally:  # done, or (failed) abandoned
            self._claims_held.discard((principal, key))

    async def release_idempotency_key(self, principal: str, key: str) -> None:
        """Forget a claim whose request produced nothing to replay (it failed, or its
        client went away), so that a retry runs again."""
        try:
            await self._write(
                lambda conn: conn.execute(
                    "DELETE FROM idempotency WHERE principal = ? AND key = ? AND state = 'running'",
                    (principal, key),
                ),
                durable=False,
            )
        finally:
            self._claims_held.discard((principal, key))

    async def release_abandoned_keys(self) -> int:
        """Release the claims of requests that died with their process, and our own
        claims that no request holds any more (it could neither complete nor release
        its key: the disk was full, say). Returns how many were released."""

        def abandoned(conn: sqlite3.Connection) -> list[tuple[str, str, str]]:
            claims = conn.execute("SELECT principal, key, owner FROM idempotency WHERE state = 'running'").fetchall()
            dead = self._dead_among({owner for _, _, owner in claims if owner != self.owner})
            return [(principal, key, owner) for principal, key, owner in claims
                    if owner in dead or (owner == self.owner and (principal, key) not in self._claims_held)]

        found = await self._read(abandoned)
        if not found:
            return 0  # (the usual case: no write, no write lock)

        def release(conn: sqlite3.Connection) -> int:
            # (still 'running': a claim of ours found abandoned is never held again, a dead
            # owner stays dead, and one completed meanwhile is 'done')
            return sum(conn.execute("DELETE FROM idempotency WHERE principal = ? AND key = ? AND owner = ?"
                                    " AND state = 'running'", claim).rowcount for claim in found)

        return await self._write(release)


def _insert_response(
    conn: sqlite3.Connection, response_id: str, principal: str, created_at: int,
    model: str, status: str, input_json: str, body: str,
) -> None:
    conn.execute(
        "INSERT INTO responses (id, principal, created_at, model, status, input, body)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (response_id, principal, created_at, model, status, input_json, body),
    )


def _insert_events(
    conn: sqlite3.Connection, task_id: str, events: list[LoggedEvent], now: float
) -> None:
    conn.executemany(
        "INSERT INTO task_events (task_id, seq, event, data, time) VALUES (?, ?, ?, ?, ?)",
        [(task_id, e.seq, e.event, e.data, now) for e in events],
    )


def _select_task(conn: sqlite3.Connection, task_id: str, principal: str | None) -> TaskRow | None:
    row = conn.execute(
        "SELECT id, principal, owner, created_at, model, response_id, status, request, response,"
        " ended_at, events_expired FROM tasks WHERE id = ?",
        (task_id,),
    ).fetchone()
    if row is None or (principal is not None and row[1] != principal):
        return None
    return TaskRow(*row[:10], bool(row[10]))

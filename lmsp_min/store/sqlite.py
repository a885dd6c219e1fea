"""The embedded store: one SQLite file (stdlib `sqlite3`) under `--data-dir`, in WAL mode so that
readers never wait for the writer; the statements are sql.py's. Writes go through ONE connection,
one worker thread at a time, so transactions never fight over the write lock; reads have a small
pool. `--no-store` is an in-memory database (one connection): tasks work, nothing outlives the process.

Durability: nothing a client was told is stored is ever lost. What it is told of (a stored response,
a created or finished task, an idempotency result) commits with `synchronous=FULL` (the WAL fsynced:
it survives a power cut); task events with `synchronous=NORMAL`, which survives a kill -9 and keeps
following a task cheap (benchmarks/tasks.py): only a power cut can lose a running task's last
events, and that task fails on restart anyway (the FULL commit that ends it fsyncs the same WAL).

Owners: processes sharing a data directory must know "the process running this task died" exactly.
Each Store (an owner) holds an exclusive `flock` on `owners/<id>.lock` while open, which the kernel
drops when the process dies (even by kill -9): only the work of owners whose lock can be taken is
recovered. (Without `fcntl`, on Windows, every other owner counts as dead.)

Next: lmsp_min/store/postgres.py, the store that several machines share.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any, Callable

import trio

from lmsp_min.store import STORE_TIMEOUT, StoreError
from lmsp_min.store.sql import Dialect, SQLStore, schema, takeover_columns

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

DB_NAME = "lmsp-min.sqlite3"
OWNERS_DIR = "owners"
SQLITE_FULL = 13  # "database or disk is full" (sqlite3 names its codes from Python 3.11 on)

# (No row lock: BEGIN IMMEDIATE gives a writer the database to itself, and the migration too.)
SQLITE = Dialect(bigint="INTEGER", double="REAL", blob="BLOB", boolean="INTEGER", true="1", false="0",
                 without_rowid=" WITHOUT ROWID", lock_row="", share_row="", notify=None,
                 version_setup=(), version="PRAGMA user_version", set_version="PRAGMA user_version = {}")

# Versions 1 to 3: the steps sql.py's schema grew by (the first with an index of SQLite's own); 4: the
# columns a takeover reads (unused by SQLite's one node, but one schema for both keeps sql.py's statements one).
_STEPS = schema(SQLITE)
MIGRATIONS: list[list[str]] = [[*_STEPS[0], "CREATE INDEX tasks_by_status ON tasks (status)"], *_STEPS[1:],
                               takeover_columns()]


def _connect(path: str, timeout: float) -> sqlite3.Connection:
    # isolation_level=None: no implicit transactions; we say BEGIN/COMMIT ourselves. `timeout`: how long
    # a statement waits for another process's write lock (SQLite's busy timeout), then it is a 503.
    return sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=timeout)


def _use_wal(conn: sqlite3.Connection) -> None:
    """Put the database in WAL mode. Two connections switching a new database together can deadlock:
    SQLite answers one "database is locked" at once, not after busy_timeout (once in 200 to 300 rounds
    of 16 threads opening a new directory), and that one tries again."""
    for attempt in range(100):
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == 99:
                raise
            time.sleep(0.01)


class SQLiteStore(SQLStore):
    """`await SQLiteStore.open(data_dir)` (`open_sync` outside trio); None: `--no-store`."""

    dialect = SQLITE
    elsewhere = "another --data-dir"
    damaged = sqlite3.DatabaseError
    durable_events = False  # (lost only with this machine's power, which cuts its streams too: "Durability")

    def __init__(self, path: Path | None, readers: int = 2, timeout: float = STORE_TIMEOUT,
                 log: Callable[[str], None] | None = None):
        super().__init__(timeout, log)
        self.path = path  # None: in memory
        self.persistent = path is not None
        self._synchronous = "FULL"
        self._idle_readers: list[sqlite3.Connection] = []
        self._all_readers: list[sqlite3.Connection] = []
        self._write_limiter = trio.CapacityLimiter(1)
        self._owners = self._owner_lock = self._writer = None
        try:
            if path is None:
                self._writer = _connect(":memory:", timeout)
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
                self._writer = _connect(str(path), timeout)
                _use_wal(self._writer)
                self._read_limiter = trio.CapacityLimiter(readers)
            self._writer.execute("PRAGMA synchronous = FULL")
            self._run_in_transaction(self._migrate, (MIGRATIONS,), durable=True)
        except BaseException:  # a newer schema, a damaged file: nothing is left open, nor on disk
            self.close()
            raise

    @classmethod
    def open_sync(cls, data_dir: Path | str | None, timeout: float = STORE_TIMEOUT,
                  log: Callable[[str], None] | None = None) -> "SQLiteStore":
        if data_dir is None:
            return cls(None, timeout=timeout, log=log)
        data_dir = Path(data_dir)
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            return cls(data_dir / DB_NAME, timeout=timeout, log=log)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the database in {data_dir}: {exc}") from None

    @classmethod
    async def open(cls, data_dir: Path | str | None, timeout: float = STORE_TIMEOUT,
                   log: Callable[[str], None] | None = None) -> "SQLiteStore":
        return await trio.to_thread.run_sync(cls.open_sync, data_dir, timeout, log)

    @property
    def location(self) -> str:
        return "in memory" if self.path is None else f"SQLite, {self.path}"

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

    def _is_disk_full(self, exc: Exception) -> bool:
        if isinstance(exc, sqlite3.OperationalError):
            code = getattr(exc, "sqlite_errorcode", None)  # (Python 3.11; before it, SQLITE_FULL's message)
            return code & 0xFF == SQLITE_FULL if code is not None else str(exc) == "database or disk is full"
        return super()._is_disk_full(exc)

    def _timed_out(self, exc: Exception) -> bool:
        return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)  # (the busy timeout waited out)

    def _gone_among(self, conn: sqlite3.Connection, owners: set[str]) -> set[str]:
        return {owner for owner in owners if self._is_dead(owner)}

    def _is_dead(self, owner: str) -> bool:
        """Whether `owner`'s process is gone (its lock file can be locked, or is missing, then removed)."""
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

    def _run_in_transaction(self, fn: Callable[..., Any], args: tuple, durable: bool) -> Any:
        """`durable=True` commits with synchronous=FULL (fsync), else NORMAL."""
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

    def _run_read(self, fn: Callable[..., Any], args: tuple) -> Any:
        try:
            conn = self._idle_readers.pop()
        except IndexError:
            conn = _connect(str(self.path), self.timeout)  # (never in memory: its one connection is idle)
            self._all_readers.append(conn)
        try:
            return fn(conn, *args)
        finally:
            self._idle_readers.append(conn)

"""A throw-away PostgreSQL server for the tests: `initdb` in a temporary directory,
`pg_ctl start` on a unix socket in it (no port to race for), a fresh database
per test, `pg_ctl stop` at the end of the session.

As root, the server runs as the `postgres` user (PostgreSQL refuses to run as
root); Debian's `postgresql` package provides the binaries and that user.
Durability is off (`fsync=off`): a test server's crash is no data loss, and the
durability of commits is PostgreSQL's, not ours. benchmarks/tasks.py measures
with it on.
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def binaries() -> Path | None:
    """The directory of initdb and pg_ctl, or None when PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(versions[-1]).parent if versions else None


def started(settings: dict[str, str] | None = None) -> "PostgresServer":
    """A server of a test's own (or a session's), started; the test is skipped, saying why,
    where PostgreSQL is not installed (CI installs it: .ci/run)."""
    import pytest

    bin_dir = binaries()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (no initdb; Debian: apt-get install postgresql)")
    return PostgresServer(bin_dir, settings=settings).start()


class PostgresServer:
    """`start()`, then `new_database()` URLs, then `stop()`."""

    def __init__(self, bin_dir: Path, fsync: bool = False, settings: dict[str, str] | None = None):
        self.bin_dir = bin_dir
        self.fsync = fsync
        self.settings = settings or {}  # more of the server's settings (`-c name=value`)
        self.dir = Path(tempfile.mkdtemp(prefix="lmsp-min-pg-"))
        self.data = self.dir / "data"
        self._names = itertools.count(1)

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    def start(self) -> "PostgresServer":
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.restart_server()
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql:///{database}?host={self.dir}&user=postgres"

    def new_database(self) -> str:
        """The URL of a new, empty database."""
        import psycopg

        name = f"test_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop_server(self) -> None:
        """Stop the server now (`restart_server` brings it back, with its data)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)

    def restart_server(self) -> None:
        """Start the server (pg_ctl waits until it accepts connections)."""
        fsync = "on" if self.fsync else "off"
        options = f"-k {self.dir} -c listen_addresses='' -c fsync={fsync} -c max_connections=200"
        options += "".join(f" -c {name}={value}" for name, value in self.settings.items())
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.dir / "log"), "-w", "-t", "60",
                  "start")

    def processes(self) -> list[int]:
        """The running server's processes: the postmaster (first), then its children."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()  # (after the command's name)
            except OSError:  # (a process that ended meanwhile)
                continue
            if int(fields[1]) == postmaster:
                children.append(int(stat.parent.name))
        return [postmaster, *children]

    def stop(self) -> None:
        self.stop_server()
        shutil.rmtree(self.dir, ignore_errors=True)

"""Which backend a `--store` (or `--data-dir`) names, opened: the one module that imports them (psycopg
only for a postgresql:// URL). Next: lmsp_min/store/__init__.py.
"""

from __future__ import annotations

from pathlib import Path

import trio

from lmsp_min.store import STORE_TIMEOUT, Store, StoreError


async def open_store(location: str | Path | None, *, lease: float = 10.0, timeout: float = STORE_TIMEOUT,
                     log=None) -> Store:
    """The store at `location`: a postgresql:// URL (PostgreSQL, through the `postgres`
    extra; `lease`: seconds after which a silent node's tasks are failed by the others),
    a data directory (SQLite), or None (SQLite in memory, --no-store). `timeout`: seconds
    one store call may take before it is a 503 (--store-timeout). `log` hears what the
    operator must know of it (a full disk, a lost connection), one line each."""
    if isinstance(location, str) and location.startswith(("postgresql://", "postgres://")):
        try:
            from lmsp_min.store.postgres import PostgresStore
        except ImportError as exc:
            raise StoreError(f"--store {location.split('://')[0]}://... needs psycopg 3: "
                             f"pip install 'lmsp-min[postgres]' ({exc})") from None
        token = trio.lowlevel.current_trio_token()  # (the loop its listener hands notices to)
        return await trio.to_thread.run_sync(PostgresStore, location, lease, log, token, timeout)
    from lmsp_min.store.sqlite import SQLiteStore
    return await SQLiteStore.open(location, timeout, log=log)

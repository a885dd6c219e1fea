"""`lmsp-min serve` as a user runs it: a process, a banner, requests, a clean stop on SIGTERM."""

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

from engine import accel
from lmsp_min.store.sqlite import SQLiteStore
from server_harness import tiny_path  # noqa: F401
from waiting import wait_until_sync

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_and_stops_cleanly_on_sigterm(tmp_path, tiny_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LMSP_HOME": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "lmsp_min.cli", "serve", "--model", str(tiny_path), "--port", str(port),
         "--no-store"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def models_listed():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/lmsp/v1/models", timeout=5) as reply:
                    assert reply.headers["LMSP-Version"] == "1.0"
                    return json.load(reply)
            except OSError:
                assert process.poll() is None, process.stderr.read()
                return None

        listing = wait_until_sync(models_listed, "the server listening", seconds=60, every=0.1)
        assert [model["id"] for model in listing["data"]] == ["tiny:chat-q8_0"]
        body = json.dumps({"model": "tiny:chat-q8_0", "input": [{"role": "user", "content": "Hi"}],
                           "max_output_tokens": 2}).encode()
        generate = urllib.request.Request(f"http://127.0.0.1:{port}/lmsp/v1/responses", body,
                                          {"Content-Type": "application/json"})
        with urllib.request.urlopen(generate, timeout=30) as reply:  # the model loaded, its scheduler run
            assert json.load(reply)["status"] in ("completed", "incomplete")
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    assert f"on http://127.0.0.1:{port}" in stderr and "tiny:chat-q8_0" in stderr
    assert "auth: none (loopback only" in stderr
    blas = f"numpy's BLAS: OpenBLAS with its {accel.blas_kernel()} kernels"
    assert f"compute: {accel.num_threads()} threads; {blas}" in stderr
    assert "GET /lmsp/v1/models 200" in stderr and "loaded model tiny:chat-q8_0" in stderr
    assert stderr.rstrip().endswith("stopped")  # (the model closed, its threads joined: the process ends)


def test_serve_refuses_a_public_address_without_tokens(tiny_path):
    result = subprocess.run(
        [sys.executable, "-m", "lmsp_min.cli", "serve", "--model", str(tiny_path), "--host", "0.0.0.0"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "refusing to listen on 0.0.0.0 without --tokens-file" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_on_a_taken_port_says_so_in_one_line(tmp_path, tiny_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "lmsp_min.cli", "serve", "--model", str(tiny_path), "--port", str(port),
             "--no-store"],
            env={**os.environ, "PYTHONPATH": str(ROOT), "LMSP_HOME": str(tmp_path)},
            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_on_a_damaged_database_says_so_in_one_line(tmp_path, tiny_path):
    """Found when tasks recover at start, inside the service's nurseries: trio >= 0.25 wrapped
    the StoreError in exception groups, and serve printed their traceback."""
    data = tmp_path / "data"
    SQLiteStore.open_sync(data).close()
    database = data / "lmsp-min.sqlite3"
    with sqlite3.connect(database) as db:
        db.executemany("INSERT INTO tasks (id, principal, owner, created_at, model, response_id, status, request)"
                       " VALUES (?, 'local', 'gone', 0, 'tiny:chat-q8_0', ?, 'queued', ?)",
                       [(f"task_{n}", f"resp_{n}", "x" * 500) for n in range(200)])
    db.close()
    with open(database, "r+b") as file:  # the pages after the first ones: the tasks' table
        for offset in range(4096, database.stat().st_size, 4096):
            file.seek(offset)
            file.write(bytes(range(256)) * 16)
    result = subprocess.run(
        [sys.executable, "-m", "lmsp_min.cli", "serve", "--model", str(tiny_path), "--port", str(_free_port()),
         "--data-dir", str(data)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "LMSP_HOME": str(tmp_path)},
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "lmsp-min serve: the database cannot be read" in result.stderr
    assert "Traceback" not in result.stderr


def test_one_os_error_is_found_inside_nested_exception_groups():
    # trio >= 0.25 wraps what fails in a nursery in groups: serve reports the OSError itself
    from lmsp_min.service import _only

    try:
        group = ExceptionGroup
    except NameError:  # Python 3.10: trio's dependency
        from exceptiongroup import ExceptionGroup as group
    taken = OSError(98, "Address already in use")
    assert _only(group("", [group("", [taken])]), OSError) is taken
    assert _only(taken, OSError) is taken
    assert _only(group("", [taken, OSError()]), OSError) is None
    assert _only(group("", [ValueError()]), OSError) is None

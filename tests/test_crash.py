"""kill -9 in the middle of a task: nothing a client was told is stored is lost.

The real `lmsp-min serve` runs as a subprocess on a data directory. Clients store
responses and start a long task; while the task is generating, the process is
killed with SIGKILL (no clean-up code runs). A new process on the same data
directory must serve every stored response byte for byte, report the task
`failed` with a problem saying why, and replay the task's events: exactly the
events followers had seen, then a final `response.failed`.
"""

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny import SMOLLM2_TOKENIZER, load_tokenizer_meta, write_tiny_model
from waiting import wait_until_sync


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """The tiny chat model with a 4096-token window, so that a task can run long."""
    path = tmp_path_factory.mktemp("crash-models") / "tiny-chat-q8_0.gguf"
    return write_tiny_model(path, "llama", load_tokenizer_meta(SMOLLM2_TOKENIZER), context_length=4096)


class Serve:
    """`python -m lmsp_min.cli serve` in a subprocess, on a free port; `args` are more
    options (`--store URL`), `home` its own home directory."""

    def __init__(self, model: Path, data_dir: Path, empty_dir: Path, *args: str, home: Path | None = None):
        env = dict(os.environ)
        if home is not None:
            home.mkdir(parents=True, exist_ok=True)
            env.update(HOME=str(home), LMSP_HOME=str(home / "lmsp"))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lmsp_min.cli", "serve", "--model", str(model), "--models-dir",
             str(empty_dir), "--data-dir", str(data_dir), "--port", "0", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            cwd=Path(__file__).parent.parent, env=env,
        )
        self.port = self._wait_for_banner()

    def _wait_for_banner(self) -> int:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            lines.append(line)
            found = re.search(r"serving LMSP 1\.0 on http://127\.0\.0\.1:(\d+)", line)
            if found:
                return int(found.group(1))
            if not line and self.process.poll() is not None:
                break
        self.kill()
        raise AssertionError("the server did not start:\n" + "".join(lines))

    def request(self, method: str, path: str, body: dict | None = None, headers: dict | None = None,
                reply_headers: list | None = None) -> tuple[int, bytes]:
        """(status, body); the reply's headers are appended to `reply_headers` if given."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {**({"Content-Type": "application/json"} if body is not None else {}), **(headers or {})}
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        reply = conn.getresponse()
        data = reply.read()
        conn.close()
        if reply_headers is not None:
            reply_headers.extend(reply.getheaders())
        return reply.status, data

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process.stderr.close()


def wait_final(server: Serve, task_id: str, seconds: float = 30) -> dict:
    """The task once final (asked every 20 ms); fails after `seconds`."""
    def final():
        status, body = server.request("GET", f"/lmsp/v1/tasks/{task_id}")
        assert status == 200, body
        task = json.loads(body)
        return task if task["status"] in ("completed", "incomplete", "failed", "cancelled") else None

    return wait_until_sync(final, f"task {task_id} final", seconds, every=0.02)


FINAL = ("response.completed", "response.incomplete", "response.failed", "response.cancelled")


def read_events(response, stop_after: int | None = None) -> list[tuple[int, str, dict]]:
    """SSE events from an http.client response, up to `stop_after` of them, or up to the
    final event (then the connection stays open, kept alive: nothing more is read)."""
    events, fields = [], {}
    while (stop_after is None or len(events) < stop_after) and not (events and events[-1][1] in FINAL):
        line = response.fp.readline().decode("utf-8")
        if not line:
            break
        line = line.rstrip("\r\n")
        if not line:
            if "event" in fields:
                events.append((int(fields["id"]), fields["event"], json.loads(fields["data"])))
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value
    return events


def test_kill_9_mid_task_loses_nothing(long_model, tmp_path, store_location):
    """On SQLite (the same data directory) and on PostgreSQL (the same database)."""
    data_dir, empty_dir = tmp_path / "data", tmp_path / "empty"
    empty_dir.mkdir()
    # (PostgreSQL: the killed node's tasks are taken over once its lease expires, a second after it)
    store = ("--store", store_location, "--store-lease", "1") if isinstance(store_location, str) else ()
    server = Serve(long_model, data_dir, empty_dir, *store)
    try:
        model = json.loads(server.request("GET", "/lmsp/v1/models")[1])["data"][0]["id"]
        stored = {}
        for n in range(3):
            status, body = server.request("POST", "/lmsp/v1/responses", {
                "model": model, "input": [{"role": "user", "content": f"Question {n}?"}],
                "max_output_tokens": 5, "temperature": 0, "store": True})
            assert status == 200
            stored[json.loads(body)["id"]] = body

        status, body = server.request("POST", "/lmsp/v1/tasks", {
            "model": model, "input": [{"role": "user", "content": "Write a long story."}],
            "max_output_tokens": 3500, "temperature": 0})
        assert status == 202
        task_id = json.loads(body)["id"]
        follower = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        follower.request("GET", f"/lmsp/v1/tasks/{task_id}/events")
        seen = read_events(follower.getresponse(), stop_after=8)
        assert len(seen) == 8 and seen[-1][1] == "response.output_text.delta"
    finally:
        server.kill()  # SIGKILL: mid-generation, nothing cleans up
    follower.close()

    server = Serve(long_model, data_dir, empty_dir, *store)
    try:
        for response_id, body in stored.items():
            assert server.request("GET", f"/lmsp/v1/responses/{response_id}") == (200, body)
        task = wait_final(server, task_id, seconds=120)
        replay = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        replay.request("GET", f"/lmsp/v1/tasks/{task_id}/events")
        events = read_events(replay.getresponse())
        replay.close()
        assert events[:len(seen)] == seen  # what followers saw before the crash
        assert [e[0] for e in events] == list(range(1, len(events) + 1))
        if store:  # PostgreSQL: the node started on the database takes the task over (test_failover.py)
            assert task["status"] in ("completed", "incomplete") and events[-1][1] == f"response.{task['status']}"
        else:  # SQLite: nobody takes over; the next start ends it failed
            assert task["status"] == "failed"
            assert task["response"]["status"] == "failed"
            assert task["response"]["error"]["code"] == "generation_failed"
            assert "stopped" in task["response"]["error"]["detail"]
            assert events[-1][1] == "response.failed"
            assert events[-1][2]["error"] == task["response"]["error"]
            assert all(e[1] != "response.completed" for e in events)
        # the failed response holds the text its followers had seen
        deltas = "".join(e[2]["delta"] for e in events if e[1] == "response.output_text.delta")
        assert task["response"]["output"][0]["content"][0]["text"] == deltas
    finally:
        server.kill()

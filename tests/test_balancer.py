"""A rolling restart behind a real HAProxy: two nodes on one PostgreSQL database, restarted one
after the other (SIGTERM, drain, start again) under a steady load of streamed responses and
tasks sent through the balancer. It checks GET /healthz as HAProxy reads it, and counts: 0
requests failed, 0 tasks lost (every one ends, its events numbered without a gap or repeat).

HAProxy is Debian's `haproxy` (.ci/run installs it where missing); the test is skipped, saying
why, without it. Its configuration is docs/scale-out.md's, with the test's addresses and
quicker checks.
"""

import http.client
import json
import re
import shutil
import socket
import subprocess
import threading
import time

import pytest

from test_crash import read_events, wait_final
from test_failover import Node, long_model  # noqa: F401 (a fixture)
from waiting import wait_until_sync

pytestmark = pytest.mark.slow  # (~40 s: two restarts, each drained)

HAPROXY_CONFIG = """
global
    maxconn 200
defaults
    mode http
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch
    retry-on conn-failure empty-response 503
    option http-buffer-request
    http-reuse never
frontend lmsp
    bind 127.0.0.1:{port}
    default_backend nodes
backend nodes
    balance leastconn
    option httpchk GET /healthz
    http-check expect status 200
    default-server inter 200ms fall 1 rise 1
    server a 127.0.0.1:{a} check
    server b 127.0.0.1:{b} check
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Load:
    """Clients in threads, each in a loop through the balancer: a streamed response read to its
    final event, then a task created and followed to its final event. Counts what failed."""

    def __init__(self, port: int, model: str, clients: int = 3):
        self.port, self.model = port, model
        self.failures: list[str] = []
        self.tasks: list[str] = []
        self.requests = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _client(self) -> None:
        while not self._stop.is_set():
            try:
                self._streamed_response()
                self._task()
            except Exception as exc:  # (a connection reset, a timeout: a failed request)
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def _post(self, path: str, body: dict) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        self.requests += 1
        return conn.getresponse()

    def _streamed_response(self) -> None:
        reply = self._post("/lmsp/v1/responses", {"model": self.model,
                                                  "input": [{"role": "user", "content": "Hello"}], "stream": True,
                                                  "max_output_tokens": 16, "temperature": 0})
        if reply.status != 200:
            self.failures.append(f"stream: {reply.status} {reply.read()[:200]!r}")
            return
        events = read_events(reply)
        if not events or events[-1][1] not in ("response.completed", "response.incomplete"):
            self.failures.append(f"stream ended with {events[-1:]}")

    def _task(self) -> None:
        reply = self._post("/lmsp/v1/tasks", {"model": self.model,
                                              "input": [{"role": "user", "content": "Tell a story."}],
                                              "max_output_tokens": 40, "temperature": 0})
        body = reply.read()
        if reply.status != 202:
            self.failures.append(f"task: {reply.status} {body[:200]!r}")
            return
        task_id = json.loads(body)["id"]
        self.tasks.append(task_id)
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", f"/lmsp/v1/tasks/{task_id}/events")
        self.requests += 1
        events = read_events(conn.getresponse())
        conn.close()
        if [e[0] for e in events] != list(range(1, len(events) + 1)) or not events[-1][1].startswith(
                ("response.completed", "response.incomplete")):
            self.failures.append(f"task {task_id} followed: {[(e[0], e[1]) for e in events][-3:]}")


def test_a_rolling_restart_behind_haproxy_fails_no_request_and_loses_no_task(long_model, tmp_path,  # noqa: F811
                                                                            postgres_server):
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("HAProxy is not installed (Debian: apt-get install haproxy)")
    url = postgres_server.new_database()
    empty = tmp_path / "empty"
    empty.mkdir()
    ports = {"a": free_port(), "b": free_port()}

    def start(name: str) -> Node:
        return Node(long_model, tmp_path / name / "data", empty, "--store", url, "--store-lease", "1",
                    "--drain-seconds", "20", "--port", str(ports[name]), home=tmp_path / name / "home")

    nodes = {name: start(name) for name in ports}
    front = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(HAPROXY_CONFIG.format(port=front, **ports))
    balancer = subprocess.Popen([haproxy, "-f", str(config), "-db"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        def healthz(port: int) -> tuple[int, dict]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/healthz")
            reply = conn.getresponse()
            return reply.status, json.loads(reply.read())

        assert healthz(ports["a"]) == (200, {"status": "serving"})
        wait_until_sync(lambda: _answers(front), "HAProxy answers")
        model = json.loads(_get(front, "/lmsp/v1/models"))["data"][0]["id"]
        with Load(front, model) as load:
            wait_until_sync(lambda: len(load.tasks) >= 3, "the load runs", seconds=60)
            for name in ("a", "b"):  # one node after the other: drained, then started again
                # (a longer task certainly running on the node when it drains: handed over)
                status, body = nodes[name].request("POST", "/lmsp/v1/tasks", {
                    "model": model, "input": [{"role": "user", "content": "A long story."}],
                    "max_output_tokens": 300, "temperature": 0})
                assert status == 202, body
                load.tasks.append(json.loads(body)["id"])
                nodes[name].terminate(60)
                assert re.search(r"handing \d+ running task\(s\) over", nodes[name].log())
                nodes[name] = start(name)
                before = len(load.tasks)
                wait_until_sync(lambda: len(load.tasks) >= before + 3, "the load goes on", seconds=60)
        assert load.failures == [], load.failures
        assert load.requests > 20 and len(load.tasks) > 9
        for task_id in load.tasks:  # 0 lost: every task ends, as it would have
            assert wait_final(nodes["a"], task_id, seconds=60)["status"] in ("completed", "incomplete")
    finally:
        balancer.kill()
        balancer.wait()
        for node in nodes.values():
            node.kill()


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    body = conn.getresponse().read()
    conn.close()
    return body


def _answers(port: int) -> bool:
    try:
        return json.loads(_get(port, "/lmsp/v1/models"))["data"] != []
    except (OSError, ValueError, KeyError):
        return False

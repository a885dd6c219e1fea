"""Failover: a node's death, or its drain, loses no work (docs/scale-out.md "Leases and failure").

Real processes (`python -m lmsp_min.cli serve --store URL`) on one real PostgreSQL database
(tests/pg_server.py), the tiny chat model, greedy tasks. A node killed with SIGKILL mid-task,
one stopped with SIGTERM, one frozen past its lease that comes back, and three nodes racing
for a dead node's tasks: each task ends once, completed, its events numbered without a gap or
repeat, followed on another node on the same stream, and its text the text an uninterrupted
run of the same request gives.
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from test_crash import Serve, read_events, wait_final
from test_scale_out import follow, model_of
from tiny import SMOLLM2_TOKENIZER, load_tokenizer_meta, write_tiny_model
from waiting import wait_until_sync

LEASE = "1"  # seconds: a dead node's tasks are taken over about a second after it
TOKENS = 400  # long enough to be mid-generation when the node dies (each test checks it was), short for a test


class Node(Serve):
    """A node whose log is read as it comes (so that it never blocks on a full pipe) and kept."""

    _reader: threading.Thread | None = None  # (none yet while it starts)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)

    def terminate(self, seconds: float = 60) -> None:
        os.kill(self.process.pid, signal.SIGTERM)
        self.process.wait(seconds)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()
        if self._reader is not None:
            self._reader.join(10)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """The tiny chat model with a 4096-token window, so that a task can run long."""
    path = tmp_path_factory.mktemp("failover-models") / "tiny-chat-q8_0.gguf"
    return write_tiny_model(path, "llama", load_tokenizer_meta(SMOLLM2_TOKENIZER), context_length=4096)


@pytest.fixture
def cluster(long_model, tmp_path, postgres_server):
    """`start(name, *options)` starts a node on the test's own database; all are killed after it."""
    url = postgres_server.new_database()
    empty = tmp_path / "empty"
    empty.mkdir()
    started = []

    def start(name: str, *options: str) -> Node:
        node = Node(long_model, tmp_path / name / "data", empty, "--store", url, "--store-lease", LEASE,
                    *options, home=tmp_path / name / "home")
        started.append(node)
        return node

    yield start
    for node in started:
        node.kill()


def story(model: str, n: int = 0) -> dict:
    return {"model": model, "input": [{"role": "user", "content": f"Write a long story, number {n}."}],
            "max_output_tokens": TOKENS, "temperature": 0}


def start_task(node: Node, body: dict) -> str:
    status, reply = node.request("POST", "/lmsp/v1/tasks", body)
    assert status == 202, reply
    return json.loads(reply)["id"]


def uninterrupted_text(node: Node, body: dict) -> str:
    """The text of the same request answered directly, from its start to its end on one node."""
    status, reply = node.request("POST", "/lmsp/v1/responses", body)
    assert status == 200, reply
    return json.loads(reply)["output"][0]["content"][0]["text"]


def text_of(events: list) -> str:
    return "".join(e[2]["delta"] for e in events if e[1] == "response.output_text.delta")


def assert_whole(events: list, expected_text: str) -> None:
    """One run's events: numbered 1, 2, 3... without a gap or repeat, one final event (its last),
    its text the uninterrupted run's."""
    assert [e[0] for e in events] == list(range(1, len(events) + 1))
    finals = [e for e in events if e[1].startswith("response.") and e[1].split(".")[1] in
              ("completed", "incomplete", "failed", "cancelled")]
    assert finals == [events[-1]] and finals[0][1] in ("response.completed", "response.incomplete")
    assert text_of(events) == expected_text


def replay(node: Node, task_id: str) -> list:
    conn, reply = follow(node, task_id)
    events = read_events(reply)
    conn.close()
    return events


def test_kill_9_mid_task_the_other_node_continues_it_on_the_followers_stream(cluster):
    a, b = cluster("A"), cluster("B")
    body = story(model_of(a))
    task_id = start_task(a, body)
    conn, reply = follow(b, task_id)
    seen = read_events(reply, stop_after=8)
    assert seen[-1][1] == "response.output_text.delta"
    a.kill()  # SIGKILL mid-generation: its lease is no longer renewed
    rest = read_events(reply)  # the same stream: B's continuation follows A's events
    conn.close()
    events = seen + rest
    assert f"task {task_id} taken over" in b.log()
    assert_whole(events, uninterrupted_text(b, body))
    task = wait_final(b, task_id)
    assert task["response"]["output"][0]["content"][0]["text"] == text_of(events)
    assert replay(b, task_id) == events


@pytest.mark.slow  # (~40 s: ten tasks, and each again uninterrupted)
def test_sigterm_hands_running_and_queued_tasks_over_at_once(cluster):
    # ten tasks: eight generate together (the engine's batch), two wait for their turn
    a, b = cluster("A", "--queue-depth", "16", "--drain-seconds", "20"), cluster("B")
    model = model_of(a)
    bodies = [story(model, n) for n in range(10)]
    task_ids = [start_task(a, body) for body in bodies]
    conn, reply = follow(b, task_ids[0])
    seen = read_events(reply, stop_after=8)
    local_conn, local = follow(a, task_ids[0])  # a follower on the node that drains
    local_seen = read_events(local, stop_after=4)
    signalled = time.monotonic()
    os.kill(a.process.pid, signal.SIGTERM)
    wait_until_sync(lambda: f"task {task_ids[0]} taken over" in b.log(), "B took the first task over")
    handover = time.monotonic() - signalled
    # handed over, not found once its lease expired (its next event may wait for one of B's
    # slots: B's batch takes eight of the ten)
    assert handover < float(LEASE)
    rest = read_events(reply)
    conn.close()
    # the follower on the draining node goes on from the database, to the end, in its drain
    local_rest = read_events(local)
    local_conn.close()
    a.process.wait(30)
    assert "handing 10 running task(s) over" in a.log()
    events = seen + rest
    for n, task_id in enumerate(task_ids):
        expected = uninterrupted_text(b, bodies[n])
        assert_whole(events if n == 0 else replay(b, task_id), expected)
        assert wait_final(b, task_id)["status"] in ("completed", "incomplete")
    assert local_seen + local_rest == events


@pytest.mark.slow  # (~45 s: five nodes, six tasks, each again uninterrupted)
def test_three_nodes_racing_for_a_dead_nodes_tasks_take_each_once(cluster):
    dead = cluster("D", "--queue-depth", "8")
    racers = [cluster(name) for name in ("A", "B", "C")]
    model = model_of(dead)
    bodies = [story(model, n) for n in range(6)]
    task_ids = [start_task(dead, body) for body in bodies]
    conn, reply = follow(racers[0], task_ids[0])
    seen = read_events(reply, stop_after=8)
    dead.kill()
    events = seen + read_events(reply)
    conn.close()
    tasks = [wait_final(racers[1], task_id, seconds=120) for task_id in task_ids]
    assert all(task["status"] in ("completed", "incomplete") for task in tasks)  # 0 lost
    for node in racers:
        node.terminate()
    logs = [node.log() for node in racers]
    for task_id in task_ids:  # 0 doubled: one node took each over, and none ran it twice
        assert sum(log.count(f"task {task_id} taken over") for log in logs) == 1
    assert not any("error" in log for log in logs), logs
    survivor = cluster("E")
    for n, task_id in enumerate(task_ids):
        assert_whole(events if n == 0 else replay(survivor, task_id), uninterrupted_text(survivor, bodies[n]))


def test_a_node_back_after_its_lease_finds_its_task_taken_and_writes_nothing(cluster):
    a, b = cluster("A"), cluster("B")
    body = story(model_of(a))
    task_id = start_task(a, body)
    conn, reply = follow(b, task_id)
    seen = read_events(reply, stop_after=8)
    os.kill(a.process.pid, signal.SIGSTOP)  # frozen (a partition, a stalled VM) past its lease
    try:
        wait_until_sync(lambda: f"task {task_id} taken over" in b.log(), "B took the task over")
        more = read_events(reply, stop_after=8)  # (B's continuation, perhaps after some of A's last events)
    finally:
        os.kill(a.process.pid, signal.SIGCONT)
    events = seen + more + read_events(reply)
    conn.close()
    assert_whole(events, uninterrupted_text(b, body))
    wait_until_sync(lambda: "was taken over by another node" in a.log(), "A found its task taken")
    assert replay(a, task_id) == events  # A wrote nothing of its own after B took it
    assert a.request("GET", f"/lmsp/v1/tasks/{task_id}")[0] == 200

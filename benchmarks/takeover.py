"""Takeover: how long a task waits for another node when the one running it dies, or drains.

    python -m benchmarks.takeover [--rounds 3] [--lease 2] [--store URL] [--json FILE]

Two `lmsp-min serve` processes, nodes A and B, on one PostgreSQL database (`--store URL`,
else a throw-away server of its own, tests/pg_server.py, with fsync on), on the tiny
random-weight chat model (tests/tiny.py). Each round starts A, starts a long greedy task on
it, follows the task on B, and once B has read a few events:

- kill -9: SIGKILL A, and time until B's follower reads the first event B wrote (the event
  after the one B's log says it took over from). The lease is in it: A is known to be gone
  only once its lease has expired, and B's next recovery round (every half lease) claims it;
- SIGTERM: the same after SIGTERM, which hands A's tasks over at once (no lease waited for);
  also the time until A has exited (it drains: nothing else is in progress on it).

It prints each figure's median and range over the rounds, with the lease.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 3000  # a task that runs for the whole round


class Node:
    """`lmsp-min serve` on `--store URL` in a child process, on a free port; its log read as it comes."""

    def __init__(self, model: Path, home: Path, url: str, lease: float):
        home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HOME": str(home), "LMSP_HOME": str(home / "lmsp")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lmsp_min.cli", "serve", "--model", str(model), "--models-dir", str(home),
             "--store", url, "--store-lease", str(lease), "--port", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.lines: list[str] = []
        self.port = self._wait_for_banner()
        threading.Thread(target=self._read_log, daemon=True).start()

    def _wait_for_banner(self) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            self.lines.append(line)
            found = re.search(r"serving LMSP 1\.0 on http://127\.0\.0\.1:(\d+)", line)
            if found:
                return int(found.group(1))
            if not line and self.process.poll() is not None:
                break
        self.process.kill()
        raise RuntimeError("the node did not start:\n" + "".join(self.lines))

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def start_task(self, model: str) -> str:
        conn = self.connection()
        conn.request("POST", "/lmsp/v1/tasks", json.dumps({
            "model": model, "input": [{"role": "user", "content": "Write a long story."}],
            "max_output_tokens": TOKENS, "temperature": 0}), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        body = json.loads(reply.read())
        conn.close()
        return body["id"]

    def taken_over_after(self, task_id: str) -> int | None:
        """The last event of its old node that this node's takeover of `task_id` went on from."""
        for line in list(self.lines):
            found = re.search(rf"task {task_id} taken over \(from \w[\w-]*\) after its event (\d+)", line)
            if found:
                return int(found.group(1))
        return None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def next_event_id(stream) -> int:
    """Read SSE lines up to the next event; its id."""
    while True:
        line = stream.fp.readline().decode()
        if not line:
            raise RuntimeError("the follower's stream ended")
        if line.startswith("id: "):
            return int(line[4:])


def first_event_of(b: Node, task_id: str, stream, deadline: float) -> float:
    """Read the follower's stream until the first event node B wrote; when it was read."""
    while time.monotonic() < deadline:
        seq = next_event_id(stream)
        read_at = time.monotonic()
        after = b.taken_over_after(task_id)
        if after is not None and seq > after:
            return read_at
    raise RuntimeError(f"task {task_id} was not taken over by node B in time")


def one_round(model_path: Path, home: Path, url: str, lease: float, b: Node, how: signal.Signals) -> dict:
    a = Node(model_path, home / f"a-{time.monotonic_ns()}", url, lease)
    try:
        model = json.loads(_get(a, "/lmsp/v1/models"))["data"][0]["id"]
        task_id = a.start_task(model)
        conn = b.connection()
        conn.request("GET", f"/lmsp/v1/tasks/{task_id}/events")
        stream = conn.getresponse()
        for _ in range(6):
            next_event_id(stream)
        signalled = time.monotonic()
        os.kill(a.process.pid, how)
        first = first_event_of(b, task_id, stream, signalled + 10 * lease + 30) - signalled
        exited = None
        if how == signal.SIGTERM:
            a.process.wait(60)
            exited = time.monotonic() - signalled
        conn.close()
        return {"to_next_event_s": first, "to_exit_s": exited}
    finally:
        a.stop()


def _get(node: Node, path: str) -> bytes:
    conn = node.connection()
    conn.request("GET", path)
    body = conn.getresponse().read()
    conn.close()
    return body


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(rounds: int, lease: float, url: str | None) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.tiny import SMOLLM2_TOKENIZER, load_tokenizer_meta, write_tiny_model

    with tempfile.TemporaryDirectory(prefix="lmsp-takeover-") as tmp:
        home = Path(tmp)
        model = write_tiny_model(home / "tiny-chat-q8_0.gguf", "llama", load_tokenizer_meta(SMOLLM2_TOKENIZER),
                                 context_length=4096)
        server = None
        if url is None:
            from tests.pg_server import PostgresServer, binaries

            server = PostgresServer(binaries(), fsync=True).start()
            url = server.new_database()
        b = Node(model, home / "b", url, lease)
        try:
            results = {name: [one_round(model, home, url, lease, b, how) for _ in range(rounds)]
                       for name, how in (("kill", signal.SIGKILL), ("sigterm", signal.SIGTERM))}
        finally:
            b.stop()
            if server is not None:
                server.stop()
    return {"lease_s": lease, "rounds": rounds,
            "kill_to_next_event_s": summary([r["to_next_event_s"] for r in results["kill"]]),
            "sigterm_to_next_event_s": summary([r["to_next_event_s"] for r in results["sigterm"]]),
            "sigterm_to_exit_s": summary([r["to_exit_s"] for r in results["sigterm"]])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lease", type=float, default=2.0, help="the nodes' --store-lease (default 2 s)")
    parser.add_argument("--store", help="a PostgreSQL URL (a database it may fill); default: a server of its own")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    result = run(args.rounds, args.lease, args.store)
    print(f"takeover, lease {result['lease_s']:g} s, {result['rounds']} rounds (median, min to max):")
    for name, label in (("kill_to_next_event_s", "kill -9 -> the task's next event on node B"),
                        ("sigterm_to_next_event_s", "SIGTERM -> the task's next event on node B"),
                        ("sigterm_to_exit_s", "SIGTERM -> node A exited")):
        figure = result[name]
        print(f"  {label}: {figure['median']:.3f} s ({figure['min']:.3f} to {figure['max']:.3f})")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

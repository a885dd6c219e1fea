"""Measurements in child processes, taken in turns.

The speed of a shared virtual machine drifts, by up to 2x within minutes on ours, so
two engines measured one after the other compare only as well as the machine held
still in between. So each engine runs in a child process of its own (its threads,
memory and peak RSS are its own), loads its model once and then measures on request,
and the parent asks the engines in turns, round after round: every ratio compares
measurements taken seconds apart, and the best of the rounds counts for each.

The protocol is one line each way: the child prints its setup as a JSON line, then
answers each command line on its stdin with one JSON line, and exits after `finish`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable


class Worker:
    """The parent's side: a child process to send commands to."""

    def __init__(self, argv: list[str], job: dict | None = None, checkout: str | None = None):
        """`checkout`: run the child from that source tree instead of this one."""
        self.argv = argv
        self._stderr = tempfile.TemporaryFile(mode="w+")  # a file: a full pipe would block the child
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._stderr, text=True, **from_checkout(checkout))
        if job is not None:
            self._send(json.dumps(job))
        self.ready = self._receive()  # the child's setup figures

    def ask(self, command: str) -> dict:
        """Send one command, wait for its answer."""
        self._send(command)
        return self._receive()

    def close(self) -> None:
        """End the child: end of input is its signal to exit; killed if it does not within 30 s."""
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
            wait_or_kill(self.process)
        self._stderr.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, line: str) -> None:
        try:
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._failed() from None

    def _receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise self._failed()
        return json.loads(line)

    def _failed(self) -> RuntimeError:
        self.process.wait()
        self._stderr.seek(0)
        return RuntimeError(f"{' '.join(self.argv)} exited with {self.process.returncode}:\n{self._stderr.read()}")


def from_checkout(checkout: str | None) -> dict:
    """Popen arguments that run a child's `python -m ...` from another source tree: its
    working directory and the front of its import path, so its packages shadow the
    installed ones (benchmarks.perf --against compares two checkouts this way)."""
    if checkout is None:
        return {}
    root = str(Path(checkout).resolve())
    path = os.environ.get("PYTHONPATH")
    return {"cwd": root, "env": {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}}


def wait_or_kill(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """Wait for a child asked to exit; kill it if it has not within `timeout` seconds."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def take_stdout() -> Callable[[dict], None]:
    """The child's side, first thing: keep stdout for replies (anything else printed goes
    to stderr, so it cannot corrupt them) and return the function that sends a reply."""
    out = sys.stdout
    sys.stdout = sys.stderr

    def reply(figures: dict) -> None:
        out.write(json.dumps(figures) + "\n")
        out.flush()

    return reply


def serve(commands: dict[str, Callable[[], dict]], reply: Callable[[dict], None]) -> None:
    """Answer command lines from stdin until `finish` (answered, then done) or end of input."""
    for line in sys.stdin:
        command = line.strip()
        if command not in commands:
            raise ValueError(f"unknown command {command!r}; expected one of {sorted(commands)}")
        reply(commands[command]())
        if command == "finish":
            return

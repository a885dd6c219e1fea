"""benchmarks/worker.py: the one-line-each-way protocol the speed comparison takes turns over."""

import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.worker import Worker

CHILD = textwrap.dedent("""
    import json, sys
    from benchmarks import worker
    reply = worker.take_stdout()
    job = json.loads(sys.stdin.readline())
    print("a stray print goes to stderr, not into the replies")
    reply({"ready": job["name"]})
    count = iter(range(1, 100))
    worker.serve({"tick": lambda: {"tick": next(count)},
                  "fail": lambda: 1 / 0,
                  "finish": lambda: {"bye": True}}, reply)
""")


@pytest.fixture
def child(tmp_path, monkeypatch) -> list[str]:
    """The command line of a child that speaks the protocol (and can import benchmarks)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return [sys.executable, str(script)]


def test_commands_are_answered_in_turn_until_finish(child):
    with Worker(child, {"name": "one"}) as w:
        assert w.ready == {"ready": "one"}
        assert w.ask("tick") == {"tick": 1}
        assert w.ask("tick") == {"tick": 2}
        assert w.ask("finish") == {"bye": True}
        assert w.process.wait(timeout=10) == 0


def test_a_failing_child_raises_with_its_stderr(child):
    with Worker(child, {"name": "two"}) as w:
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            w.ask("fail")
    with Worker(child, {"name": "three"}) as w:
        with pytest.raises(RuntimeError, match="unknown command 'jump'"):
            w.ask("jump")


def test_closing_ends_the_child(child):
    w = Worker(child, {"name": "four"})
    w.close()
    assert w.process.poll() is not None

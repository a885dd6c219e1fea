"""Waiting in tests for what has happened, never for a guessed time.

    await wait_until(lambda: not server.service.http.connections, "the connection's slot freed")
    task = await wait_until(final_task, "the task final", seconds=30)   # an async condition's value
    wait_until_sync(lambda: healthy(port), "the server up", seconds=60)  # without a trio loop

A condition is polled, each time after a short real pause, and the test fails with
what it waited for once the deadline passes. The pause is real time on purpose:
what is waited for is often a thread's work (the engine's scheduler, a store's
reads and writes, a subprocess), which no trio clock moves. A test that waits for
time itself (an interval, a timeout, a retention) takes pytest-trio's
`autojump_clock` fixture instead, and trio's virtual clock jumps to the next
deadline as soon as every task is blocked.

Where next: tests/server_harness.py, the real server most of these waits are about.
"""

import inspect
import time

import pytest
import trio

PAUSE = 0.005  # real seconds between two looks at a condition (`every` for a costly one: a request)


async def wait_until(condition, what: str, seconds: float = 30, every: float = PAUSE):
    """The first true value of `condition()` (a function, or an async one), looked at
    every `every` seconds; the test fails after `seconds` saying `what` did not happen."""
    with trio.move_on_after(seconds):
        while not (value := await _value_of(condition)):
            await trio.sleep(every)  # (real time: the condition may wait on a thread)
        return value
    pytest.fail(f"{what}: not within {seconds} s")


async def _value_of(condition):
    value = condition()
    return await value if inspect.isawaitable(value) else value


def wait_until_sync(condition, what: str, seconds: float = 30, every: float = PAUSE):
    """`wait_until` for a test without a trio loop (a subprocess, a helper process):
    `condition` may raise to fail at once (a process that died meanwhile)."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(every)  # (real time: a process of its own, no event loop to wait on)
    return value

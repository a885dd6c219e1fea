"""Tasks (D3): responses generated in the background, whose events any number of
clients follow and resume.

The rule that makes resuming exact: an event reaches followers only after it is
in the database. A running task's `LiveLog` hands each new event to a writer
that commits whatever accumulated since its last commit (group commit: one
transaction for many events when the database is the bottleneck, one per event
when it is not) and only then publishes the batch to followers. Followers wake on
one `trio.Event` per batch (a broadcast), read from the in-memory list of
committed events, and never touch the generation: a follower that stalls or
disconnects only loses its own place.
"""

from __future__ import annotations

from typing import AsyncIterator

import trio

from lmsp_min.store import LoggedEvent, Store

# D3: "at least every 15 seconds" while a stream is idle.
KEEPALIVE_INTERVAL = 15.0


class LiveLog:
    """The event log of one running task, shared by its runner and its followers."""

    def __init__(self, store: Store, task_id: str):
        self.store = store
        self.task_id = task_id
        self.events: list[LoggedEvent] = []  # committed events; events[i].seq == i + 1
        self.done = False  # the final event is committed (or the task died without one)
        self._published = trio.Event()  # set (and replaced) each time events are published
        self._pending: list[LoggedEvent] = []  # appended, not yet committed
        self._wake_writer = trio.Event()
        self._closing = False
        self._writer_idle = trio.Event()
        self._next_seq = 1

    # -- the runner's side --------------------------------------------------------

    def append(self, event: str, data: str) -> int:
        """Queue an event (its `data` is JSON text) for the log; returns its seq."""
        seq = self._next_seq
        self._next_seq += 1
        self._pending.append(LoggedEvent(seq, event, data))
        self._wake_writer.set()
        return seq

    async def write_loop(self) -> None:
        """Commit and publish appended events until `finish` closes the log.
        Run it beside the generation, in the runner's nursery."""
        while True:
            await self._wake_writer.wait()
            self._wake_writer = trio.Event()
            while self._pending:
                batch, self._pending = self._pending, []
                await self.store.append_events(self.task_id, batch)
                self._publish(batch)
            if self._closing:
                self._writer_idle.set()
                return

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def finish(self, status: str, response: str, event: str, data: str,
                     stored: tuple[str, list] | None = None) -> None:
        """Commit the final event with the task's final status and response in one
        durable transaction (after every event before it), then publish it."""
        self._closing = True
        self._wake_writer.set()
        await self._writer_idle.wait()
        final = LoggedEvent(self._next_seq, event, data)
        self._next_seq += 1
        await self.store.finish_task(self.task_id, status, response, [final], stored)
        self.done = True
        self._publish([final])

    def abandon(self) -> None:
        """The runner died without a final event (the database failed): release
        followers so that no stream hangs."""
        self.done = True
        self._published.set()

    def _publish(self, batch: list[LoggedEvent]) -> None:
        self.events.extend(batch)
        self._published.set()
        self._published = trio.Event()

    # -- a follower's side --------------------------------------------------------

    async def follow(self, after: int) -> AsyncIterator[LoggedEvent | None]:
        """Committed events with seq > `after`, then live ones, until the final one.
        Yields None when nothing happened for KEEPALIVE_INTERVAL seconds."""
        cursor = after  # index in self.events of the next event to yield
        while True:
            if cursor < len(self.events):
                yield self.events[cursor]
                cursor += 1
                continue
            if self.done:
                return
            published = self._published
            with trio.move_on_after(KEEPALIVE_INTERVAL) as idle:
                await published.wait()
            if idle.cancelled_caught:
                yield None

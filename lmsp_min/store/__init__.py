"""The durable store's interface: what the service keeps, and the operations on it.

Stored responses, tasks, their event logs and idempotency records live behind `Store`, with two
backends (open.py opens one): SQLite (sqlite.py), the default, whose directory several processes on
one machine may share; PostgreSQL (postgres.py), which several machines share (docs/scale-out.md).
The task, conversation and idempotency logic (tasks.py, idempotency.py, service.py) is written once,
above it; what differs per backend is said here as operations: how a process knows another is gone
(`owner`, `interrupted_tasks`, `release_abandoned_keys`: an flock on one machine, a lease across
machines), how it learns of a change another made (`watch`, `next_cancel_requests`: polling
SQLite, LISTEN/NOTIFY in PostgreSQL), and whether a node takes over what another left
(`takes_over`, `claim_task`, `hand_over_task`: PostgreSQL's nodes do; SQLite's one node fails it).

Every database call runs in a worker thread: the trio loop never waits on a database. One that
cannot reach it or outlasts `--store-timeout` raises lmsp_min/problems.py's `unavailable()`, a
write that finds the disk full `disk_full()` (reads go on): 503s, never a request held for as long
as the fault lasts.

Next: lmsp_min/store/sql.py, the operations written once in SQL for both.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import trio


FINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})

# How often a follower looks for new events, and a process running tasks for cancels,
# when the backend cannot say (SQLite: another process may write at any time).
POLL_INTERVAL = 0.05
CANCEL_POLL_INTERVAL = 0.25
# How long one store call may take (--store-timeout) before its request is a 503: a healthy
# database answers in milliseconds, so a call this slow waits on a fault (a lock held, a frozen
# or partitioned server) that a client had better retry than sit through.
STORE_TIMEOUT = 5.0


class StoreError(ValueError):
    """The database cannot be opened (a ValueError: `lmsp-min serve` prints it and stops)."""


class TaskTakenOver(RuntimeError):
    """Another node took this task over (this node's lease had expired): what this one writes is refused."""


@dataclass(frozen=True)
class StoredResponse:
    id: str
    principal: str
    input: list  # the effective input items
    body: str  # the response object's JSON, exactly as served

    @property
    def output(self) -> list:
        return json.loads(self.body)["output"]


@dataclass(frozen=True)
class TaskRow:
    id: str
    principal: str
    owner: str  # the Store that runs (or ran) it
    created_at: int
    model: str
    response_id: str
    status: str
    request: str  # JSON of the request's parameters (the body without its input)
    response: str | None  # JSON of the final response object, once final
    ended_at: float | None
    events_expired: bool

    def object(self) -> dict:
        """The task object of D3."""
        response = json.loads(self.response) if self.response is not None else None
        return {"id": self.id, "object": "task", "status": self.status, "created_at": self.created_at,
                "response_id": self.response_id, "response": response}


@dataclass(frozen=True)
class LoggedEvent:
    seq: int  # the SSE id, from 1
    event: str
    data: str  # the event's JSON text
    # JSON {"ids": [...], "draws": n}: the output token ids this event brought and the sampler's
    # draws after them, for a node that takes the task over (written, never read back with it)
    tokens: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class IdempotencyRecord:
    fingerprint: str
    state: str  # "running" | "done"
    status: int | None
    content_type: str | None
    body: bytes | None
    task_id: str | None


class Watch:
    """What a follower waits on between two reads: `wait` returns once the backend `notify`s it (a notice
    that came during the read is kept), or after POLL_INTERVAL while `told()` says none can come."""

    def __init__(self, told: Callable[[], bool] = lambda: False):
        self._told = told
        self._changed = trio.Event()

    def notify(self) -> None:
        self._changed.set()

    async def wait(self, timeout: float) -> None:
        if not self._told():
            timeout = min(timeout, POLL_INTERVAL)
        with trio.move_on_after(max(0.0, timeout)):
            await self._changed.wait()
        self._changed = trio.Event()


class Store(ABC):
    """The operations the service needs of its database. `owner` is this store's random id,
    recorded by the tasks and idempotency claims it runs: only the work of owners known to be
    gone is recovered by another. `persistent` is False for `--no-store`'s memory."""

    owner: str
    persistent: bool = True
    # Whether another node takes over the tasks of one that is gone (PostgreSQL), rather than
    # failing them: then a task's row keeps its request until it ends, and its events their tokens.
    takes_over: bool = False
    # Seconds within which an owner that is gone is known to be (a lease across machines);
    # infinite where it is known at once (the flock of a process that died).
    liveness_period: float = math.inf

    @property
    @abstractmethod
    def location(self) -> str:
        """Where the data is, for the service's banner (never a password)."""

    @abstractmethod
    def close(self) -> None:
        """Close the database connections (blocking: the service calls it in a worker thread)."""

    @abstractmethod
    async def put_response(self, response_id: str, principal: str, input_items: list, body: str) -> None:
        """Store a final response (`body` is its JSON as served), durably."""

    @abstractmethod
    async def get_response(self, response_id: str, principal: str) -> StoredResponse | None:
        """The stored response, or None if unknown or owned by another principal."""

    @abstractmethod
    async def delete_response(self, response_id: str, principal: str) -> bool:
        """Delete a stored response of `principal`; False if there was none."""

    @property
    def reachable(self) -> bool:
        """Whether the database answers (as far as this process knows without asking it)."""
        return True

    @abstractmethod
    async def create_task(self, task_id: str, principal: str, created_at: int, model: str,
                          response_id: str, request: str, resume: str | None = None) -> None:
        """A new task, `queued`, owned by this store (durably); `resume` what a taker needs, kept until it ends."""

    @abstractmethod
    async def set_task_status(self, task_id: str, status: str) -> None:
        """A non-final status change (queued -> in_progress)."""

    @abstractmethod
    async def append_events(self, task_id: str, events: list[LoggedEvent]) -> None:
        """Append events to a task's log in one transaction (survives a kill -9); followers are told.
        TaskTakenOver if this store no longer owns the task."""

    @abstractmethod
    async def finish_task(self, task_id: str, status: str, response: str, final_events: list[LoggedEvent],
                          stored: tuple[str, list] | None = None) -> bool:
        """End a task in one durable transaction: its last events, final status and response, and
        (`stored` = (principal, input items)) its stored response for `store: true`. False (nothing
        written) if it had already ended: two processes recovering it end it only once; False too
        if another owner, still alive, holds it (it took the task over)."""

    @abstractmethod
    async def get_task(self, task_id: str, principal: str | None) -> TaskRow | None:
        """The task, or None if unknown or (principal given) owned by another principal."""

    @abstractmethod
    async def get_task_of_response(self, response_id: str, principal: str) -> TaskRow | None:
        """The task that generates `response_id`, or None (the OpenAI dialect's background response)."""

    @abstractmethod
    async def read_events(self, task_id: str, after: int, limit: int | None = None) -> list[LoggedEvent]:
        """Up to `limit` (None: all) logged events with seq > `after`, in order, in one read."""

    def watch(self, task_id: str) -> AbstractContextManager[Watch]:
        """`with store.watch(task_id) as watch:` (before the first read), then read, `await watch.wait(t)`
        (it ends when the task may have changed, or after `t` seconds), read again..."""
        return nullcontext(Watch())

    @abstractmethod
    async def request_cancel(self, task_id: str) -> None:
        """Ask the process that runs a task to cancel it."""

    async def next_cancel_requests(self, running: Callable[[], bool] = lambda: True) -> list[str]:
        """Wait for cancels asked through other processes, then the ids of our unfinished tasks they
        named. Polled, only while `running()`: an idle server leaves the database alone."""
        while True:
            await trio.sleep(CANCEL_POLL_INTERVAL)
            if running():
                return await self.cancel_requests()

    @abstractmethod
    async def cancel_requests(self) -> list[str]:
        """The ids of our unfinished tasks that another process asked to cancel."""

    @abstractmethod
    async def interrupted_tasks(self, running: Callable[[str], bool] = lambda task_id: False
                                ) -> list[tuple[TaskRow, list[LoggedEvent]]]:
        """Tasks left unfinished by an owner that is gone, with their logs, and our own unfinished
        tasks not `running` (asked after the read: ours runs before its row exists)."""

    @abstractmethod
    async def claim_task(self, task_id: str, owner: str) -> tuple[str | None, list[LoggedEvent]] | None:
        """Make an unfinished task of `owner` (gone) ours: its `resume` and its events (their `tokens`
        too), in order; None if another process claimed it first, or it ended. Of processes racing,
        one wins."""

    @abstractmethod
    async def hand_over_task(self, task_id: str) -> bool:
        """Give an unfinished task of ours up, for another process to claim at once (it is told)."""

    async def wait_for_handover(self, timeout: float) -> None:
        """Wait `timeout` seconds, or less if another process handed tasks over meanwhile."""
        await trio.sleep(timeout)

    @abstractmethod
    async def delete_task(self, task_id: str, principal: str) -> bool:
        """Delete a final task of `principal` and its log in one transaction (its stored response stays);
        False if there is none, or it is not final (Tasks.delete says 409)."""

    @abstractmethod
    async def purge_stored(self, older_than: float) -> tuple[int, int]:
        """The --store-retention purge: delete the stored responses created, and the final tasks
        (with their logs) ended, at or before `older_than`. Returns (responses, tasks) deleted."""

    @abstractmethod
    async def purge(self, now: float, event_retention: float, idempotency_ttl: float) -> int:
        """Delete the events of tasks ended over `event_retention` seconds ago and the finished
        idempotency records older than `idempotency_ttl`; how many tasks lost their events."""

    @abstractmethod
    async def claim_idempotency_key(self, principal: str, key: str, fingerprint: str) -> IdempotencyRecord | None:
        """Claim `key`: None if this request now owns it (recorded running), else the owner's record."""

    @abstractmethod
    async def complete_idempotency_key(self, principal: str, key: str, *, status: int,
                                       content_type: str | None = None, body: bytes | None = None,
                                       task_id: str | None = None) -> None:
        """Record the result to replay for `key` (durably: the client sees it next)."""

    @abstractmethod
    async def release_idempotency_key(self, principal: str, key: str) -> None:
        """Forget a claim whose request produced nothing to replay, so that a retry runs again."""

    @abstractmethod
    async def release_abandoned_keys(self) -> int:
        """Release the claims of requests that died with their process, and ours that no request
        holds any more (it could neither complete nor release: a full disk). How many released."""

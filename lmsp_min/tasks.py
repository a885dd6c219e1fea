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

How a task ends: with its final event (completed, incomplete, failed, or
cancelled by POST /cancel). With SQLite, if the service stops while it runs, it
ends `failed` at once (`model_unavailable`, as a direct response would); if its
process dies (kill -9), the next start, or another process on the same data
directory (within RECOVER_INTERVAL), ends it `failed` (`generation_failed`,
usage unknown) from what its log holds; so does this process (`internal_error`)
if a failing write (a full disk) kept its runner from ending it.

Takeover (a PostgreSQL store, whose nodes share it): a node that is gone (its lease
expired) or drains (`stop`: it hands its tasks over) leaves its unfinished tasks to
the others; the first to claim one (`Store.claim_task`) continues it from its log.
The row keeps the request and its prompt's token ids until the task ends, each
logged event the output token ids it brought and the sampler's draws: the taker
prepares the request again, prefills the prompt and that output (engine/api.py
`Continuation`), makes again the events the log holds (checking that they are the
same, and giving the output items their logged ids), and logs those that follow
under the next ids. A greedy or seeded task gives the text it would have given. A node back
after its lease (frozen, cut off) finds its task another's: it publishes no event of its own
(`TaskTakenOver`), and its followers go on from the database. A task another
process runs (on this machine, or another node of a PostgreSQL store) is followed
from the database, woken by the store's `watch` when it has new events, and
cancelled by a request its owner is told of (lmsp_min/store/).

A task owns its generation (lmsp_min/generation.py `Generation`) from `Tasks.start` on:
its runner drives the generation's pump, which commits the final event to the log
(`LiveLog.finish`) before it goes out, and releases the generation's admission when it
ends, however it ends. Followers get batches of logged events; the routes frame them
as SSE (lmsp_min/sse.py), which keeps an idle stream alive. A runner that could not
commit any final event (its database lost, its disk full) cuts its followers' streams
(`StreamCut`): they resume with Last-Event-ID, and get the final event once the task
is recovered, rather than a clean end that tells them nothing more will come.

Reading on: lmsp_min/store/ keeps the log; lmsp_min/routes.py serves it.
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Awaitable, Callable

import trio

from engine.api import Continuation
from lmsp_min.events import FINAL_EVENTS, Event, ResponseRun, add_text, compact_json, new_id
from lmsp_min.generation import Generation, pump
from lmsp_min.http import StreamCut
from lmsp_min.idempotency import RECORD_TTL
from lmsp_min.problems import Problem, leaf_exceptions, shutting_down
from lmsp_min.store import FINAL_STATUSES, LoggedEvent, Store, StoreError, TaskRow, TaskTakenOver

# How often a follower of a task another process runs, told of nothing new, checks
# that the process is still alive (and takes the task over, or ends it `failed`, if it is not).
OWNER_CHECK_INTERVAL = 10.0
# How often tasks look for work a dead process, or a failed write, left unfinished
# (tasks still `in_progress`, idempotency keys still 'running'); more often when the
# store's leases are short, so that a dead node's tasks end soon after its lease.
RECOVER_INTERVAL = 5.0
# How long a cancel of a task another process runs waits for the task to end.
CANCEL_WAIT = 10.0
# How long stored responses and final tasks are kept by default (--store-retention).
STORE_RETENTION = 30 * 86400.0


class LiveLog:
    """The event log of one running task, shared by its runner and its followers."""

    def __init__(self, store: Store, task_id: str, logged: list[LoggedEvent] = ()):
        self.store = store
        self.task_id = task_id
        self.events: list[LoggedEvent] = list(logged)  # committed events (a continuation's first); seq == i + 1
        self.done = False  # the final event is committed (or the task died without one, or was handed over)
        self.handed_over = False  # the task goes on on another node: followers go on from the database
        self._published = trio.Event()  # set (and replaced) each time events are published
        self._pending: list[LoggedEvent] = []  # appended, not yet committed
        self._wake_writer = trio.Event()
        self._closing = False
        self._writer_idle = trio.Event()
        self._next_seq = len(self.events) + 1

    # -- the runner's side --------------------------------------------------------

    def append(self, event: LoggedEvent) -> None:
        """Queue the next event for the log (seqs run 1, 2, 3... without a gap)."""
        self._check_next(event)
        self._pending.append(event)
        self._wake_writer.set()

    def _check_next(self, event: LoggedEvent) -> None:
        if event.seq != self._next_seq:
            raise ValueError(f"task {self.task_id}: event {event.seq} logged after {self._next_seq - 1}")
        self._next_seq += 1

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

    async def finish(self, status: str, response: str, final: LoggedEvent,
                     stored: tuple[str, list] | None = None) -> None:
        """Commit the final event with the task's final status and response in one
        durable transaction (after every event before it), then publish it."""
        self._check_next(final)
        await self._close_writer()
        if not await self.store.finish_task(self.task_id, status, response, [final], stored):
            raise TaskTakenOver(_taken_from_us(self.task_id))  # (its final event is another node's)
        self.done = True
        self._publish([final])

    async def hand_over(self) -> None:
        """Commit what was appended, then close the log here: the task goes on on another node."""
        await self._close_writer()
        self.gone_elsewhere()

    def gone_elsewhere(self) -> None:
        """The task is another node's now (handed over, taken over or ended there): followers go
        on from the database."""
        self.handed_over = self.done = True
        self._published.set()

    async def _close_writer(self) -> None:
        self._closing = True
        self._wake_writer.set()
        await self._writer_idle.wait()

    def end(self, final: LoggedEvent) -> None:
        """Publish the final event of a runner that stopped early (its writer is gone):
        `final` is already in the database, right after the last published event."""
        assert final.seq == len(self.events) + 1
        self.done = True
        self._publish([final])

    def abandon(self) -> None:
        """The runner is gone (with or without a final event): release followers so
        that no stream hangs."""
        self.done = True
        self._published.set()

    def _publish(self, batch: list[LoggedEvent]) -> None:
        self.events.extend(batch)
        self._published.set()
        self._published = trio.Event()

    # -- a follower's side --------------------------------------------------------

    async def follow(self, after: int) -> AsyncIterator[list[LoggedEvent]]:
        """Committed events with seq > `after`, then live ones, until the final one:
        each time, all those not yet yielded (a late follower catches up in one
        batch). A log abandoned without a final event raises StreamCut: its
        follower must not take the end for the task's."""
        cursor = after  # index in self.events of the next event to yield
        while True:
            if cursor < len(self.events):
                batch = self.events[cursor:]
                cursor += len(batch)
                yield batch
                continue
            if self.done:
                if self.handed_over:
                    return  # (Tasks.events goes on from the database)
                if not self.events or self.events[-1].event not in FINAL_EVENTS:
                    raise StreamCut(f"task {self.task_id} stopped without a final event its database "
                                    "took; its followers resume once it is recovered")
                return
            await self._published.wait()


def logged(event: Event) -> LoggedEvent:
    """An event as the log keeps it: its data as the JSON text the streams send."""
    return LoggedEvent(event.id, event.name, compact_json(event.data))


@dataclass
class _Running:
    """A task this process is running."""

    task_id: str
    principal: str
    generation: Generation
    event_log: LiveLog
    logged_tokens: int = 0  # how many of the output token ids the log holds
    handing_over: bool = False  # stopped to be handed over (the service drains), not to end
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    ended: trio.Event = field(default_factory=trio.Event)


class _LoggedIds:
    """The ids of the output items and calls a task's log holds, given again in the order a
    `ResponseRun` makes them (a continuation's), then new ones."""

    def __init__(self, events: list[LoggedEvent]):
        self._ids: list[str] = []
        for event in events:
            if event.event == "response.output_item.added":
                item = json.loads(event.data)["item"]
                self._ids += [item["call_id"], item["id"]] if item["type"] == "function_call" else [item["id"]]
        self._ids.reverse()

    def __call__(self, prefix: str) -> str:
        if self._ids and self._ids[-1].startswith(prefix + "_"):
            return self._ids.pop()
        return new_id(prefix)


class Tasks:
    """Every task of the service: start, follow, cancel, delete, recover after a crash, expire.

    `run` (started in the service's nursery before it serves) first ends the
    tasks a dead process left running, then periodically purges what expired:
    finished tasks' events, and (--store-retention) stored responses and final tasks.
    Task runners live in the same nursery, never in a request's: the request
    that created a task, and every follower, can go away without touching it.
    """

    def __init__(self, store: Store, *, event_retention: float = 3600.0,
                 store_retention: float = STORE_RETENTION, stores_responses: bool = True, log=None,
                 prepare: Callable[[dict, str], Awaitable[Generation]] | None = None):
        self.store = store
        self._prepare = prepare  # (body, principal) -> its Generation, as the routes prepare one: a takeover's
        self.event_retention = event_retention
        self.store_retention = store_retention  # 0: stored responses and tasks are kept for ever
        self.clock = time.time  # the wall clock retention is measured by (a test moves it on)
        self.stores_responses = stores_responses
        self._log = log or (lambda line: None)
        self._running: dict[str, _Running] = {}
        self._taking_over: set[str] = set()  # claimed, being prepared to run here
        self._nursery: trio.Nursery | None = None
        self._stopping = False  # the service is stopping: running tasks are handed over, or end failed

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Recover, then host the task runners, recover and purge periodically, until cancelled."""
        retentions = [self.event_retention] + ([self.store_retention] if self.store_retention > 0 else [])
        purge_interval = min(60.0, max(0.5, min(retentions) / 4))
        recover_interval = min(RECOVER_INTERVAL, self.store.liveness_period / 2)
        next_purge = trio.current_time()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            damaged = await self._first_recovery(nursery)
            if damaged is None:
                if self.store.persistent:  # (another process can share only a database on disk)
                    nursery.start_soon(self._watch_cancel_requests)
                task_status.started()
            while damaged is None:
                if trio.current_time() >= next_purge:
                    next_purge = trio.current_time() + purge_interval
                    await self._attempt(self.purge, "purging what expired")
                await self.store.wait_for_handover(min(recover_interval, purge_interval))
                await self._attempt(self.recover, "recovering tasks")
        raise damaged

    async def _first_recovery(self, nursery: trio.Nursery) -> StoreError | None:
        """The first `recover`, whose runners live in `nursery`. A damaged database's
        StoreError (as for one that cannot open) is returned, the nursery cancelled, for
        `run` to raise as itself, not inside the nursery's exception group."""
        try:
            await self.recover()
        except StoreError as exc:
            nursery.cancel_scope.cancel()
            return exc
        return None

    async def _attempt(self, work, what: str) -> None:
        """One round of `run`'s work on the database: a failure (a full disk, no file
        descriptor left...) is logged, and tried again next round. Only the work is
        guarded: an error of the wait itself (of trio) ends `run` (catching it
        too made the loop spin at full speed, logging millions of lines)."""
        try:
            await work()
        except Exception as exc:
            self._log(f"error: {what} failed: {type(exc).__name__}: {exc}")

    # -- starting and running -----------------------------------------------------

    async def start(self, generation: Generation, body: dict) -> TaskRow:
        """Create a task for a prepared generation and start it.

        Once this returns, the task is in the database (durably) and running. The task
        owns the generation from the call on: its runner releases the generation's
        admission when it ends, and so does `start` itself when it cannot start it."""
        try:
            if self._nursery is None:
                raise RuntimeError("Tasks.run is not running: tasks cannot start")
            if self._stopping:
                raise shutting_down()
            return await self._start(generation, body)
        except BaseException:
            generation.release()
            raise

    async def _start(self, generation: Generation, body: dict) -> TaskRow:
        task_id = new_id("task")
        run = generation.run
        # The row keeps the request's parameters, never its input: the runner has the
        # input in memory, a task whose process died is failed rather than run again, and
        # a stored response keeps its own (docs/protocol.md D3). So a `store: false` task
        # leaves no prompt behind, and the row's size is not the input's. Where another
        # node may take it over, `resume` keeps the input too, until it ends.
        parameters = compact_json({name: value for name, value in body.items() if name != "input"})
        resume = (compact_json({"body": generation.body, "prompt_ids": generation.prepared.prompt_ids})
                  if self.store.takes_over and generation.body is not None else None)
        running = _Running(task_id, generation.principal, generation, LiveLog(self.store, task_id))
        self._running[task_id] = running
        # Shielded: once the row exists the task must run, even if the client that
        # asked for it has just gone away.
        with trio.CancelScope(shield=True):
            try:
                await self.store.create_task(task_id, generation.principal, run.created_at,
                                             run.model_id, run.id, parameters, resume)
            except BaseException:
                del self._running[task_id]
                raise
            try:
                self._nursery.start_soon(self._run, running)
            except RuntimeError:  # its nursery closed meanwhile: the service stopped at once
                await self._fail(running, _shutting_down())
                self._release(running)
                raise shutting_down() from None
        return TaskRow(task_id, generation.principal, self.store.owner, run.created_at, run.model_id,
                       run.id, "queued", parameters, None, None, False)

    async def _run(self, running: _Running) -> None:
        generation = running.generation
        run = generation.run
        event_log = running.event_log
        problem = _shutting_down()  # if it ends without its final event, unless the runner failed
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(event_log.write_loop)
                await self.store.set_task_status(running.task_id, "in_progress")
                final = await self._generate(running)
                if final is None:  # (stopped to be handed over: it goes on on another node)
                    await event_log.hand_over()
                    await self.store.hand_over_task(running.task_id)
                else:
                    await event_log.finish(run.status, compact_json(run.response_object()), final,
                                           self._stored(running))
        except BaseException as exc:
            # A bug or a failing database: the task fails, the service goes on. What fails
            # as a forced stop cancels the runner comes out of its nursery in one group with
            # that cancellation: the errors are the task's, the cancellation goes on alone.
            leaves = leaf_exceptions(exc)
            errors = [leaf for leaf in leaves if isinstance(leaf, Exception)]
            if not errors:
                raise
            if all(isinstance(error, TaskTakenOver) for error in errors):
                self._log(f"{errors[0]}: its followers here go on from the database")  # (frozen, or cut off, past its lease)
                event_log.gone_elsewhere()
            else:
                causes = "; ".join(f"{type(error).__name__}: {error}" for error in errors)
                self._log(f"error: task {running.task_id} failed: {causes}")
            problem = _runner_lost()
            if len(errors) < len(leaves):
                raise next(leaf for leaf in leaves if not isinstance(leaf, Exception)) from None
        finally:
            generation.release()  # (its events, if they started, released it already)
            if not event_log.done:
                # The runner failed, or was cancelled from outside (the service stopped at
                # once, without a drain): end the task now, from its committed events as a
                # restart would, so that the database says so at once and followers get a
                # final event.
                with trio.CancelScope(shield=True):
                    await self._fail(running, problem)
            self._release(running)

    async def _generate(self, running: _Running) -> LoggedEvent | None:
        """Pump the task's generation into its log up to its final event, which it returns
        for the runner to commit: the generation's own, or the ending of a runner that was
        cancelled (by POST /cancel, or by a stopping service: `stop`); None for one stopped
        to be handed over. A continuation's events that its log holds are made again, and
        must be the same."""
        run = running.generation.run
        event_log = running.event_log
        replayed = len(event_log.events)
        ending: list[Event] = []

        async def note(final: Event) -> None:
            ending.append(final)

        async def cut() -> None:
            if not running.handing_over:
                ending.append(run.failed(_shutting_down()) if self._stopping else run.cancelled())

        with running.cancel_scope:
            async with aclosing(pump(running.generation, note, cut)) as events:
                async for event in events:
                    if event.is_final:
                        continue
                    entry = logged(event)
                    if event.id > replayed:
                        event_log.append(self._with_tokens(running, entry))
                    elif entry != event_log.events[event.id - 1]:
                        raise RuntimeError(f"task {running.task_id}: its continuation differs from its log "
                                           f"at event {event.id}")
        return logged(ending[0]) if ending else None

    def _with_tokens(self, running: _Running, entry: LoggedEvent) -> LoggedEvent:
        """The event with the output token ids generated since the last logged one, where another
        node may take the task over."""
        counts = running.generation.prepared.counts
        if not self.store.takes_over or len(counts.output_ids) == running.logged_tokens:
            return entry
        ids = counts.output_ids[running.logged_tokens:]
        running.logged_tokens += len(ids)
        return LoggedEvent(entry.seq, entry.event, entry.data, compact_json({"ids": ids, "draws": counts.draws}))

    def _release(self, running: _Running) -> None:
        """The task has no runner any more: release its followers (if no final event could
        be published) and whoever waits for its end."""
        running.event_log.abandon()
        del self._running[running.task_id]
        running.ended.set()

    def _stored(self, running: _Running) -> tuple[str, list] | None:
        """(principal, effective input) when the task's response is to be stored (D6)."""
        generation = running.generation
        if generation.request.store and self.stores_responses:
            return running.principal, generation.input_items
        return None

    async def _fail(self, running: _Running, problem: Problem) -> None:
        """End a task whose runner cannot go on `failed`, if the database lets us. Its
        final event follows the last committed one, and its output is what the
        committed events hold (uncommitted ones were never seen); its usage, what the
        engine had counted. With `store: true` the failed response is stored, as a
        completed one would be."""
        event_log = running.event_log
        run = running.generation.run
        response, final = _failed_ending(run.id, run.created_at, run.model_id, event_log.events, problem,
                                         run.usage_so_far())
        try:
            if await self.store.finish_task(running.task_id, "failed", response, [final], self._stored(running)):
                event_log.end(final)
            else:  # (its runner failed on a store call that outlived this node's lease)
                self._log(f"{_taken_from_us(running.task_id)}: not failed here")
                event_log.gone_elsewhere()
        except Exception as exc:
            self._log(f"error: task {running.task_id} could not be marked failed: {exc}")

    # -- what routes ask ----------------------------------------------------------

    def is_running(self, task_id: str) -> bool:
        return task_id in self._running

    def _is_ours(self, task_id: str) -> bool:
        return task_id in self._running or task_id in self._taking_over

    async def get(self, task_id: str, principal: str) -> TaskRow:
        row = await self.store.get_task(task_id, principal)
        if row is None:
            raise Problem("task_not_found", f"no task has the id '{task_id[:80]}'")
        return row

    async def stop(self) -> None:
        """The service is stopping: hand every running task over to the other nodes (a store whose
        nodes take over), else end it `failed` now (model_unavailable, as the direct responses it
        stops), each with its final event (its followers are still connected to receive it)."""
        self._stopping = True
        running = list(self._running.values())
        if self.store.takes_over:
            for task in running:
                task.handing_over = True
            if running:
                self._log(f"handing {len(running)} running task(s) over to the other nodes")
        elif running:
            self._log(f"{len(running)} running task(s) end failed: no other node can take them over "
                      f"(the store is {self.store.location})")
        for task in running:
            task.cancel_scope.cancel()
        for task in running:
            await task.ended.wait()

    async def cancel(self, task_id: str, principal: str) -> TaskRow:
        """Stop a running task and return it once it is `cancelled`; a final task
        is returned unchanged.

        A task another process runs is cancelled through the database: its owner
        is told (Store.next_cancel_requests); the answer waits for the task to end,
        for at most CANCEL_WAIT seconds.
        """
        row = await self.get(task_id, principal)
        running = self._running.get(task_id)
        if running is not None:
            running.cancel_scope.cancel()
            await running.ended.wait()
            return await self.get(task_id, principal)
        if row.status in FINAL_STATUSES:
            return row
        await self.recover()  # its process is dead, or it is ours and its runner is gone: failed
        row = await self.get(task_id, principal)
        if row.status in FINAL_STATUSES:
            return row
        with self.store.watch(task_id) as watch, trio.move_on_after(CANCEL_WAIT):
            await self.store.request_cancel(task_id)
            while row.status not in FINAL_STATUSES:
                await watch.wait(CANCEL_WAIT)
                row = await self.get(task_id, principal)
        return row

    async def delete(self, task_id: str, principal: str) -> None:
        """Delete a final task with its events (docs/protocol.md D3): a task still queued
        or running is `409 task_running`, to be cancelled first. Deleting must not stop
        work behind the back of those following it, nor race the runner's last write."""
        row = await self.get(task_id, principal)
        if row.status not in FINAL_STATUSES and task_id not in self._running:
            await self.recover()  # its process is dead, or it is ours and its runner is gone: failed
            row = await self.get(task_id, principal)
        if row.status not in FINAL_STATUSES:
            raise Problem("task_running", f"task '{task_id[:80]}' is {row.status}: cancel it before deleting it")
        if not await self.store.delete_task(task_id, principal):  # (deleted meanwhile)
            raise Problem("task_not_found", f"no task has the id '{task_id[:80]}'")

    async def _watch_cancel_requests(self) -> None:
        """Cancel the tasks we run that a cancel sent to another process asked for."""
        while True:
            try:
                requested = await self.store.next_cancel_requests(lambda: bool(self._running))
            except Exception as exc:
                self._log(f"error: looking for cancel requests failed: {type(exc).__name__}: {exc}")
                await trio.sleep(1.0)  # (the database is unreachable: not a busy loop)
                continue
            for task_id in requested:
                running = self._running.get(task_id)
                if running is not None:
                    running.cancel_scope.cancel()

    async def events(self, task_id: str, principal: str, after: int) -> AsyncIterator[list[LoggedEvent]]:
        """The logged events of a task after `after`, in batches, until its final event
        (GET /tasks/{id}/events; checks done before it starts: 404 for an unknown task or
        another principal's, 410 once expired)."""
        row = await self.get(task_id, principal)
        if row.events_expired or (
            row.ended_at is not None and self.clock() - row.ended_at > self.event_retention
        ):
            raise _history_expired(task_id)
        running = self._running.get(task_id)
        if running is not None:
            return self._live(running, after)
        if row.status not in FINAL_STATUSES and row.owner == self.store.owner:
            await self.recover()  # ours, but its runner is gone: it ends failed, with a final event
            row = await self.get(task_id, principal)
        if row.status not in FINAL_STATUSES:  # another process sharing the data directory runs it
            return self._from_database(task_id, after)
        # Final: what the log holds is all there is, read now in one read (one snapshot, which
        # an expiry purge cannot cut in the middle of a replay). Nothing read may mean a purge
        # since the check above: that is a 410 too, not an empty stream.
        events = await self.store.read_events(task_id, after)
        if not events and (await self.get(task_id, principal)).events_expired:
            raise _history_expired(task_id)
        return _replay(events)

    async def _live(self, running: _Running, after: int) -> AsyncIterator[list[LoggedEvent]]:
        """The events of a task this process runs, from its live log; if it is handed over
        meanwhile, from the database, as the other node continues it."""
        async with aclosing(running.event_log.follow(after)) as batches:
            async for batch in batches:
                yield batch
                after = batch[-1].seq
        if running.event_log.handed_over:
            async with aclosing(self._from_database(running.task_id, after)) as batches:
                async for batch in batches:
                    yield batch

    async def _from_database(self, task_id: str, after: int,
                             batch: int = 512) -> AsyncIterator[list[LoggedEvent]]:
        """The logged events after `after` of a task another process runs, read from
        the database each time the store's watch says there may be new ones, until the
        final event; it recovers the task if that process dies meanwhile (looked at
        after OWNER_CHECK_INTERVAL seconds without news). Once the task is final, what is
        left of its log is read at once."""
        follow = True
        quiet_until = trio.current_time() + OWNER_CHECK_INTERVAL  # (by the clock: reads take time too)
        with self.store.watch(task_id) as watch:
            while True:
                events = await self.store.read_events(task_id, after, batch if follow else None)
                if events:
                    yield events
                    after, quiet_until = events[-1].seq, trio.current_time() + OWNER_CHECK_INTERVAL
                    if events[-1].event in FINAL_EVENTS:
                        return
                if not follow:
                    return
                if len(events) < batch:
                    await watch.wait(quiet_until - trio.current_time())
                    if trio.current_time() >= quiet_until:
                        quiet_until = trio.current_time() + OWNER_CHECK_INTERVAL
                        await self.recover()  # (its process may have died)
                        row = await self.store.get_task(task_id, None)
                        follow = row is not None and row.status not in FINAL_STATUSES

    # -- crash recovery and expiry ------------------------------------------------

    async def recover(self) -> list[str]:
        """Take over, or end, the tasks a process that is gone left queued or in progress.

        Where the store's nodes take over, each is claimed (by one process of those that try)
        and continued here (`_continue`). One that cannot be (ours, whose runner is gone; one
        whose model or request this node cannot prepare; a SQLite store's) becomes `failed`
        with a problem saying why, and gets a final `response.failed` event, so followers of
        its (still readable) log close. Its usage is null: the counts went with the runner (or
        the process) that generated it. A stopping service takes nothing over."""
        if self._stopping:
            return []
        recovered = []
        # (one that ends meanwhile is final in the database, which finish_task checks)
        for row, events in await self.store.interrupted_tasks(self._is_ours):
            if row.owner != self.store.owner and self.store.takes_over:
                claimed = await self.store.claim_task(row.id, row.owner)
                if claimed is None:
                    continue  # (another took it first, or it ended)
                resume, events = claimed
                if await self._continue(row, events, resume):
                    continue
            problem = _process_died() if row.owner != self.store.owner else _runner_lost()
            response, final = _failed_ending(row.response_id, row.created_at, row.model, events, problem)
            # Not kept as a stored response even with `store: true`: the effective
            # input died with the process; the task object keeps the response.
            if await self.store.finish_task(row.id, "failed", response, [final]):
                recovered.append(row.id)
                self._log(f"task {row.id} was left unfinished ({problem.detail}): marked failed")
        await self.store.release_abandoned_keys()
        return recovered

    async def _continue(self, row: TaskRow, events: list[LoggedEvent], resume: str | None) -> bool:
        """Run here a task claimed from a process that is gone, from its last logged event;
        False (logged) if this node cannot."""
        if resume is None:  # (an older lmsp-min's)
            self._log(f"task {row.id} cannot be taken over: its row holds no request to continue from")
            return False
        if self._prepare is None or self._nursery is None:  # (`recover` called outside `run`)
            return False
        self._taking_over.add(row.id)
        try:
            generation = await self._prepared_again(row, events, json.loads(resume))
            running = _Running(row.id, row.principal, generation, LiveLog(self.store, row.id, events),
                               logged_tokens=len(generation.prepared.continuation.output_ids))
            self._running[row.id] = running
        except Problem as problem:
            self._log(f"task {row.id} cannot be taken over here: {problem.detail}")
            return False
        finally:
            self._taking_over.discard(row.id)
        if self._stopping:  # (the service began to drain meanwhile: it goes on elsewhere)
            del self._running[row.id]
            generation.release()
            await self.store.hand_over_task(row.id)
            return True
        self._nursery.start_soon(self._run, running)
        self._log(f"task {row.id} taken over (from {row.owner}) after its event {len(events)}")
        return True

    async def _prepared_again(self, row: TaskRow, events: list[LoggedEvent], state: dict) -> Generation:
        """The generation of a task taken over: its request prepared again, its logged prompt and
        output to go on from, its response's id, creation time and output item ids as logged."""
        generation = await self._prepare(state["body"], row.principal)
        try:
            progress = [json.loads(event.tokens) for event in events if event.tokens is not None]
            continuation = Continuation(tuple(token for step in progress for token in step["ids"]),
                                        progress[-1]["draws"] if progress else 0)
            prepared = replace(generation.prepared, prompt_ids=state["prompt_ids"], continuation=continuation)
            run = ResponseRun(row.model, response_id=row.response_id, log=self._log, counts=prepared.counts,
                              created_at=row.created_at, item_ids=_LoggedIds(events))
            return replace(generation, prepared=prepared, run=run)
        except BaseException:
            generation.release()
            raise

    async def purge(self) -> None:
        """Expire finished tasks' events, idempotency records and (--store-retention)
        stored responses and final tasks, by `clock`."""
        now = self.clock()
        await self.store.purge(now, self.event_retention, RECORD_TTL)
        if self.store_retention > 0:
            await self.store.purge_stored(now - self.store_retention)


async def _replay(events: list[LoggedEvent]) -> AsyncIterator[list[LoggedEvent]]:
    """A final task's events, read beforehand, as one batch."""
    if events:
        yield events


def _history_expired(task_id: str) -> Problem:
    return Problem("event_history_expired",
                   f"the events of task '{task_id}' are no longer kept; GET the task for its result")


def _failed_ending(response_id: str, created_at: int, model: str, events: list[LoggedEvent],
                   problem: Problem, usage: dict | None = None) -> tuple[str, LoggedEvent]:
    """The failed response (JSON) and final event of a task whose runner could not end it:
    its output is what its logged events hold; its usage, if known, what was counted."""
    error = problem.to_dict()
    response = {"id": response_id, "object": "response", "created_at": created_at, "status": "failed",
                "model": model, "output": output_from_events(events), "usage": usage, "error": error,
                "incomplete_details": None}
    final = LoggedEvent((events[-1].seq if events else 0) + 1, "response.failed",
                        compact_json({"response_id": response_id, "status": "failed", "error": error}))
    return compact_json(response), final


def _taken_from_us(task_id: str) -> str:
    return f"task {task_id} was taken over by another node, or ended by it (this node's lease expired)"


def _shutting_down() -> Problem:
    """D1: the service is shutting down (503), as for a direct response it stops."""
    return shutting_down("the service is shutting down; the events of this task until now are kept")


def _process_died() -> Problem:
    return Problem("generation_failed",
                   "the service stopped while this task was running; its events up to then are kept")


def _runner_lost() -> Problem:
    return Problem("internal_error", "the task stopped on an unexpected error; its events up to then are kept")


def output_from_events(events: list[LoggedEvent]) -> list[dict]:
    """The output items as a follower of these events knows them: complete items
    as done, an item cut short with the text its deltas had brought."""
    items: list[dict] = []
    by_id: dict[str, dict] = {}
    for event in events:
        data = json.loads(event.data)
        if event.event in ("response.output_item.added", "response.output_item.done"):
            index = data["output_index"]
            items[len(items):index + 1] = [{}] * (index + 1 - len(items))
            items[index] = data["item"]
            by_id[data["item"]["id"]] = data["item"]
        elif event.event in ("response.output_text.delta", "response.reasoning_summary_text.delta"):
            add_text(by_id[data["item_id"]], data["delta"])
    return items

"""A running task's LiveLog on its own: commit before publish, fan-out, resume, keep-alive."""

import json

import pytest
import trio

from lmsp_min.http import StreamCut
from lmsp_min.store import LoggedEvent, Store
from lmsp_min.store.sqlite import SQLiteStore
from lmsp_min.tasks import LiveLog
from waiting import wait_until


@pytest.fixture
async def store(tmp_path):
    s = await SQLiteStore.open(tmp_path)
    await s.create_task("task_1", "alice", 0, "tiny:llama", "resp_1", "{}")
    yield s
    s.close()


async def run_task(log: LiveLog, n: int, pause: float = 0.0) -> None:
    """A stand-in runner: n delta events, then the final one."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.write_loop)
        for i in range(n):
            log.append(LoggedEvent(i + 1, "response.output_text.delta", json.dumps({"delta": f"{i} "})))
            await trio.sleep(pause)  # (a generation's pace: the scenario, not a wait)
        await log.finish("completed", '{"id":"resp_1","status":"completed"}',
                         LoggedEvent(n + 1, "response.completed", '{"status":"completed"}'))


async def collect(log: LiveLog, after: int, store: Store) -> list:
    seen = []
    async for batch in log.follow(after):
        for event in batch:
            # an event is never seen before it is in the database
            assert (await store.read_events("task_1", event.seq - 1, limit=1))[0] == event
            seen.append(event)
    return seen


async def test_followers_see_committed_events_in_order(store):
    log = LiveLog(store, "task_1")
    results = {}

    async def follower(name, after):
        results[name] = await collect(log, after, store)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(follower, "early", 0)
        nursery.start_soon(run_task, log, 30, 0.001)
        await wait_until(lambda: len(log.events) >= 7, "7 events committed")
        nursery.start_soon(follower, "resumed", 7)
    assert [e.seq for e in results["early"]] == list(range(1, 32))
    assert [e.seq for e in results["resumed"]] == list(range(8, 32))
    assert results["early"][-1].event == "response.completed"
    assert (await store.get_task("task_1", None)).status == "completed"
    # after the end, a new follower replays everything and closes at once
    assert [e.seq for e in await collect(log, 0, store)] == list(range(1, 32))
    assert await collect(log, 31, store) == []


async def test_a_stalled_follower_does_not_hold_the_task(store):
    log = LiveLog(store, "task_1")
    stalled = log.follow(0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_task, log, 100)
        assert (await stalled.__anext__())[0].seq == 1
        # ...and the follower reads no further: the task still runs to its end
    await stalled.aclose()
    assert (await store.get_task("task_1", None)).status == "completed"
    assert len(await store.read_events("task_1", 0)) == 101


async def test_fast_generation_is_group_committed(store):
    log = LiveLog(store, "task_1")
    commits = 0
    append = store.append_events

    async def counting_append(task_id, events):
        nonlocal commits
        commits += 1
        await append(task_id, events)

    store.append_events = counting_append
    await run_task(log, 500)  # no pause: events pile up while a commit runs
    assert len(await store.read_events("task_1", 0)) == 501
    assert commits < 500


async def follow_into(seen: list, log: LiveLog, after: int) -> None:
    """Follow the log from `after`, noting each event."""
    async for batch in log.follow(after):
        seen.extend(batch)


async def test_abandoning_a_log_without_a_final_event_cuts_its_followers(store):
    """Released, and told the log has no end: their streams are cut, not ended as if complete."""
    log = LiveLog(store, "task_1")
    seen = []
    released = trio.Event()

    async def follower() -> None:
        with pytest.raises(StreamCut, match="task_1"):
            await follow_into(seen, log, 0)
        released.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(log.write_loop)
            nursery.start_soon(follower)
            log.append(LoggedEvent(1, "response.created", "{}"))
            with pytest.raises(ValueError):
                log.append(LoggedEvent(3, "response.output_text.delta", "{}"))
            await wait_until(lambda: len(seen) == 1, "the first event")
            log.abandon()
            await released.wait()  # the follower's stream is cut
            nursery.cancel_scope.cancel()
    assert [event.seq for event in seen] == [1]

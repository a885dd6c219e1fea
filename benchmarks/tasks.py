"""Task event logs: how fast events are written, replayed, and followed.

    python -m benchmarks.tasks [--events N] [--json FILE]

- log write, events/s: a runner appends events as fast as it can; the LiveLog
  group-commits them (one transaction per batch that piled up during the last
  commit). Also one transaction per event, awaited, as a floor.
- replay, events/s and MB/s: a finished task's events read back from SQLite
  and encoded as SSE, as GET /tasks/{id}/events does for a finished task.
- follow latency: events produced at a steady pace (like a model decoding at
  `--rate` tokens/s); for each event, the time from its production to a
  follower holding its SSE bytes, through append -> commit -> publish -> wake
  -> encode, against the same event written straight to SSE (a direct stream).
  The socket write after that is the same for both and not counted. The
  difference is the price of a resumable, durable stream (aim: < 1 ms/event).

Everything runs on a fresh database in a temporary directory on the same disk
as the default data directory would be (the fsyncs of durable commits are real).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import trio

from lmsp_min.store import LoggedEvent, Store
from lmsp_min.tasks import LiveLog, Tasks, sse

DELTA = json.dumps({"response_id": "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF",
                    "item_id": "msg_01J8M6Q4W5C8H2K9P3S7Y1A6ZE", "delta": " word"},
                   separators=(",", ":"))


def delta(seq: int) -> LoggedEvent:
    return LoggedEvent(seq, "response.output_text.delta", DELTA)


async def new_task(store: Store, task_id: str) -> LiveLog:
    await store.create_task(task_id, "bench", 0, "bench:model", "resp_" + task_id, "{}")
    return LiveLog(store, task_id)


async def write_rate(store: Store, n: int) -> dict:
    log = await new_task(store, "task_write")
    commits = 0
    append = store.append_events

    async def counting(task_id, events):
        nonlocal commits
        commits += 1
        await append(task_id, events)

    store.append_events = counting
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.write_loop)
        for seq in range(1, n + 1):
            log.append(delta(seq))
            if seq % 8 == 0:
                await trio.sleep(0)  # let the writer run, as a real runner's awaits do
        await log.finish("completed", "{}", LoggedEvent(n + 1, "response.completed", "{}"))
    seconds = time.perf_counter() - started
    store.append_events = append
    return {"events_per_s": (n + 1) / seconds, "commits": commits}


async def write_rate_one_per_commit(store: Store, n: int) -> float:
    await store.create_task("task_single", "bench", 0, "bench:model", "resp_single", "{}")
    started = time.perf_counter()
    for seq in range(1, n + 1):
        await store.append_events("task_single", [delta(seq)])
    return n / (time.perf_counter() - started)


async def replay_rate(store: Store, task_id: str, tasks: Tasks) -> dict:
    started = time.perf_counter()
    size = events = 0
    async for chunk in tasks._replay(task_id, 0):
        size += len(chunk)
        events += chunk.count(b"\n\n")
    seconds = time.perf_counter() - started
    return {"events_per_s": events / seconds, "mb_per_s": size / seconds / 1e6}


async def follow_latency(store: Store, n: int, rate: float) -> dict:
    """Per-event latency (ms) from production to SSE bytes: followed vs direct."""
    log = await new_task(store, "task_follow")
    produced: dict[int, float] = {}
    followed: list[float] = []
    direct: list[float] = []

    async def follower():
        async for event in log.follow(0):
            if event is not None:
                sse(event)
                if event.seq in produced:
                    followed.append(time.perf_counter() - produced[event.seq])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.write_loop)
        nursery.start_soon(follower)
        period = 1.0 / rate
        for seq in range(1, n + 1):
            event = delta(seq)
            produced[seq] = t = time.perf_counter()
            sse(event)  # what a direct stream does with it
            direct.append(time.perf_counter() - t)
            log.append(event)
            await trio.sleep(period)
        await log.finish("completed", "{}", LoggedEvent(n + 1, "response.completed", "{}"))
    ms = lambda values: sorted(v * 1000 for v in values)  # noqa: E731
    f, d = ms(followed), ms(direct)
    return {
        "followed_p50_ms": statistics.median(f), "followed_p99_ms": f[int(len(f) * 0.99) - 1],
        "direct_p50_ms": statistics.median(d),
        "added_mean_ms": statistics.fmean(f) - statistics.fmean(d),
    }


async def main(n: int, rate: float) -> list[dict]:
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        store = await Store.open(tmp)
        tasks = Tasks(store)
        try:
            write = await write_rate(store, n)
            single = await write_rate_one_per_commit(store, min(n, 2000))
            replay = await replay_rate(store, "task_write", tasks)
            follow = await follow_latency(store, min(n, 1000), rate)
        finally:
            store.close()
    return [
        {"name": "task log write (group commit)", "value": round(write["events_per_s"]),
         "unit": "events/s", "events": n, "commits": write["commits"]},
        {"name": "task log write (one commit per event)", "value": round(single), "unit": "events/s"},
        {"name": "task log replay", "value": round(replay["events_per_s"]), "unit": "events/s",
         "mb_per_s": round(replay["mb_per_s"], 1)},
        {"name": "follow vs direct stream, added latency", "value": round(follow["added_mean_ms"], 3),
         "unit": "ms/event", "rate": rate,
         "followed_p50_ms": round(follow["followed_p50_ms"], 3),
         "followed_p99_ms": round(follow["followed_p99_ms"], 3),
         "direct_p50_ms": round(follow["direct_p50_ms"], 4)},
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20000, help="events written and replayed")
    parser.add_argument("--rate", type=float, default=500.0, help="events/s produced while followed")
    parser.add_argument("--json", type=Path, help="write the rows here (benchmarks/run.py)")
    args = parser.parse_args()
    rows = trio.run(main, args.events, args.rate)
    for row in rows:
        extra = "  ".join(f"{k}={v}" for k, v in row.items() if k not in ("name", "value", "unit"))
        print(f"{row['name']:<42} {row['value']:>10} {row['unit']:<9} {extra}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))

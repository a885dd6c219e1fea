"""Task event logs: how fast events are written, replayed, and followed, per store backend.

    python -m benchmarks.tasks [--events N] [--backend sqlite|postgres|both] [--store URL] [--json FILE]

- log write, events/s: a runner appends events as fast as it can; the LiveLog
  group-commits them (one transaction per batch that piled up during the last
  commit). Also one transaction per event, awaited, as a floor.
- replay, events/s and MB/s: a finished task's events read back from SQLite
  and encoded as SSE, as GET /tasks/{id}/events does for a finished task.
- follow latency, in process: events produced at a steady pace (like a model
  decoding at `--rate` tokens/s); for each event, the time from its production
  to a follower holding its SSE bytes, through append -> commit -> publish ->
  wake -> encode, against the same event written straight to SSE.
- follow latency, over HTTP: the whole service on a loopback port with a
  scripted model that emits its own clock as text at `--rate` tokens/s; a
  client reads the deltas of a direct stream (POST /responses, stream: true)
  and of a followed task (POST /tasks, GET /tasks/{id}/events) and measures,
  per delta, the time from the model yielding it to the client reading it.
  The difference is the price of a resumable, durable stream (aim: < 1 ms/event).
  Its median is the figure: on a shared machine the mean carries the scheduler's
  hiccups (a thread hop per commit waits for a core), and is shown beside it.
- PostgreSQL (`--backend postgres`): the same write and replay figures, and the
  follow latency across nodes: two PostgresStores on one database stand for two
  nodes; node A runs the task (its LiveLog), node B follows it as
  GET /tasks/{id}/events does for a task another node runs (commit -> NOTIFY ->
  B's listener thread -> its watch -> read -> SSE). The figure is B's median
  latency minus that of a follower on A itself: the price of following from
  another node (aim: < 5 ms/event). Then the same over HTTP: two services on one
  database, each on its loopback port, the scripted model on A; one client
  follows the task on A, another on B, and per delta the difference of their
  medians is the figure.

SQLite runs on a fresh database in a temporary directory on the same disk as
the default data directory would be (the fsyncs of durable commits are real).
PostgreSQL runs on `--store URL` (a database it may fill), else on a throw-away
server in a temporary directory (tests/pg_server.py, with fsync on), over its
unix socket.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import types
from pathlib import Path

import trio

from lmsp_min.store import LoggedEvent, Store
from lmsp_min.store.open import open_store
from lmsp_min.store.sqlite import SQLiteStore
from lmsp_min.routes import message
from lmsp_min.tasks import LiveLog, Tasks

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
    rate = n / (time.perf_counter() - started)
    # (ended, so that a service opened on this database later has nothing to recover)
    await store.finish_task("task_single", "completed", "{}", [LoggedEvent(n + 1, "response.completed", "{}")])
    return rate


async def replay_rate(store: Store, task_id: str, tasks: Tasks) -> dict:
    started = time.perf_counter()
    size = events = 0
    async for batch in await tasks.events(task_id, "bench", 0):
        chunk = b"".join(message(event) for event in batch)  # what the route sends
        size += len(chunk)
        events += len(batch)
    seconds = time.perf_counter() - started
    return {"events_per_s": events / seconds, "mb_per_s": size / seconds / 1e6}


async def follow_in_process(log: LiveLog, produced: dict[int, float], latencies: list[float]) -> None:
    """Follow a live log as a stream of its own process does, noting for each event the
    seconds since it was produced (`produced`: perf_counter() by sequence number)."""
    async for batch in log.follow(0):
        for event in batch:
            message(event)
            if event.seq in produced:
                latencies.append(time.perf_counter() - produced[event.seq])


async def follow_latency(store: Store, n: int, rate: float) -> dict:
    """Per-event latency (ms) from production to SSE bytes: followed vs direct."""
    log = await new_task(store, "task_follow")
    produced: dict[int, float] = {}
    followed: list[float] = []
    direct: list[float] = []

    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.write_loop)
        nursery.start_soon(follow_in_process, log, produced, followed)
        period = 1.0 / rate
        for seq in range(1, n + 1):
            event = delta(seq)
            produced[seq] = t = time.perf_counter()
            message(event)  # what a direct stream does with it
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


async def follow_latency_across_nodes(node_a: Store, node_b: Store, n: int, rate: float) -> dict:
    """Per-event latency (ms) from production on node A to SSE bytes on node B, and to a
    follower on node A itself."""
    log = await new_task(node_a, "task_across")
    produced: dict[int, float] = {}
    across: list[float] = []
    same_node: list[float] = []
    batches = await Tasks(node_b).events("task_across", "bench", 0)  # (B does not run it: from the database)

    async def on_b():
        async for batch in batches:
            b"".join(message(event) for event in batch)  # what the route sends
            now = time.perf_counter()
            for event in batch:
                if event.seq in produced:
                    across.append(now - produced[event.seq])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.write_loop)
        nursery.start_soon(follow_in_process, log, produced, same_node)
        nursery.start_soon(on_b)
        period = 1.0 / rate
        for seq in range(1, n + 1):
            produced[seq] = time.perf_counter()
            log.append(delta(seq))
            await trio.sleep(period)
        await log.finish("completed", "{}", LoggedEvent(n + 1, "response.completed", "{}"))
    ms = lambda values: sorted(v * 1000 for v in values)  # noqa: E731
    b, a = ms(across), ms(same_node)
    return {"across_p50_ms": statistics.median(b), "across_p99_ms": b[int(len(b) * 0.99) - 1],
            "same_node_p50_ms": statistics.median(a), "across_mean_ms": statistics.fmean(b),
            "same_node_mean_ms": statistics.fmean(a)}


class ScriptedModel:
    """Stands in for an engine model: `max_tokens` deltas at `rate` per second, each
    holding the perf_counter() at which it was yielded."""

    def __init__(self, rate: float):
        self.period = 1.0 / rate
        self.scheduler = types.SimpleNamespace(max_batch=8)  # as many generate at once as the registry lets

    def prepare_chat(self, request):
        from engine.api import TokenCounts

        request.input_tokens = 1
        request.prompt_ids = [1]  # (what a task's row keeps for a takeover, on PostgreSQL)
        request.counts = TokenCounts(1)
        return request

    async def generate_chat(self, prepared):
        from engine.api import Finished, TextDelta

        for _ in range(prepared.max_tokens):
            await trio.sleep(self.period)
            yield TextDelta(f"{time.perf_counter()!r};")
        yield Finished("length", 1, prepared.max_tokens, 0)


async def http_deltas(port: int, method: str, path: str, body: dict | None) -> list[float]:
    """Per text delta of the SSE body at `path`: now minus the clock the model put in it."""
    import h11

    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    data = json.dumps(body).encode() if body is not None else b""
    headers = [("Host", "localhost"), ("Content-Length", str(len(data)))]
    if body is not None:
        headers.append(("Content-Type", "application/json"))
    await stream.send_all(conn.send(h11.Request(method=method, target=path, headers=headers))
                          + conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage()))
    latencies, buffer = [], b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif type(event) is h11.Data:
            now = time.perf_counter()
            buffer += event.data
            *blocks, buffer = buffer.split(b"\n\n")
            for block in blocks:
                if b"event: response.output_text.delta" in block:
                    payload = json.loads(block.split(b"data: ", 1)[1])
                    latencies.append(now - float(payload["delta"].rstrip(";")))
        elif type(event) is h11.EndOfMessage:
            await stream.aclose()
            return latencies
        elif type(event) is h11.Response and event.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {event.status_code}")


async def follow_latency_http(n: int, rate: float, data_dir: str) -> dict:
    from lmsp_min.registry import ModelEntry, Registry
    from lmsp_min.service import Service, ServiceConfig, serve

    entry = ModelEntry("bench:scripted", Path("scripted.gguf"), 0, 0, "scripted", "none", 1 << 20, 0, (),
                       model=ScriptedModel(rate))
    store = await SQLiteStore.open(data_dir)
    config = ServiceConfig(data_dir=Path(data_dir), access_log=False)
    service = Service(Registry([entry]), store=store, config=config, log=lambda line: None)
    service.tasks = Tasks(store, stores_responses=True)
    body = {"model": "bench:scripted", "input": [{"role": "user", "content": "go"}], "max_output_tokens": n}
    async with trio.open_nursery() as nursery:
        (_, port), *_ = await nursery.start(serve, service, "127.0.0.1", 0)
        direct = await http_deltas(port, "POST", "/lmsp/v1/responses", {**body, "stream": True})
        task = await _post_task(port, body)
        followed = await http_deltas(port, "GET", f"/lmsp/v1/tasks/{task}/events", None)
        nursery.cancel_scope.cancel()
    store.close()
    ms = lambda values: [v * 1000 for v in values]  # noqa: E731
    return {"direct_mean_ms": statistics.fmean(ms(direct)), "followed_mean_ms": statistics.fmean(ms(followed)),
            "direct_p50_ms": statistics.median(ms(direct)), "followed_p50_ms": statistics.median(ms(followed))}


async def follow_across_nodes_http(n: int, rate: float, url: str) -> dict:
    """Two services (nodes A and B) on one PostgreSQL database, each on its loopback port:
    a task posted to A, followed at once on A and on B; per text delta, the time from the
    scripted model yielding it to each client reading it."""
    from lmsp_min.registry import ModelEntry, Registry
    from lmsp_min.service import Service, ServiceConfig, serve

    body = {"model": "bench:scripted", "input": [{"role": "user", "content": "go"}], "max_output_tokens": n}
    latencies: dict[str, list[float]] = {}
    stores = [await open_store(url), await open_store(url)]
    try:
        async with trio.open_nursery() as nursery:
            ports = []
            for store in stores:
                entry = ModelEntry("bench:scripted", Path("scripted.gguf"), 0, 0, "scripted", "none", 1 << 20, 0, (),
                                   model=ScriptedModel(rate))
                service = Service(Registry([entry]), store=store, config=ServiceConfig(access_log=False),
                                  log=lambda line: None)
                service.tasks = Tasks(store, stores_responses=True)
                (_, port), *_ = await nursery.start(serve, service, "127.0.0.1", 0)
                ports.append(port)
            task = await _post_task(ports[0], body)

            async def follow(node: str, port: int) -> None:
                latencies[node] = await http_deltas(port, "GET", f"/lmsp/v1/tasks/{task}/events", None)

            async with trio.open_nursery() as followers:
                followers.start_soon(follow, "a", ports[0])
                followers.start_soon(follow, "b", ports[1])
            nursery.cancel_scope.cancel()
    finally:
        for store in stores:
            store.close()
    ms = lambda values: [v * 1000 for v in values]  # noqa: E731
    return {"on_a_p50_ms": statistics.median(ms(latencies["a"])), "on_b_p50_ms": statistics.median(ms(latencies["b"])),
            "on_a_mean_ms": statistics.fmean(ms(latencies["a"])), "on_b_mean_ms": statistics.fmean(ms(latencies["b"]))}


async def _post_task(port: int, body: dict) -> str:
    """POST /tasks with a one-shot stdlib client; the task id."""
    import http.client

    def post() -> str:
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("POST", "/lmsp/v1/tasks", json.dumps(body), {"Content-Type": "application/json"})
        task = json.loads(conn.getresponse().read())
        conn.close()
        return task["id"]

    return await trio.to_thread.run_sync(post)


async def log_rows(store: Store, n: int, backend: str) -> list[dict]:
    """Write (group commit, one commit per event) and replay, on `store`."""
    tasks = Tasks(store)
    write = await write_rate(store, n)
    single = await write_rate_one_per_commit(store, min(n, 2000))
    replay = await replay_rate(store, "task_write", tasks)
    return [
        {"name": f"{backend}: task log write (group commit)", "value": round(write["events_per_s"]),
         "unit": "events/s", "events": n, "commits": write["commits"]},
        {"name": f"{backend}: task log write (one commit per event)", "value": round(single), "unit": "events/s"},
        {"name": f"{backend}: task log replay", "value": round(replay["events_per_s"]), "unit": "events/s",
         "mb_per_s": round(replay["mb_per_s"], 1)},
    ]


async def sqlite_rows(n: int, rate: float) -> list[dict]:
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        store = await SQLiteStore.open(tmp)
        try:
            rows = await log_rows(store, n, "sqlite")
            follow = await follow_latency(store, min(n, 1000), rate)
        finally:
            store.close()
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        over_http = await follow_latency_http(min(n, 500), rate, tmp)
    return rows + [
        {"name": "follow vs direct, in process, added p50", "unit": "ms/event", "rate": rate,
         "value": round(follow["followed_p50_ms"] - follow["direct_p50_ms"], 3),
         "added_mean_ms": round(follow["added_mean_ms"], 3),
         "followed_p99_ms": round(follow["followed_p99_ms"], 3)},
        {"name": "follow vs direct, over HTTP, added p50", "unit": "ms/event", "rate": rate,
         "value": round(over_http["followed_p50_ms"] - over_http["direct_p50_ms"], 3),
         "added_mean_ms": round(over_http["followed_mean_ms"] - over_http["direct_mean_ms"], 3),
         **{key: round(value, 3) for key, value in over_http.items()}},
    ]


async def postgres_rows(n: int, rate: float, url: str | None) -> list[dict]:
    server = None
    if url is None:
        from tests.pg_server import PostgresServer, binaries

        if binaries() is None:
            raise SystemExit("PostgreSQL is not installed (no initdb): give --store URL")
        server = await trio.to_thread.run_sync(lambda: PostgresServer(binaries(), fsync=True).start())
        url = await trio.to_thread.run_sync(server.new_database)
    try:
        node_a = await open_store(url)
        node_b = await open_store(url)
        try:
            rows = await log_rows(node_a, n, "postgres")
            across = await follow_latency_across_nodes(node_a, node_b, min(n, 1000), rate)
        finally:
            node_a.close()
            node_b.close()
        over_http = await follow_across_nodes_http(min(n, 500), rate, url)
    finally:
        if server is not None:
            await trio.to_thread.run_sync(server.stop)
    return rows + [
        {"name": "postgres: follow from another node, added p50", "unit": "ms/event", "rate": rate,
         "value": round(across["across_p50_ms"] - across["same_node_p50_ms"], 3),
         "added_mean_ms": round(across["across_mean_ms"] - across["same_node_mean_ms"], 3),
         **{key: round(value, 3) for key, value in across.items()}},
        {"name": "postgres: follow on node B vs A, over HTTP, added p50", "unit": "ms/event", "rate": rate,
         "value": round(over_http["on_b_p50_ms"] - over_http["on_a_p50_ms"], 3),
         "added_mean_ms": round(over_http["on_b_mean_ms"] - over_http["on_a_mean_ms"], 3),
         **{key: round(value, 3) for key, value in over_http.items()}},
    ]


async def main(n: int, rate: float, backend: str = "sqlite", url: str | None = None) -> list[dict]:
    rows = []
    if backend in ("sqlite", "both"):
        rows += await sqlite_rows(n, rate)
    if backend in ("postgres", "both"):
        rows += await postgres_rows(n, rate, url)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20000, help="events written and replayed")
    parser.add_argument("--rate", type=float, default=500.0, help="events/s produced while followed")
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="sqlite",
                        help="the store backend(s) measured (default sqlite)")
    parser.add_argument("--store", metavar="URL", help="postgresql:// database to measure on (default: a "
                        "throw-away server, as the tests start one)")
    parser.add_argument("--json", type=Path, help="write the rows here (benchmarks/run.py)")
    args = parser.parse_args()
    rows = trio.run(main, args.events, args.rate, args.backend, args.store)
    for row in rows:
        extra = "  ".join(f"{k}={v}" for k, v in row.items() if k not in ("name", "value", "unit"))
        print(f"{row['name']:<48} {row['value']:>10} {row['unit']:<9} {extra}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))

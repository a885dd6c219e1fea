"""Server overhead: requests per second over keep-alive, and engine-token-to-socket time per SSE event.

    python -m benchmarks.server [--requests 300] [--json FILE]

Everything runs in one process on a tiny random-weight model (tests/tiny.py),
so the figures are the server's own cost, not the model's:

- `sync_1_token`: 1-token synchronous responses, one after another on one
  keep-alive connection (a client in the same trio loop). `server overhead` is
  that latency minus the engine's own time for the same request (prepare_chat
  + generate_chat, called directly).
- `stub_engine`: the same requests with an engine stand-in that answers at
  once: HTTP parsing, validation, routing, events and JSON only. Its CPU time
  (server and client together) is also given: on a busy machine the wall
  time mostly measures waiting for a core.
- `sse_event_latency`: for a streamed response, the time from the engine
  yielding a text delta to the client receiving that event's bytes from the
  socket (same clock, same process); and the CPU time per event of a stream
  from the stub engine (server and client together).
- `openai_responses_event`, `openai_chat_event`: what the OpenAI dialect adds per
  streamed event. The same stub-engine stream of 64 deltas, as /lmsp/v1/responses,
  /v1/responses and /v1/chat/completions streams, taking turns round after round;
  the added CPU time per event of the dialect's stream (its events counted as they
  arrive) against the LMSP stream's, the median over the rounds.

Aims (issue 4): under 2 ms of overhead per request, under 0.2 ms per event;
(issue 26) the dialect adds under 0.1 ms per streamed event.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import h11
import trio

from lmsp_min.service import Service, ServiceConfig, serve

MODEL_ID = "tiny:chat-q8_0"


class Client:
    """A keep-alive HTTP client over one socket (h11)."""

    def __init__(self, stream):
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    async def post(self, path: str, body: bytes) -> None:
        headers = [("Host", "localhost"), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        data = self.conn.send(h11.Request(method="POST", target=path, headers=headers))
        data += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        await self.stream.send_all(data)

    async def events(self):
        """(h11 event, arrival time) until the end of the response."""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
                continue
            yield event, time.perf_counter()
            if type(event) is h11.EndOfMessage:
                self.conn.start_next_cycle()
                return


def body_of(**fields) -> bytes:
    return json.dumps({"model": MODEL_ID, "temperature": 0, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there!"}]}],
        **fields}).encode()


async def sync_latency(client: Client, n: int) -> float:
    """Mean seconds per 1-token synchronous request."""
    body = body_of(max_output_tokens=1)
    started = time.perf_counter()
    for _ in range(n):
        await client.post("/lmsp/v1/responses", body)
        async for event, _ in client.events():
            if type(event) is h11.Response and event.status_code != 200:
                raise RuntimeError(f"status {event.status_code}")
    return (time.perf_counter() - started) / n


async def engine_latency(model, n: int) -> float:
    """Mean seconds the engine alone takes for the same 1-token request."""
    from engine.api import ChatRequest, SamplingParams

    request = ChatRequest(messages=[{"role": "user", "content": "Hello there!"}], max_tokens=1,
                          sampling=SamplingParams(temperature=0))
    started = time.perf_counter()
    for _ in range(n):
        prepared = await trio.to_thread.run_sync(model.prepare_chat, request)
        async for _ in model.generate_chat(prepared):
            pass
    return (time.perf_counter() - started) / n


class StubEngine:
    """An engine stand-in that answers at once: what is left is the server's cost."""

    def __init__(self, model, n_tokens: int = 1):
        self.info = model.info
        self.steps = 0
        self.n_tokens = n_tokens
        self.scheduler = model.scheduler  # its batch size is how many the registry lets generate at once

    def prepare_chat(self, request):
        from engine.api import TokenCounts

        class Prepared:
            input_tokens = 3
            counts = TokenCounts(3)
        return Prepared()

    async def generate_chat(self, prepared):
        from engine.api import Finished, TextDelta

        for _ in range(self.n_tokens):
            await trio.sleep(0)  # as a real token arrives: from another task
            yield TextDelta(" word")
        yield Finished("length", 3, self.n_tokens, 0)


async def sse_latencies(client: Client, model, n_tokens: int) -> list[float]:
    """Seconds from each engine text delta to its SSE event's arrival at the client."""
    from engine.api import TextDelta

    yielded: list[float] = []
    generate_chat = model.generate_chat

    async def timed(prepared):
        async for event in generate_chat(prepared):
            if type(event) is TextDelta and event.text:
                yielded.append(time.perf_counter())
            yield event

    model.generate_chat = timed
    try:
        await client.post("/lmsp/v1/responses", body_of(max_output_tokens=n_tokens, stream=True))
        arrived = []
        async for event, at in client.events():
            if type(event) is h11.Data:
                arrived += [at] * bytes(event.data).count(b"event: response.output_text.delta\n")
    finally:
        del model.generate_chat
    if len(arrived) != len(yielded):
        raise RuntimeError(f"{len(yielded)} deltas yielded but {len(arrived)} events received")
    return [a - y for a, y in zip(arrived, yielded)]


async def stream_of(client: Client, n_tokens: int) -> None:
    await client.post("/lmsp/v1/responses", body_of(max_output_tokens=n_tokens, stream=True))
    async for _ in client.events():
        pass


# The same streamed request in each dialect, and how its stream marks an event.
DIALECT_STREAMS = {
    "lmsp": ("/lmsp/v1/responses", lambda n: body_of(max_output_tokens=n, stream=True), b"\nevent: "),
    "openai_responses": ("/v1/responses", lambda n: json.dumps(
        {"model": MODEL_ID, "input": "Hello there!", "max_output_tokens": n, "stream": True,
         "temperature": 0}).encode(), b"\nevent: "),
    "openai_chat": ("/v1/chat/completions", lambda n: json.dumps(
        {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello there!"}], "max_tokens": n,
         "stream": True, "temperature": 0}).encode(), b"\ndata: "),
}


async def dialect_stream_cpu(client: Client, dialect: str, n_tokens: int) -> tuple[float, int]:
    """CPU seconds (server and client) of one streamed response in a dialect, and its events."""
    path, body, marker = DIALECT_STREAMS[dialect]
    cpu = time.process_time()
    await client.post(path, body(n_tokens))
    received = b"\n"
    async for event, _ in client.events():
        if type(event) is h11.Response and event.status_code != 200:
            raise RuntimeError(f"{path}: status {event.status_code}")
        if type(event) is h11.Data:
            received += bytes(event.data)
    return time.process_time() - cpu, received.count(marker)


async def dialect_overheads(client: Client, n_tokens: int, rounds: int) -> list[dict]:
    """The CPU time per event each OpenAI stream adds to the LMSP stream's, in turns."""
    added = {"openai_responses": [], "openai_chat": []}
    counts = {}
    for _ in range(rounds):
        lmsp_cpu, lmsp_events = await dialect_stream_cpu(client, "lmsp", n_tokens)
        for dialect in added:
            cpu, events = await dialect_stream_cpu(client, dialect, n_tokens)
            added[dialect].append(cpu / events - lmsp_cpu / lmsp_events)
            counts[dialect] = (events, lmsp_events)
    return [{"name": f"{dialect}_event", "value": round(statistics.median(values) * 1000, 4),
             "unit": "ms added/event", "events": counts[dialect][0], "lmsp_events": counts[dialect][1],
             "rounds": rounds} for dialect, values in added.items()]


async def run(n_requests: int) -> list[dict]:
    from tests.tiny import write_tiny_chat_model

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_chat_model(Path(tmp) / "tiny-chat-q8_0.gguf")
        config = ServiceConfig(model_paths=[path], models_dir=None, data_dir=Path(tmp), access_log=False)
        async with Service.open(config, log=lambda line: None) as service:  # (closes the model at the end)
            entry = service.registry.get(MODEL_ID)
            model = await entry.load()
            rows = []
            async with trio.open_nursery() as nursery:
                (host, port), *_ = await nursery.start(serve, service, "127.0.0.1", 0)
                stream = await trio.open_tcp_stream(host, port)
                client = Client(stream)
                await sync_latency(client, 5)  # warm up: templates compiled, caches filled
                await engine_latency(model, 5)
                cpu = time.process_time()
                total = await sync_latency(client, n_requests)
                cpu_total = (time.process_time() - cpu) / n_requests
                cpu = time.process_time()
                engine = await engine_latency(model, n_requests)
                cpu_engine = (time.process_time() - cpu) / n_requests
                rows.append({"name": "sync_1_token", "value": round(1 / total, 1), "unit": "req/s",
                             "latency_ms": round(total * 1000, 3), "engine_ms": round(engine * 1000, 3),
                             "server_overhead_ms": round((total - engine) * 1000, 3),
                             "server_overhead_cpu_ms": round((cpu_total - cpu_engine) * 1000, 3)})
                entry.model = StubEngine(model)
                await sync_latency(client, 5)
                cpu = time.process_time()
                stub = await sync_latency(client, n_requests)
                cpu = (time.process_time() - cpu) / n_requests
                entry.model = model
                rows.append({"name": "stub_engine", "value": round(1 / stub, 1), "unit": "req/s",
                             "server_overhead_ms": round(stub * 1000, 3),
                             "cpu_ms_server_and_client": round(cpu * 1000, 3)})
                latencies = []
                for _ in range(5):
                    latencies += await sse_latencies(client, model, 64)
                latencies.sort()
                entry.model = StubEngine(model, n_tokens=64)
                await stream_of(client, 64)
                cpu = time.process_time()
                for _ in range(10):
                    await stream_of(client, 64)
                cpu_per_event = (time.process_time() - cpu) / (10 * 64)
                await dialect_overheads(client, 64, 2)  # warm up each route
                rows += await dialect_overheads(client, 64, 20)
                entry.model = model
                rows.append({"name": "sse_event_latency", "value": round(statistics.median(latencies) * 1000, 3),
                             "unit": "ms (median)", "p90_ms": round(latencies[int(0.9 * len(latencies))] * 1000, 3),
                             "events": len(latencies),
                             "cpu_ms_per_event_server_and_client": round(cpu_per_event * 1000, 4)})
                await stream.aclose()
                nursery.cancel_scope.cancel()
        return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per measurement")
    parser.add_argument("--json", type=Path, help="write the result rows to this file")
    args = parser.parse_args(argv)
    rows = trio.run(run, args.requests)
    for row in rows:
        extra = " ".join(f"{k}={v}" for k, v in row.items() if k not in ("name", "value", "unit"))
        print(f"{row['name']:<20} {row['value']:>10} {row['unit']:<12} {extra}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""A storm against `lmsp-min serve`: how long one principal's 1-token request waits while
another principal's clients keep the model busy, and what goes wrong.

    python -m benchmarks.storm MODEL [--clients 30] [--seconds 60] [--json FILE]

MODEL is a .gguf path, a store id or a known model name. The server is a real
`lmsp-min serve` process with a tokens file of two principals, `storm` and `quiet`.
Of the `--clients` clients, one is quiet: it sends a 1-token request, waits for
its answer, and sends the next. The others storm: each in a loop, a request of
`--storm-tokens` tokens (synchronous or streamed), a stream it leaves after its
first event, a connection it drops halfway through a request, a model listing.

The storm runs twice, back to back in one server: first with the quiet client
sending as its own principal (`quiet`: admission takes turns between principals,
lmsp_min/admission.py), then with the same client sending as the `storm` principal,
its requests in the storm's own first-come queue, which is how every request waited
before admission was fair. The ratio of the two p50s is what fairness buys.

It prints, for each phase, the quiet request's p50 and p95 latency, its acceptance rate
(the share of its requests answered 200, not refused 429: admission keeps part of the
queue for a principal with nothing admitted), and the answers of
every client by status (`dropped` for a connection the client left on purpose, `closed`
for one the server closed without an answer); and the server's resident memory
(VmRSS) once the model is loaded and at the end.
"""

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import h11
import trio

ROOT = Path(__file__).resolve().parent.parent
TOKENS = {"storm": "storm-token", "quiet": "quiet-token"}


def rss_mib(pid: int) -> float:
    """The process's resident set (VmRSS), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Server:
    """`lmsp-min serve` in a child process, on a free port, with the two principals' tokens."""

    def __init__(self, model: Path, home: Path, extra: list[str]):
        tokens = home / "tokens.json"
        tokens.write_text(json.dumps([{"token": token, "principal": name,
                                       "scopes": ["models:read", "responses:write", "tasks:read", "tasks:write"]}
                                      for name, token in TOKENS.items()]))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = open(home / "serve.log", "w")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "LMSP_HOME": str(home)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lmsp_min.cli", "serve", "--model", str(model), "--port", str(self.port),
             "--tokens-file", str(tokens), "--data-dir", str(home / "data"), *extra],
            env=env, stdout=subprocess.DEVNULL, stderr=self.log)

    def stop(self) -> None:
        stop(self.process)
        self.log.close()


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if a server has not stopped within 30 s of it."""
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def request(port: int, method: str, path: str, token: str, body: dict | None = None, *,
                  leave_after_head: bool = False) -> tuple[int | str, bytes]:
    """One request on a new connection: (status, body); `leave_after_head`: close once the
    head and a first piece of the body are in ("dropped")."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        client = h11.Connection(h11.CLIENT)
        data = json.dumps(body).encode() if body is not None else b""
        headers = [("Host", "localhost"), ("Authorization", f"Bearer {token}"), ("Connection", "close")]
        if body is not None:
            headers += [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        out = client.send(h11.Request(method=method, target=path, headers=headers))
        out += client.send(h11.Data(data=data)) if data else b""
        await stream.send_all(out + client.send(h11.EndOfMessage()))
        status, chunks = None, []
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                try:
                    received = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    received = b""
                client.receive_data(received)
                continue
            if type(event) is h11.Response:
                status = event.status_code
            elif type(event) is h11.Data:
                chunks.append(bytes(event.data))
                if leave_after_head:
                    return "dropped", b""
            elif type(event) is h11.EndOfMessage:
                return status, b"".join(chunks)
            elif type(event) is h11.ConnectionClosed:
                return "closed", b""


def generation(model_id: str, tokens: int, **fields) -> dict:
    return {"model": model_id, "input": [{"role": "user", "content": "Write a short story about a lighthouse."}],
            "max_output_tokens": tokens, "temperature": 0.8, **fields}


async def drop_halfway(port: int) -> str:
    """A connection that sends half a request, then goes away."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"POST /lmsp/v1/responses HTTP/1.1\r\nHost: localhost\r\nContent-Length: 500\r\n\r\n{")
    return "dropped"


async def storm_client(port: int, model_id: str, tokens: int, statuses: Counter, stop: trio.Event,
                       rng: random.Random) -> None:
    token = TOKENS["storm"]
    while not stop.is_set():
        action = rng.random()
        if action < 0.55:
            status, _ = await request(port, "POST", "/lmsp/v1/responses", token, generation(model_id, tokens))
        elif action < 0.75:
            status, _ = await request(port, "POST", "/lmsp/v1/responses", token,
                                      generation(model_id, tokens, stream=True))
        elif action < 0.9:
            status, _ = await request(port, "POST", "/lmsp/v1/responses", token,
                                      generation(model_id, tokens, stream=True), leave_after_head=True)
        elif action < 0.95:
            status = await drop_halfway(port)
        else:
            status, _ = await request(port, "GET", "/lmsp/v1/models", token)
        statuses[status] += 1
        if status == 429:
            await trio.sleep(0.2)  # (Retry-After says 1 s; a storm retries sooner)


async def quiet_client(port: int, model_id: str, principal: str, latencies: list[float], statuses: Counter,
                       stop: trio.Event) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        status, _ = await request(port, "POST", "/lmsp/v1/responses", TOKENS[principal], generation(model_id, 1))
        statuses[status] += 1
        if status == 200:
            latencies.append(time.perf_counter() - started)


async def phase(port: int, model_id: str, args, quiet_as: str, seed: int) -> dict:
    """The storm for `args.seconds`, the quiet client sending as `quiet_as`."""
    statuses: Counter = Counter()
    quiet_statuses: Counter = Counter()
    latencies: list[float] = []
    stop = trio.Event()
    rng = random.Random(seed)
    async with trio.open_nursery() as nursery:
        for _ in range(args.clients - 1):
            nursery.start_soon(storm_client, port, model_id, args.storm_tokens, statuses, stop,
                               random.Random(rng.random()))
        await trio.sleep(args.warmup)  # the storm first fills the queue
        nursery.start_soon(quiet_client, port, model_id, quiet_as, latencies, quiet_statuses, stop)
        await trio.sleep(args.seconds)
        stop.set()
    ordered = sorted(latencies)
    sent = sum(quiet_statuses.values())
    return {
        "quiet_as": quiet_as,
        "quiet_requests": len(latencies),
        "quiet_p50_s": statistics.median(ordered) if ordered else None,
        "quiet_p95_s": ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] if ordered else None,
        "quiet_accepted": quiet_statuses[200] / sent if sent else None,  # answered, of those sent
        "quiet_latencies_s": [round(latency, 4) for latency in latencies],  # in the order they were sent
        "storm_statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "quiet_statuses": {str(k): v for k, v in sorted(quiet_statuses.items(), key=str)},
    }


async def storm(port: int, pid: int, model_id: str, args) -> dict:
    with trio.fail_after(600):  # the model is loaded by a first request
        while True:
            try:
                status, _ = await request(port, "POST", "/lmsp/v1/responses", TOKENS["quiet"],
                                          generation(model_id, 1))
                if status == 200:
                    break
            except OSError:
                pass
            await trio.sleep(0.2)
    rss_start = rss_mib(pid)
    phases = [await phase(port, model_id, args, "quiet", seed=1),
              await phase(port, model_id, args, "storm", seed=1)]
    await trio.sleep(1)  # (the last requests released)
    return {"phases": phases, "rss_start_mib": rss_start, "rss_end_mib": rss_mib(pid)}


def model_path(name: str) -> Path:
    from lmsp_min.cli import resolve_model

    return resolve_model(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a .gguf path, a store id or a known model name")
    parser.add_argument("--clients", type=int, default=30, help="clients in all, the quiet one included (30)")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each of the two phases (60)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds the storm runs before the quiet client")
    parser.add_argument("--storm-tokens", type=int, default=32, help="tokens of each storm request (32)")
    parser.add_argument("--json", type=Path, help="write the result rows to this file")
    parser.add_argument("serve_args", nargs="*", help="after --: more `lmsp-min serve` flags")
    args = parser.parse_args()
    path = model_path(args.model)
    from lmsp_min.registry import model_id_for

    with tempfile.TemporaryDirectory() as home:
        server = Server(path, Path(home), args.serve_args)
        try:
            result = trio.run(storm, server.port, server.process.pid, model_id_for(path), args)
        finally:
            server.stop()
        log = (Path(home) / "serve.log").read_text()
    unexpected = [line for line in log.splitlines() if line.startswith("error") or "Traceback" in line]
    result["server_errors_logged"] = len(unexpected)
    own, shared = result["phases"]
    print(f"storm: {args.clients - 1} clients of principal 'storm' ({args.storm_tokens}-token requests, "
          f"streams, streams left after one event, requests dropped halfway), {args.seconds:.0f} s a phase")
    for label, row in (("quiet as its own principal", own), ("quiet in the storm's principal", shared)):
        p50, p95 = row["quiet_p50_s"], row["quiet_p95_s"]
        figures = f"p50 {p50:.2f} s, p95 {p95:.2f} s" if p50 is not None else "no answer"
        accepted = f"{row['quiet_accepted']:.0%}" if row["quiet_accepted"] is not None else "none sent"
        print(f"  {label}: {row['quiet_requests']} 1-token requests, {figures}, {accepted} accepted")
        print(f"    storm answers by status: {row['storm_statuses']}; quiet: {row['quiet_statuses']}")
    if own["quiet_p50_s"] and shared["quiet_p50_s"]:
        print(f"  fairness: the quiet p50 is {shared['quiet_p50_s'] / own['quiet_p50_s']:.1f}x shorter "
              "as its own principal")
    print(f"  server RSS: {result['rss_start_mib']:.0f} MiB once loaded, {result['rss_end_mib']:.0f} MiB at the end; "
          f"{len(unexpected)} error lines logged")
    for line in unexpected[:5]:
        print(f"    {line}")
    if args.json:
        rows = [{"name": f"quiet p50, {row['quiet_as']} principal", "value": row["quiet_p50_s"], "unit": "s", **row}
                for row in (own, shared)]
        rows += [{"name": f"quiet accepted, {row['quiet_as']} principal", "value": row["quiet_accepted"]}
                 for row in (own, shared)]
        rows += [{"name": "server RSS at start", "value": result["rss_start_mib"], "unit": "MiB"},
                 {"name": "server RSS at end", "value": result["rss_end_mib"], "unit": "MiB"},
                 {"name": "server error lines", "value": len(unexpected)}]
        args.json.write_text(json.dumps({"rows": rows, **result}, indent=1))


if __name__ == "__main__":
    main()

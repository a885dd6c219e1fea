"""A race under load: `lmsp-min serve` against llama.cpp's `llama-server`, on the same streamed chats.

    python -m benchmarks.serve_race MODEL --llama-server PATH [--streams 1,8,16,32] [--rounds 3]
        [--tokens 128] [--json FILE] [-- more lmsp-min serve flags]

MODEL is a .gguf path or a known model name. For each number of streams N, both
servers run at once in child processes, each with room for N requests at a time
(`serve --max-batch N`; `llama-server -np N -t 2`), and take turns, round after
round, their order swapped each round so that neither always meets the machine's
better minutes. A turn sends N streamed `/v1/chat/completions` requests at once
(greedy, `--tokens` tokens each, stream i asking about its own topic, the same on
both sides), and measures:

- aggregate tok/s: the completion tokens of all N (each server's usage count)
  over the wall time from the first request sent to the last stream ended;
- TTFT p50 and p95: request sent to its first content chunk;
- the inter-token p95: the gaps between a stream's content chunks, all streams.

On the servers with room for more than 8, a burst: one stream of 2 x `--tokens`
runs alone, and once it has 16 chunks, 8 requests with ~300-token prompts
arrive. The running stream's gaps from the burst until the last newcomer's first
chunk (p95) are set against its gaps before it (p50): how much a burst of
arrivals stalls those already streaming; and what the newcomers wait for their
first chunk, from the burst (p50, and the last one's); and the share of its idle pace
the running stream kept meanwhile (its chunks in that time, against idle gaps). With one stream, a cold prompt of ~600
tokens (new each turn, so no cache holds it) gives the time to its first token.

Without `--llama-server` only lmsp-min runs (its figures, no ratios). The
machine is shared: the ratios of one run, taken in turns, are the figures; the
tok/s alone are not. docs/benchmarks.md says how to build llama-server.

The servers inherit this process's environment. The run ends by printing lmsp-min's
`compute:` line, whose BLAS kernels decide its speed at many streams: a machine that sets
OPENBLAS_CORETYPE for an older OpenBLAS may hold numpy's to kernels below the CPU (the line
says so), which `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m benchmarks.serve_race ...`
lifts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h11
import trio

from benchmarks import prompts, storm

ROOT = Path(__file__).resolve().parent.parent
CTX_PER_SLOT = 1536  # llama-server splits -c between its slots: room for the cold prompt and the burst's
TOPICS = ("a lighthouse keeper", "a lost cat", "the first snow", "a broken clock", "a village baker",
          "a night train", "an old map", "a quiet library", "a river crossing", "a garden in winter")
BURST = 8  # requests arriving at once in the burst
BURST_AFTER = 16  # chunks the running stream has before the burst arrives
READY_SECONDS = 600  # a server loads its model within this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server in a child process, on a free port, its log in `home`."""

    def __init__(self, name: str, command: list[str], port: int, home: Path):
        self.name, self.port = name, port
        self.log = open(home / f"{name}.log", "w")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "LMSP_HOME": str(home)}
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    @classmethod
    def lmsp(cls, model: Path, slots: int, home: Path, extra: list[str]) -> Server:
        port = free_port()
        return cls("lmsp-min", [sys.executable, "-m", "lmsp_min.cli", "serve", "--model", str(model),
                                "--port", str(port), "--data-dir", str(home / "data"),
                                "--max-batch", str(slots), *extra], port, home)

    @classmethod
    def llama(cls, binary: str, model: Path, slots: int, home: Path) -> Server:
        port = free_port()
        return cls("llama-server", [binary, "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
                                    "-np", str(slots), "-t", "2", "-tb", "2", "-c", str(CTX_PER_SLOT * slots)],
                   port, home)

    def stop(self) -> None:
        storm.stop(self.process)
        self.log.close()


class Refused(RuntimeError):
    """A response that is not a 200."""

    def __init__(self, port: int, status: int):
        super().__init__(f"port {port}: status {status}")
        self.status = status


MODEL_ID = {"id": "model"}  # the id lmsp-min serves the model as (llama-server takes any)


def chat(messages: list[dict], tokens: int) -> dict:
    return {"model": MODEL_ID["id"], "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (story {i})."}]


def long_question(words: int, tag: str) -> list[dict]:
    """A prompt of about `words` * 1.3 tokens: the benchmark prose, `tag` first (no cache holds it)."""
    text = " ".join(prompts.TEXT.split()[:words])
    return [{"role": "user", "content": f"[{tag}] Summarize this in one sentence.\n\n{text}"}]


async def stream_chat(port: int, body: dict, on_chunk=None) -> dict:
    """One streamed chat on a new connection: sent-to-chunk times of its content chunks, and
    its completion tokens (the usage, else the chunks). `on_chunk(n)` after the n-th."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        client = h11.Connection(h11.CLIENT)
        data = json.dumps(body).encode()
        head = h11.Request(method="POST", target="/v1/chat/completions", headers=[
            ("Host", "localhost"), ("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        sent = time.perf_counter()
        await stream.send_all(client.send(head) + client.send(h11.Data(data=data)) + client.send(h11.EndOfMessage()))
        times, usage, buffer = [], None, b""
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(await stream.receive_some(65536))
                continue
            if type(event) is h11.Response and event.status_code != 200:
                raise Refused(port, event.status_code)
            if type(event) is h11.EndOfMessage:
                break
            if type(event) is not h11.Data:
                continue
            at = time.perf_counter() - sent
            buffer += bytes(event.data)
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                    times.append(at)
                    if on_chunk is not None:
                        on_chunk(len(times))
    return {"times": times, "tokens": usage["completion_tokens"] if usage else len(times)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


async def load_turn(port: int, n: int, tokens: int) -> dict:
    """N streams at once: aggregate tok/s, TTFT p50/p95, inter-token p95 (seconds)."""
    results = [None] * n

    async def one(i):
        results[i] = await stream_chat(port, chat(question(i), tokens))

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    wall = time.perf_counter() - started
    ttfts = [r["times"][0] for r in results if r["times"]]
    all_gaps = [g for r in results for g in gaps(r["times"])]
    return {"tok_s": sum(r["tokens"] for r in results) / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p95": percentile(ttfts, 0.95), "gap_p95": percentile(all_gaps, 0.95)}


async def burst_turn(port: int, tokens: int, tag: str) -> dict:
    """The running stream's gap p95 during a burst of BURST arrivals, and its idle gap p50."""
    arrived, firsts = trio.Event(), []

    def on_chunk(count):
        if count == BURST_AFTER:
            arrived.set()

    async def newcomer(i):
        result = await stream_chat(port, chat(long_question(230, f"{tag} {i}"), 8))
        firsts.append(burst_at + (result["times"] or [0.0])[0])  # (no text: taken as at once)

    async with trio.open_nursery() as nursery:
        running = {}

        async def run():
            running.update(await stream_chat(port, chat(question(99), 2 * tokens), on_chunk))
            arrived.set()              # (a stream that ended early: the burst comes after it)
        started = time.perf_counter()
        nursery.start_soon(run)
        await arrived.wait()
        burst_at = time.perf_counter() - started
        for i in range(BURST):
            nursery.start_soon(newcomer, i)
    times = running["times"]
    idle = gaps([t for t in times if t <= burst_at])
    during = gaps([t for t in times if burst_at <= t <= max(firsts)])
    ttfts = [first - burst_at for first in firsts]  # the newcomers' first tokens, from the burst
    idle_p50 = statistics.median(idle) if idle else None
    # the share of its idle pace the running stream kept through the burst
    kept = len(during) / max(ttfts) * idle_p50 if idle_p50 and during else None
    return {"idle_gap_p50": idle_p50, "burst_gap_p95": percentile(during, 0.95) if during else None,
            "burst_gaps": len(during), "burst_pace_kept": kept, "burst_ttft_p50": statistics.median(ttfts),
            "burst_ttft_last": max(ttfts)}


async def cold_turn(port: int, tag: str) -> dict:
    try:
        result = await stream_chat(port, chat(long_question(460, tag), 1))
    except Refused as exc:
        if exc.status != 400:
            raise
        return {"cold_ttft": None}     # a context window too small for it (a test's tiny model)
    return {"cold_ttft": (result["times"] or [None])[0]}


def compute_line(log: Path) -> str | None:
    """The `compute:` line of lmsp-min's start-up log (its threads and BLAS kernels), or None."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return next((line.strip() for line in lines if line.strip().startswith("compute:")), None)


async def wait_ready(server: Server) -> None:
    """Until a first chat is answered (the model loaded), or the process died."""
    with trio.fail_after(READY_SECONDS):
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.process.returncode}")
            try:
                await stream_chat(server.port, chat(question(0), 4))
                return
            except (OSError, h11.RemoteProtocolError):
                pass                   # not listening yet
            except Refused as exc:
                if exc.status != 503:  # (llama-server's answer while it loads)
                    raise
            await trio.sleep(0.5)


async def race_level(servers: list[Server], n: int, args, turns: dict) -> None:
    """The rounds of one number of streams, the servers taking turns."""
    for server in servers:
        await wait_ready(server)
        await load_turn(server.port, n, 8)  # warm up: every slot used once
    for round_ in range(args.rounds):
        order = servers if round_ % 2 == 0 else servers[::-1]
        for server in order:
            row = await load_turn(server.port, n, args.tokens)
            if n > BURST:
                row |= await burst_turn(server.port, args.tokens, f"burst {n} {round_}")
            if n == 1:
                row |= await cold_turn(server.port, f"cold {round_}")
            turns.setdefault((n, server.name), []).append(row)
            print(f"  {n:>2} streams, round {round_ + 1}, {server.name:<12} "
                  + " ".join(f"{k}={v:.3f}" for k, v in row.items() if isinstance(v, float)), flush=True)


def summary(turns: dict, levels: list[int]) -> list[dict]:
    """Per level and figure: each server's median over the rounds, and lmsp-min's ratio."""
    rows = []
    for n in levels:
        ours, theirs = turns.get((n, "lmsp-min"), []), turns.get((n, "llama-server"), [])
        for key in ours[0]:
            mine = [t[key] for t in ours if t[key] is not None]
            row = {"name": f"{key}@{n}", "lmsp_min": statistics.median(mine) if mine else None}
            other = [t[key] for t in theirs if t.get(key) is not None]
            if other:
                row["llama_server"] = statistics.median(other)
                ratios = [a / b for a, b in zip([t[key] for t in ours], [t[key] for t in theirs]) if a and b]
                # tok/s: ours over theirs (above 1 is faster); times: theirs over ours (same sense);
                # none where a side has a zero (llama-server gave the running stream no chunk in a burst)
                if ratios:
                    row["ratio"] = statistics.median(r if key in ("tok_s", "burst_pace_kept") else 1 / r for r in ratios)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="after --: more `lmsp-min serve` flags")
    parser.add_argument("model", help="a .gguf path or a known model name")
    parser.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary")
    parser.add_argument("--streams", default="1,8,16,32", help="numbers of streams, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each server at each level (3)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each stream asks for (128)")
    parser.add_argument("--json", type=Path, help="write the turns and the summary to this file")
    # what follows -- is lmsp-min's, cut off by hand: a positional nargs="*" after the model
    # would be filled (empty) with it, before argparse reaches the --
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.serve_args = argv[cut + 1:]
    path = prompts.model_path(args.model)
    from lmsp_min.registry import model_id_for

    MODEL_ID["id"] = model_id_for(path)
    levels = [int(n) for n in args.streams.split(",")]
    turns: dict = {}
    compute = None  # what lmsp-min says it computes with: the BLAS kernels decide many streams' speed
    with tempfile.TemporaryDirectory() as tmp:
        for n in levels:
            home = Path(tmp) / str(n)
            home.mkdir()
            servers = [Server.lmsp(path, n, home, args.serve_args)]
            if args.llama_server:
                servers.append(Server.llama(args.llama_server, path, n, home))
            try:
                trio.run(race_level, servers, n, args, turns)
            finally:
                for server in servers:
                    server.stop()
            compute = compute or compute_line(home / "lmsp-min.log")
    rows = summary(turns, levels)
    print(f"\nlmsp-min {compute or 'named no compute line'}")
    print(f"\n{'figure':<18} {'lmsp-min':>10} {'llama-server':>13} {'ratio':>7}  (ratio > 1: lmsp-min ahead)")
    for row in rows:
        theirs = row.get("llama_server")
        print(f"{row['name']:<18} {row['lmsp_min'] or float('nan'):>10.3f} "
              f"{theirs if theirs is not None else float('nan'):>13.3f} {row.get('ratio', float('nan')):>7.2f}")
    if args.json:
        by_turn = {f"{n} {name}": t for (n, name), t in turns.items()}
        args.json.write_text(json.dumps({"rows": rows, "lmsp_min_compute": compute, "turns": by_turn}, indent=1))


if __name__ == "__main__":
    main()

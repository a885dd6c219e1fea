"""Speed and memory side by side with llama.cpp, on both real models, in one run.

    python -m benchmarks.perf                  # both models; llama.cpp too when installed
    python -m benchmarks.perf --models smollm2:135m-instruct-q4_1 --no-server
    python -m benchmarks.perf --no-llama --against ../old   # this checkout against another, in turns

For each model:

- engine (a child process, so its memory is its own): load time; prefill tok/s of
  the 512-token prompt (one step); decode tok/s over 128 greedy tokens after a short
  chat prompt, through the scheduler; time to first token of that chat prompt;
  second-turn TTFT of a ~1,000-token conversation, from the prefix cache and cold
  (cache cleared); the bytes the engine keeps for the weights, the growth of
  resident memory over loading and one step (shared: the quantized weights, in
  the memory the helper process maps too; anonymous: tokenizer, buffers, weights
  when there is no helper; file: pages of the GGUF read while unpacking, clean and
  reclaimable), peak RSS, and the helper process's own (anonymous) memory.
- HTTP (`lmsp-min serve` in a child process, this model only): aggregate tok/s of
  1, 4 and 8 concurrent streamed responses (output tokens from `usage` over the
  wall time of the whole burst), the mean time to the first text event, and the
  server's peak RSS.
- llama.cpp (benchmarks/llamacpp.py, a child process, when llama-cpp-python is
  installed): the same prompt token ids, with 2 threads (the comparison the
  targets are about) and with 1 thread (a reference that a busy machine disturbs
  less: llama.cpp's threads spin while they wait for each other, so when other
  processes hold the cores its 2-thread figures collapse, 5-10x for decode).

The engines are loaded side by side and measured in turns, round after round
(`--rounds`, 3 by default; see benchmarks/worker.py): a prefill from each, a decode
from each, the server's bursts, and for each figure the best round counts. On a
machine whose speed drifts, that compares measurements seconds apart instead of
minutes apart. Each figure is printed with its ratio to llama.cpp's and the target
of issue 7; the run is written as JSON to benchmarks/results/perf-<time>.json, every
round's figures included (and a PNG chart of the ratios when matplotlib is
installed). Compare the ratios of one run, not figures across runs.

`--against CHECKOUT` measures a change: another source tree (say, `git worktree add
../old HEAD~5`) runs its own engine worker and server, which take their turns beside
this checkout's in every round, and a second table gives this one's speed over the
other's (above 1 is faster), figure by figure.

The prefill is mostly float32 GEMM in numpy's OpenBLAS, whose speed depends on the
CPU kernels it runs: the run prints which ran, and says so when OPENBLAS_CORETYPE or
OPENBLAS_L2_SIZE chose them (some machines set both for old OpenBLAS builds; on a
Zen 5 that forced Haswell kernels, 1.8x slower than the SkylakeX ones OpenBLAS picks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import llamacpp, prompts, worker

RESULTS = Path(__file__).parent / "results"
STREAMS = (1, 4, 8)
STREAM_TOKENS = 64  # max_output_tokens of each concurrent stream
OPENBLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")  # variables that choose OpenBLAS's kernels


# --- the engine, in a child process ----------------------------------------------------


def rss_mb(pid: int | str = "self") -> dict[str, float]:
    """Resident memory of a process now, in MiB: anonymous (private arrays), file-backed
    (mapped pages) and shared memory (the weights a helper process maps too)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile", "RssShmem")}


def weights_mb(weights) -> float:
    """MiB the engine keeps for the weights: every quantized matrix and float vector."""
    seen, total = set(), 0
    for part in [weights, *weights.blocks]:
        for value in vars(part).values():
            if id(value) not in seen and hasattr(value, "nbytes") and not isinstance(value, list):
                seen.add(id(value))
                total += value.nbytes
    return total / (1 << 20)


def engine_worker(name: str) -> None:
    """Measure the engine on request (see the module docstring): the child side of `Worker`.

    Prints its setup figures, then answers each command line on stdin with one JSON line:
    `prefill`, `decode` (TTFT and the 128 steps after it, through the scheduler) and
    `finish` (second-turn TTFT, memory; then it exits).
    """
    import numpy as np
    import trio

    from engine import load_model
    from engine.api import ChatRequest, SamplingParams
    from engine.accel import blas_kernel

    reply = worker.take_stdout()
    path = prompts.model_path(name)
    rss_before = rss_mb()
    start = time.perf_counter()
    model = load_model(path)
    load_s = time.perf_counter() - start
    greedy = SamplingParams(temperature=0)
    prefill_ids = prompts.prefill_ids(model.tokenize)
    short_ids = model.prepare_chat(ChatRequest([{"role": "user", "content": prompts.SHORT_QUESTION}])).prompt_ids
    model.step([model.new_sequence(short_ids)])  # warm up: every weight read once
    rss_after = rss_mb()

    def prefill() -> dict:
        seq = model.new_sequence(prefill_ids)
        start = time.perf_counter()
        model.step([seq], chunk=len(prefill_ids))
        return {"prefill_s": time.perf_counter() - start}

    async def decode() -> dict:
        """TTFT and the seconds of the 128 steps after the first token, of one greedy stream."""
        model.scheduler.prefix_cache.clear()
        start = time.perf_counter()
        times = []
        with model.scheduler.submit(short_ids, pick=lambda row: int(np.argmax(row)),
                                    max_tokens=prompts.N_DECODE + 1) as steps:
            async for _ in steps:
                times.append(time.perf_counter())
        return {"ttft_s": times[0] - start, "decode_s": times[-1] - times[0]}

    async def chat_seconds(messages: list[dict]) -> tuple[float, int]:
        """Seconds to the end of a 1-token answer (prefill + first token) and the cached tokens."""
        prepared = model.prepare_chat(ChatRequest(messages, max_tokens=1, sampling=greedy))
        start = time.perf_counter()
        events = [event async for event in model.generate_chat(prepared)]
        return time.perf_counter() - start, events[-1].cached_tokens

    async def second_turn() -> dict:
        conversation = prompts.conversation()
        first = model.prepare_chat(ChatRequest(conversation, max_tokens=32, sampling=greedy))
        reply = "".join([getattr(e, "text", "") async for e in model.generate_chat(first)])
        messages = prompts.next_turn(conversation, reply)
        warm, cached = await chat_seconds(messages)
        model.scheduler.prefix_cache.clear()
        cold, _ = await chat_seconds(messages)
        n = model.prepare_chat(ChatRequest(messages, max_tokens=1)).input_tokens
        return {"turn2_tokens": n, "turn2_cached_tokens": cached, "turn2_ttft_warm_s": warm,
                "turn2_ttft_cold_s": cold}

    def finish() -> dict:
        return {
            **trio.run(second_turn),
            "gguf_mb": path.stat().st_size / (1 << 20),
            "weights_mb": weights_mb(model.weights),
            "rss_anon_mb": rss_after["RssAnon"] - rss_before["RssAnon"],  # weights, tokenizer, buffers
            "rss_file_mb": rss_after["RssFile"] - rss_before["RssFile"],  # pages of the GGUF read while loading
            "rss_shmem_mb": rss_after["RssShmem"] - rss_before["RssShmem"],  # the weights, shared with the helper
            "helper_rss_anon_mb": rss_mb(helper.process.pid)["RssAnon"]
            if (helper := model.accel and model.accel.helper) and helper.process.poll() is None else 0.0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }

    reply({"engine": "lmsp-min", "blas_kernel": blas_kernel(), "load_s": load_s,
           "prefill_ids": prefill_ids, "short_ids": short_ids})
    worker.serve({"prefill": prefill, "decode": lambda: trio.run(decode), "finish": finish}, reply)


# --- the HTTP server, in a child process ------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_of(pid: int) -> float:
    """Peak resident memory (VmHWM) of a running process, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    """`lmsp-min serve` with this one model, in a child process: bursts of concurrent streams on request."""

    def __init__(self, name: str, checkout: str | None = None):
        from lmsp_min.client import Client

        path = prompts.model_path(name)
        self._tmp = tempfile.TemporaryDirectory()
        models = Path(self._tmp.name) / "models"
        models.mkdir()
        (models / path.name).symlink_to(path)
        port = free_port()
        self._log = tempfile.TemporaryFile(mode="w+")  # a file: a full pipe would block the server
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lmsp_min.cli", "serve", "--models-dir", str(models), "--port", str(port),
             "--no-store", "--data-dir", f"{self._tmp.name}/data"],
            stdout=subprocess.DEVNULL, stderr=self._log, text=True, **worker.from_checkout(checkout))
        self.client = Client(f"http://127.0.0.1:{port}")
        self.prompts_sent = 0  # every stream gets a question of its own (see burst)
        try:
            self.model_id = wait_for_server(self.client, self.process, self._log)
            self.client.create_response(self.model_id, "Hello", max_output_tokens=1)  # loads the model
        except BaseException:
            self.close()
            raise

    def bursts(self) -> dict:
        """Aggregate tok/s and mean TTFT of 1, 4 and 8 concurrent streams, one burst each."""
        figures = {}
        for n in STREAMS:
            tokens, wall, ttfts = burst(self.client, self.model_id, n, first_number=self.prompts_sent + 1)
            self.prompts_sent += n
            figures[f"aggregate_{n}_tok_s"] = tokens / wall
            figures[f"http_ttft_{n}_s"] = sum(ttfts) / len(ttfts)
        return figures

    def peak_rss_mb(self) -> float:
        return peak_rss_of(self.process.pid)

    def close(self) -> None:
        """Stop the server: SIGTERM, then SIGKILL if it has not exited within 30 s."""
        self.process.terminate()
        worker.wait_or_kill(self.process)
        self._log.close()
        self._tmp.cleanup()


def wait_for_server(client, server: subprocess.Popen, log, timeout: float = 120.0) -> str:
    """The id of the one model the server lists, once it answers (`log`: the file of its stderr)."""
    from lmsp_min.client import TransportError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"lmsp-min serve exited:\n{log.read()}")
        try:
            return client.list_models()[0]["id"]
        except TransportError:  # not listening yet
            time.sleep(0.2)
    raise RuntimeError("lmsp-min serve did not answer in time")


def burst(client, model_id: str, n: int, first_number: int = 1) -> tuple[int, float, list[float]]:
    """n streamed responses at once: (output tokens, wall seconds, time to first text of each).

    The questions are numbered, near their start, so that the prefix cache knows only
    the chat template's opening of any of them: their TTFT is a cold prefill's, as
    llama.cpp's is.
    """
    results: list[tuple[int, float]] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            start = time.perf_counter()
            first = None
            question = f"Story {first_number + i}. {prompts.SHORT_QUESTION}"
            for event in client.stream_response(model_id, question, max_output_tokens=STREAM_TOKENS, temperature=0):
                if first is None and event.event == "response.output_text.delta":
                    first = time.perf_counter() - start
                if event.event in ("response.completed", "response.incomplete"):
                    results.append((event.data["usage"]["output_tokens"], first or time.perf_counter() - start))
                elif event.event == "response.failed":
                    raise RuntimeError(f"response failed: {event.data}")
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return sum(r[0] for r in results), wall, [r[1] for r in results]


# --- the table --------------------------------------------------------------------------

# (key, label, unit, llama.cpp key for the ratio, target ratio or None, higher is better)
ROWS = [
    ("prefill_tok_s", "prefill 512 tokens", "tok/s", "prefill_tok_s", 1.5, True),
    ("decode_tok_s", "decode 128 tokens", "tok/s", "decode_tok_s", 0.3, True),
    ("ttft_s", "time to first token", "s", "ttft_s", None, False),
    ("aggregate_1_tok_s", "HTTP, 1 stream", "tok/s", "decode_tok_s", None, True),
    ("aggregate_4_tok_s", "HTTP, 4 streams", "tok/s", "decode_tok_s", None, True),
    ("aggregate_8_tok_s", "HTTP, 8 streams", "tok/s", "decode_tok_s", 1.0, True),
    ("http_ttft_1_s", "HTTP TTFT, 1 stream", "s", "ttft_s", None, False),
    ("turn2_ttft_cold_s", "2nd turn TTFT, cold", "s", None, None, False),
    ("turn2_ttft_warm_s", "2nd turn TTFT, prefix cache", "s", "turn2_ttft_cold_s*", 0.3, False),
    ("weights_mb", "resident weights", "MiB", "gguf_mb*", 2.0, False),
    ("rss_shmem_mb", "RSS after load, shared", "MiB", "gguf_mb*", None, False),
    ("rss_anon_mb", "RSS after load, anonymous", "MiB", "gguf_mb*", None, False),
    ("rss_file_mb", "RSS after load, file pages", "MiB", "gguf_mb*", None, False),
    ("peak_rss_mb", "peak RSS, engine", "MiB", "peak_rss_mb", None, False),
    ("helper_rss_anon_mb", "helper process, own memory", "MiB", None, None, False),
    ("server_peak_rss_mb", "peak RSS, HTTP server", "MiB", None, None, False),
    ("load_s", "load", "s", "load_s", None, False),
]


def table(results: dict) -> str:
    """The figures of every model, each with its ratio to llama.cpp's (2 threads: the
    targets; and 1 thread, which a busy machine disturbs less) or, where the reference
    key ends in *, to our own baseline, and whether it meets its target."""
    lines = [f"{'model / figure':<34} {'lmsp-min':>10} {'llama.cpp':>10} {'ratio':>7}  {'target':<16}"
             f"{'llama.cpp 1t':>12} {'ratio':>7}"]
    for name, r in results.items():
        ours = r.get("engine", {}) | r.get("server", {})
        lines.append(name)
        for key, label, unit, ref, target, higher in ROWS:
            if key not in ours:
                continue
            cells = []
            for theirs in (r.get("llama.cpp"), r.get("llama.cpp 1 thread")):
                if ref and ref.endswith("*"):
                    base, shown = ours.get(ref[:-1]), None
                else:
                    base = shown = theirs.get(ref) if theirs and ref else None
                cells.append((shown, ours[key] / base if base else None))
            (shown2, ratio2), (shown1, ratio1) = cells
            verdict = ""
            if target is not None and ratio2 is not None:
                ok = ratio2 >= target if higher else ratio2 <= target
                verdict = f"{'>=' if higher else '<='} {target}x {'ok' if ok else 'MISSED'}"
            lines.append(
                f"  {label + ' (' + unit + ')':<32} {fmt(ours[key]):>10} {fmt(shown2):>10} {fmt_ratio(ratio2):>7}  "
                f"{verdict:<16}{fmt(shown1):>12} {fmt_ratio(ratio1 if shown1 is not None else None):>7}")
    return "\n".join(lines)


def fmt_ratio(x) -> str:
    return f"{x:.3f}x" if x is not None else ""  # three places: 1.498x must not read as 1.50x


def fmt(x) -> str:
    if x is None:
        return ""
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def chart(results: dict, path: Path) -> bool:
    """A bar chart of the ratios to llama.cpp, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(9, 4))
    keys = ["prefill_tok_s", "decode_tok_s", "aggregate_1_tok_s", "aggregate_4_tok_s", "aggregate_8_tok_s"]
    width = 0.8 / max(1, len(results))
    for i, (name, r) in enumerate(results.items()):
        ours, theirs = r.get("engine", {}) | r.get("server", {}), r.get("llama.cpp") or {}
        ref = {k: ref for k, _, _, ref, _, _ in ROWS}
        ratios = [ours[k] / theirs[ref[k]] if k in ours and theirs.get(ref[k]) else 0 for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], ratios, width, label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(keys))])
    ax.set_xticklabels(["prefill", "decode", "HTTP x1", "HTTP x4", "HTTP x8"])
    ax.set_ylabel("lmsp-min / llama.cpp (single stream)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


# --- the rounds ------------------------------------------------------------------------


def measure_model(name: str, n_rounds: int, with_server: bool, with_llama: bool,
                  against: str | None = None) -> dict:
    """Every figure of one model: the engines loaded side by side, measured in turns.

    Each round asks every engine for a prefill, then every engine for a decode (TTFT
    included), then each server for its bursts, alternating who goes first; for each
    figure the best round counts (benchmarks/worker.py says why). With `against` (another
    checkout's path), that checkout's engine and server take their turns too. Returns
    {"engine": ..., "server": ..., "llama.cpp": ..., "llama.cpp 1 thread": ...,
    "against": ..., "against server": ..., "rounds": ...}, the keys of what ran.
    """
    with contextlib.ExitStack() as stack:
        print(f"{name}: loading ...", file=sys.stderr)
        command = [sys.executable, "-m", "benchmarks.perf", "--engine-worker", name]
        engine = stack.enter_context(worker.Worker(command))
        prefill_ids, short_ids = engine.ready["prefill_ids"], engine.ready["short_ids"]
        engines = {"engine": engine}
        if against:
            engines["against"] = stack.enter_context(worker.Worker(command, checkout=against))
        if with_llama:
            for threads, key in ((2, "llama.cpp"), (1, "llama.cpp 1 thread")):
                engines[key] = stack.enter_context(
                    llamacpp.start_worker(prompts.model_path(name), prefill_ids, short_ids, threads))
        servers = {}
        if with_server:
            servers["server"] = stack.enter_context(contextlib.closing(Server(name)))
            if against:
                servers["against server"] = stack.enter_context(contextlib.closing(Server(name, against)))
        rounds: list[dict] = []
        for i in range(n_rounds):
            print(f"{name}: round {i + 1} of {n_rounds} ...", file=sys.stderr)
            order = list(engines.items())[:: -1 if i % 2 else 1]
            measured = {key: {} for key in engines}
            for command in ("prefill", "decode"):
                for key, w in order:
                    measured[key] |= w.ask(command)
            for key, server in list(servers.items())[:: -1 if i % 2 else 1]:
                measured[key] = server.bursts()
            rounds.append(measured)
        results = {}
        for key, w in engines.items():
            figures = {k: v for k, v in w.ready.items() if k not in ("prefill_ids", "short_ids")}
            figures |= best(r[key] for r in rounds) | w.ask("finish")
            results[key] = figures | {
                "prefill_tokens": len(prefill_ids), "prefill_tok_s": len(prefill_ids) / figures["prefill_s"],
                "decode_tokens": prompts.N_DECODE, "decode_tok_s": prompts.N_DECODE / figures["decode_s"]}
        for key, server in servers.items():
            results[key] = best(r[key] for r in rounds) | {"server_peak_rss_mb": server.peak_rss_mb()}
        results["rounds"] = rounds
        return results


# The figures `--against` compares: speed, where the two checkouts must agree within 5%.
AGAINST_ROWS = [row for row in ROWS if row[2] in ("tok/s", "s")]


def against_table(results: dict, against: str) -> str:
    """This checkout's figures beside another's, measured in the same turns, with the
    ratio oriented so that above 1 is this checkout faster, and whether it is within 5%."""
    lines = [f"against {against}: ratio > 1 is this checkout faster; within 5% is 0.95x or more",
             f"{'model / figure':<34} {'this':>10} {'against':>10} {'ratio':>7}"]
    for name, r in results.items():
        ours = r.get("engine", {}) | r.get("server", {})
        theirs = r.get("against", {}) | r.get("against server", {})
        lines.append(name)
        for key, label, unit, _, _, higher in AGAINST_ROWS:
            if key not in ours or key not in theirs:
                continue
            ratio = ours[key] / theirs[key] if higher else theirs[key] / ours[key]
            lines.append(f"  {label + ' (' + unit + ')':<32} {fmt(ours[key]):>10} {fmt(theirs[key]):>10} "
                         f"{fmt_ratio(ratio):>7}  {'ok' if ratio >= 0.95 else 'SLOWER'}")
    return "\n".join(lines)


def best(rounds) -> dict:
    """Per figure, the best of the rounds: the least seconds, the most tokens per second."""
    out: dict[str, float] = {}
    for figures in rounds:
        for key, value in figures.items():
            better = min if key.endswith("_s") and not key.endswith("tok_s") else max
            out[key] = better(out[key], value) if key in out else value
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(prompts.MODELS))
    parser.add_argument("--rounds", type=int, default=3, help="rounds of turns; the best of them counts")
    parser.add_argument("--no-server", action="store_true", help="skip the HTTP streams")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp even when installed")
    parser.add_argument("--against", metavar="CHECKOUT",
                        help="another source tree (e.g. a git worktree of an older commit) whose engine and "
                             "server take their turns beside this one's: a speed change measured in one run")
    parser.add_argument("--engine-worker", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_worker:
        engine_worker(args.engine_worker)
        return

    with_llama = not args.no_llama and llamacpp.available()
    load_before = os.getloadavg()[0]
    results = {name: measure_model(name, args.rounds, not args.no_server, with_llama, args.against)
               for name in args.models}
    load_after = os.getloadavg()[0]
    print(table(results))
    if args.against:
        print(against_table(results, args.against))
    kernels = {r["engine"].get("blas_kernel") for r in results.values() if "engine" in r}
    print(f"numpy's OpenBLAS ran its {', '.join(map(str, sorted(kernels, key=str)))} kernels", end="")
    forced = {k: os.environ[k] for k in OPENBLAS_ENV if k in os.environ}
    if forced:
        print(f", as {' and '.join(f'{k}={v}' for k, v in forced.items())} ask: older kernels than this CPU "
              "may run (a slower prefill). Unset both for this command alone to measure the ones OpenBLAS "
              "picks itself: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m benchmarks.perf")
    else:
        print(" (its own pick for this CPU)")
    print(f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} cores: "
          "other processes compete for the cores, and llama.cpp's spinning threads suffer more from that than ours")
    if not with_llama:
        print("(llama.cpp not measured: pip install '.[compare]' for the ratios)")
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"perf-{stamp}.json"
    out.write_text(json.dumps({"command": " ".join(["python -m benchmarks.perf", *(argv or sys.argv[1:])]),
                               "cpu_count": os.cpu_count(), "load_average": [load_before, load_after],
                               "openblas_env": {k: os.environ.get(k) for k in OPENBLAS_ENV},
                               "results": results}, indent=2))
    print(f"wrote {out}")
    if chart(results, RESULTS / f"perf-{stamp}.png"):
        print(f"wrote {RESULTS / f'perf-{stamp}.png'}")


if __name__ == "__main__":
    main()

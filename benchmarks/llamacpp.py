"""The llama.cpp side of the speed comparison, through llama-cpp-python (the `compare` extra).

Every figure is measured on token ids the caller gives, so llama.cpp and our engine
see exactly the same prompts (benchmarks/prompts.py):

- prefill tok/s: one fresh context evaluates the 512-token prompt in one batch;
- decode tok/s: after a short prompt, 128 tokens generated greedily one at a time
  (the time of the steps after the first token, so prefill is not counted);
- time to first token: fresh context, short prompt evaluated, first token picked.

Each figure is the best of `repeats` runs: the machine is shared, and the best run
is the one least disturbed by other processes. `start_worker` runs llama.cpp in a
child process (its threads and memory do not mix with ours) that measures on
request, so benchmarks/perf.py can take its turns between our engine's
(benchmarks/worker.py).

    python -m benchmarks.llamacpp            # both real models, 2 threads, a table
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np

from benchmarks import prompts, worker


def load(path: str, threads: int = 2, n_ctx: int = 2048, extra_buffer_types: bool = False,
         n_batch: int = 512, logits_all: bool = False):
    """A llama.cpp context on the GGUF at `path`: CPU only, `threads` threads for decode and batches
    (`logits_all`: the logits of every position evaluated, not only the last).

    Without `extra_buffer_types` llama.cpp keeps the weights in plain CPU buffers:
    a build for a CPU that advertises AMX uses AMX tiles for them, and where the
    virtual machine does not enable AMX (as on our benchmark machine) that dies of
    an illegal instruction. The same switch turns off llama.cpp's weight repacking
    (which some formats, e.g. Q4_K and Q4_0, use for faster AVX2/AVX-512 kernels).
    """
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama

    default_params = lib.llama_model_default_params

    def model_params():
        params = default_params()
        params.use_extra_bufts = extra_buffer_types
        return params

    lib.llama_model_default_params = model_params  # what Llama() starts from
    try:
        return Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=logits_all,
            verbose=False,
        )
    finally:
        lib.llama_model_default_params = default_params


def _next_token(llm) -> int:
    """Greedy pick from the logits of the last evaluated token."""
    import llama_cpp

    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def prefill_seconds(llm, ids: list[int]) -> float:
    """Seconds to evaluate `ids` in a fresh context (one batch of up to 512 tokens)."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    return time.perf_counter() - start


def ttft_seconds(llm, ids: list[int]) -> float:
    """Seconds from a fresh context to the first generated token of the prompt `ids`."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    _next_token(llm)
    return time.perf_counter() - start


def decode_seconds(llm, ids: list[int], n: int) -> tuple[float, list[int]]:
    """Seconds of `n` greedy decode steps after the prompt `ids`, and the tokens generated."""
    llm.reset()
    llm.eval(ids)
    out = [_next_token(llm)]
    start = time.perf_counter()
    for _ in range(n):
        llm.eval([out[-1]])
        out.append(_next_token(llm))
    return time.perf_counter() - start, out[1:]


def measure(
    path: str,
    prefill_ids: list[int],
    short_ids: list[int],
    n_decode: int = prompts.N_DECODE,
    threads: int = 2,
    repeats: int = 2,
) -> dict:
    """Prefill tok/s, decode tok/s, TTFT and load time of llama.cpp on one model, best of `repeats`."""
    start = time.perf_counter()
    llm = load(path, threads)
    load_s = time.perf_counter() - start
    llm.eval(short_ids[:8])  # warm up: first-touch of the weights, thread pool start
    prefill = min(prefill_seconds(llm, prefill_ids) for _ in range(repeats))
    ttft = min(ttft_seconds(llm, short_ids) for _ in range(repeats))
    decode = min(decode_seconds(llm, short_ids, n_decode)[0] for _ in range(repeats))
    return {
        "engine": "llama.cpp",
        "threads": threads,
        "load_s": load_s,
        "prefill_tokens": len(prefill_ids),
        "prefill_tok_s": len(prefill_ids) / prefill,
        "decode_tokens": n_decode,
        "decode_tok_s": n_decode / decode,
        "ttft_s": ttft,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def available() -> bool:
    """True when llama-cpp-python is installed (`pip install ".[compare]"`)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def start_worker(path: str, prefill_ids: list[int], short_ids: list[int], threads: int = 2,
                 n_decode: int = prompts.N_DECODE) -> worker.Worker:
    """A child process with llama.cpp loaded that measures on request (`prefill`, `decode`, `finish`)."""
    job = {"path": str(path), "prefill_ids": prefill_ids, "short_ids": short_ids, "threads": threads,
           "n_decode": n_decode}
    return worker.Worker([sys.executable, "-m", "benchmarks.llamacpp", "--worker"], job)


def _worker_main() -> None:
    """The child side of start_worker: the job on the first line of stdin, then commands."""
    reply = worker.take_stdout()
    job = json.loads(sys.stdin.readline())
    prefill_ids, short_ids, n_decode = job["prefill_ids"], job["short_ids"], job["n_decode"]
    start = time.perf_counter()
    llm = load(job["path"], job["threads"])
    load_s = time.perf_counter() - start
    llm.eval(short_ids[:8])  # warm up: first-touch of the weights, thread pool start
    reply({"engine": "llama.cpp", "threads": job["threads"], "load_s": load_s})
    worker.serve({
        "prefill": lambda: {"prefill_s": prefill_seconds(llm, prefill_ids)},
        "decode": lambda: {"ttft_s": ttft_seconds(llm, short_ids),
                           "decode_s": decode_seconds(llm, short_ids, n_decode)[0]},
        "finish": lambda: {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
    }, reply)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=list(prompts.MODELS), help="model names (default: both)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker_main()
        return
    print(f"{'model':<28} {'prefill tok/s':>14} {'decode tok/s':>13} {'TTFT ms':>8} {'load s':>7}")
    for name in args.models:
        path = prompts.model_path(name)
        llm = load(path, args.threads)
        tokenize = lambda text: llm.tokenize(text.encode(), add_bos=True)  # noqa: E731
        prefill_ids = prompts.prefill_ids(tokenize)
        short_ids = tokenize(prompts.SHORT_QUESTION)
        del llm
        r = measure(path, prefill_ids, short_ids, threads=args.threads, repeats=args.repeats)
        print(
            f"{name:<28} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} "
            f"{1000 * r['ttft_s']:>8.1f} {r['load_s']:>7.2f}"
        )


if __name__ == "__main__":
    main()

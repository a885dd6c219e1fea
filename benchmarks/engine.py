"""The engine alone on both real models: load time, prefill and decode speed, memory.

    python -m benchmarks.engine                      # both models
    python -m benchmarks.engine --models smollm2:135m-instruct-q4_1 --json out.json

For each model, in a child process of its own (so memory figures are its own):
- load: `load_model(path)` wall time (header parse, weights unpacked once);
- prefill: tok/s of one forward step over the 512-token prompt of
  benchmarks/prompts.py (after a short warm-up step);
- decode: tok/s of 128 greedy tokens after that prompt, one `model.step` per
  token (the raw engine, without the scheduler or trio);
- memory: the bytes of the weight matrices as the kernels hold them (the
  figure to compare with the file: issue 3 asks for at most 2x), resident set size after loading, the weights' share of it (RSS after
  load minus RSS before, split into shared memory and heap — the unpacked weights,
  shared when a helper process maps them (engine/accel/helper.py) — and pages of the
  memory-mapped file, which the kernel can drop), and the peak RSS of the
  whole run, against the file size.
Timings on a shared machine are noisy; run it when the machine is quiet.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

from benchmarks import prompts


def rss_bytes() -> dict[str, int]:
    """Resident bytes of this process: total, shared memory (the unpacked weights, when a
    helper process maps them too), anonymous (heap: the weights without a helper, buffers)
    and file-backed (mmap)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssShmem", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return {"total": fields["VmRSS"], "shared": fields["RssShmem"], "anon": fields["RssAnon"],
            "file": fields["RssFile"]}


def weight_bytes(model) -> int:
    """Bytes of the weight matrices as the kernels hold them (codes + scales, or dense)."""
    w = model.weights
    matrices = [w.token_embd] + ([] if w.output is w.token_embd else [w.output])
    for b in w.blocks:
        matrices += [b.qkv, b.attn_output, b.gate_up, b.ffn_down]
    return sum(m.nbytes for m in matrices)


def measure(name: str) -> dict:
    """All the figures of one model (run in its own process)."""
    from engine import load_model

    path = prompts.model_path(name)
    before = rss_bytes()
    started = time.perf_counter()
    model = load_model(path)
    load_s = time.perf_counter() - started
    after_load = rss_bytes()

    ids = prompts.prefill_ids(model.tokenize, prompts.N_PREFILL)
    model.step([model.new_sequence(ids[:32])])                    # warm-up
    seq = model.new_sequence(ids, capacity=len(ids) + prompts.N_DECODE)
    started = time.perf_counter()
    logits = model.step([seq])[0]                                 # (1, V): the whole prompt in one step
    prefill_s = time.perf_counter() - started

    started = time.perf_counter()
    for _ in range(prompts.N_DECODE):
        seq.append(int(np.argmax(logits[0])))
        logits = model.step([seq])[0]
    decode_s = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "model": name,
        "file_mb": round(path.stat().st_size / 2**20, 1),
        "load_s": round(load_s, 2),
        "prefill_tok_s": round(len(ids) / prefill_s, 1),
        "decode_tok_s": round(prompts.N_DECODE / decode_s, 1),
        "weights_mb": round(weight_bytes(model) / 2**20, 1),
        "rss_after_load_mb": round(after_load["total"] / 2**20, 1),
        "weights_rss_mb": round((after_load["total"] - before["total"]) / 2**20, 1),
        "weights_shared_mb": round((after_load["shared"] - before["shared"]) / 2**20, 1),
        "weights_anon_mb": round((after_load["anon"] - before["anon"]) / 2**20, 1),
        "weights_mmap_mb": round((after_load["file"] - before["file"]) / 2**20, 1),
        "peak_rss_mb": round(peak / 2**20, 1),
    }


def rows(result: dict) -> list[dict]:
    model = result["model"]
    return [
        {"name": "load", "value": result["load_s"], "unit": "s", "model": model},
        {"name": "prefill (512)", "value": result["prefill_tok_s"], "unit": "tok/s", "model": model},
        {"name": "decode (128)", "value": result["decode_tok_s"], "unit": "tok/s", "model": model},
        {"name": "weight matrices", "value": result["weights_mb"], "unit": "MiB", "model": model,
         "x_file": round(result["weights_mb"] / result["file_mb"], 2)},
        {"name": "weights RSS", "value": result["weights_rss_mb"], "unit": "MiB", "model": model,
         "file_mb": result["file_mb"], "shared_mb": result["weights_shared_mb"],
         "anon_mb": result["weights_anon_mb"],
         "mmap_mb": result["weights_mmap_mb"]},
        {"name": "peak RSS", "value": result["peak_rss_mb"], "unit": "MiB", "model": model},
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.engine", description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(prompts.MODELS), help="model names")
    parser.add_argument("--json", type=str, help="write the result rows to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: measure this model, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    results = []
    for name in args.models:
        child = subprocess.run([sys.executable, "-m", "benchmarks.engine", "--one", name],
                               capture_output=True, text=True)
        if child.returncode != 0:
            sys.stderr.write(child.stderr)
            return child.returncode
        result = json.loads(child.stdout.strip().splitlines()[-1])
        results.append(result)
        print(f"{name}: load {result['load_s']} s, prefill {result['prefill_tok_s']} tok/s, "
              f"decode {result['decode_tok_s']} tok/s, weight matrices {result['weights_mb']} MiB, weights RSS {result['weights_rss_mb']} MiB "
              f"(shared {result['weights_shared_mb']} + heap {result['weights_anon_mb']} "
              f"+ mapped file pages {result['weights_mmap_mb']}; "
              f"file {result['file_mb']} MiB), peak RSS {result['peak_rss_mb']} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row for result in results for row in rows(result)], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

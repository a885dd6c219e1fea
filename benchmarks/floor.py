"""The decode kernel alone: one pass over a model's quantized matrices, on one core.

    python -m benchmarks.floor smollm2:135m-instruct-q4_1 --rows 1,8 --processes 1,2

A decode step reads every weight once, in its matmuls, and does per-sequence work
between them (attention, norms). This measures the first part with nothing around it:
each quantized matrix of the model, in the order a step uses them, through the decode
kernel (QuantWeight._decode_tiles and the mins' part) at `rows` rows of random x, over
and over for `--seconds`. Each pass runs in a child process of its own with one thread
(LMSP_THREADS=1: no accelerator, so no helper process and no split over threads); with `--processes 2`, two
such children run at once, as both cores are busy in a step. It prints the milliseconds
of one pass and nanoseconds per weight, by matrix, and a pass shared out over that many
processes: what the matmuls of a step would take with a perfect split and no cost for
sharing them (the number a step's time is to be compared with, minus its per-sequence
work: see `python -m benchmarks.turns`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROLES = ("qkv", "attn_output", "gate_up", "ffn_down")  # a block's matrices, in the order a step uses them


def matrices(model) -> list[tuple[str, object]]:
    """(role, weight) of every matrix a decode step multiplies by, in order: the blocks', then the output."""
    blocks = [(role, getattr(block, role)) for block in model.weights.blocks for role in ROLES]
    return blocks + [("output", model.weights.output)]


def passes(path: str, rows: int, seconds: float) -> dict:
    """In this process (a child): load the model, wait for "go" on stdin, then time passes
    over its quantized matrices for `seconds`: seconds per pass (the median), and
    nanoseconds per weight by role (over all the passes)."""
    import numpy as np

    from engine import load_model
    from engine.quants import QuantWeight

    model = load_model(path)
    if model.accel is not None:
        raise RuntimeError("benchmarks.floor times the plain kernels: run its children with LMSP_THREADS=1")
    chosen = [(role, w) for role, w in matrices(model) if isinstance(w, QuantWeight)]
    skipped = sorted({role for role, w in matrices(model) if not isinstance(w, QuantWeight)})
    rng = np.random.default_rng(0)
    xs = {n_in: rng.standard_normal((rows, n_in), dtype=np.float32) for n_in in {w.shape[1] for _, w in chosen}}
    ys = [np.empty((rows, w.n_tiles * w.tile_rows), np.float32) for _, w in chosen]

    def one_pass(seconds_by_role: dict[str, float] | None) -> None:
        for (role, w), y in zip(chosen, ys):
            started = time.perf_counter()
            x = xs[w.shape[1]]
            w._decode_tiles(x, y, 0, w.n_tiles)
            mins = w._mins_part(x)
            if mins is not None:
                y += mins
            if seconds_by_role is not None:
                seconds_by_role[role] = seconds_by_role.get(role, 0.0) + time.perf_counter() - started

    one_pass(None)  # scratch buffers allocated, code paths warm
    print("ready", flush=True)
    sys.stdin.readline()
    by_role: dict[str, float] = {}
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or not times:
        started = time.perf_counter()
        one_pass(by_role)
        times.append(time.perf_counter() - started)
    values: dict[str, int] = {}
    for role, w in chosen:
        values[role] = values.get(role, 0) + w.shape[0] * w.shape[1]
    return {"pass_s": statistics.median(times), "passes": len(times), "weights": sum(values.values()),
            "ns_per_weight": {role: by_role[role] / len(times) / values[role] * 1e9 for role in values},
            "skipped": skipped}


def run(path: str, rows: int, n_processes: int, seconds: float) -> list[dict]:
    """n_processes children doing passes at the same time; their results."""
    env = {**os.environ, "LMSP_THREADS": "1"}  # one thread: the plain kernels (BLAS: one thread, set at load)
    root = Path(__file__).resolve().parent.parent
    children = [subprocess.Popen([sys.executable, "-m", "benchmarks.floor", "--child", path, str(rows), str(seconds)],
                                 cwd=root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for _ in range(n_processes)]
    try:
        for child in children:  # every child loaded before any starts timing
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("a child failed before its passes (its error is above)")
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        outputs = [child.stdout.read() for child in children]
        if any(child.wait() for child in children):
            raise RuntimeError("a child failed (its error is above)")
    finally:
        for child in children:  # the others, when one failed
            if child.poll() is None:
                child.kill()
                child.wait()
    results = [json.loads(output) for output in outputs]
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="a model name (fetched if needed) or a GGUF file")
    parser.add_argument("--rows", default="1,8", help="rows of x, comma-separated (default 1,8)")
    parser.add_argument("--processes", default="1,2", help="processes at once, comma-separated (default 1,2)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of passes per measurement")
    parser.add_argument("--json", type=Path, help="write the result rows to this file")
    parser.add_argument("--child", nargs=3, metavar=("PATH", "ROWS", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        path, rows, seconds = args.child
        print(json.dumps(passes(path, int(rows), float(seconds))), flush=True)
        return
    if not args.model:
        parser.error("give a model")
    from benchmarks.prompts import model_path

    path = str(model_path(args.model))
    table = []
    print(f"{Path(path).name}: one pass over the quantized matrices, the decode kernel on one core per process")
    for rows in (int(r) for r in args.rows.split(",")):
        for n in (int(p) for p in args.processes.split(",")):
            results = run(path, rows, n, args.seconds)
            pass_ms = [r["pass_s"] * 1e3 for r in results]
            weights = results[0]["weights"]
            by_role = {role: statistics.mean(r["ns_per_weight"][role] for r in results)
                       for role in results[0]["ns_per_weight"]}
            label = f"{rows} row{'s' if rows > 1 else ''}, {n} process{'es' if n > 1 else ''} at once"
            row = {"name": label, "value": round(statistics.mean(pass_ms), 2), "unit": "ms/pass",
                   "each_ms": [round(ms, 2) for ms in pass_ms], "weights": weights,
                   "ns_per_weight": round(statistics.mean(pass_ms) * 1e6 / weights, 3),
                   "shared_out_ms": round(statistics.mean(pass_ms) / n, 2),
                   "by_role_ns_per_weight": {role: round(v, 3) for role, v in by_role.items()}}
            if results[0]["skipped"]:
                row["not_quantized"] = results[0]["skipped"]
            table.append(row)
            roles = " ".join(f"{role} {v:.3f}" for role, v in by_role.items())
            print(f"  {label}: "
                  f"{' / '.join(f'{ms:.1f}' for ms in pass_ms)} ms per pass ({row['ns_per_weight']:.3f} ns per weight; "
                  f"{roles}); shared out over {n}: {row['shared_out_ms']:.1f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()

"""Embeddings: what batching buys, and how close llama.cpp's vectors are.

    python -m benchmarks.embeddings                          # SmolLM2
    python -m benchmarks.embeddings --models gemma3:270m-q4_k_m --json out.json

For each model, in this process:
- 64 apart: 64 sentences of the prose of benchmarks/prompts.py (about 20 tokens
  each), one `embed` call each (what a client sending them one request at a time
  costs the engine); one input's time is their mean;
- 64 together: the same 64 in the groups `POST /v1/embeddings` runs them in
  (engine/api.py `embedding_groups`: 512 tokens a forward step), and its ratio to
  one input: well under 64 is the point of batching;
- agreement (with llama-cpp-python installed): the lowest cosine, over the 64
  sentences, of our vector and llama.cpp's (`Llama(embedding=True, pooling_type=...)`,
  `embed(normalize=True)`), for mean, cls and last pooling.
Timings on a shared machine are noisy; run it when the machine is quiet.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import numpy as np

from benchmarks import prompts
from engine import load_model
from engine.api import embedding_groups

N_INPUTS = 64


def sentences(n: int = N_INPUTS) -> list[str]:
    """The first n sentences of the prose."""
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", prompts.TEXT) if len(s.strip().split()) >= 5]
    return (found * (n // len(found) + 1))[:n]


def seconds(work, repeat: int) -> float:
    """The median wall time of `work()` over `repeat` runs, after one warm-up run."""
    work()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batching_rows(name: str, model, token_lists: list[list[int]]) -> list[dict]:
    """One input's time is the mean of the 64 embedded apart (their lengths vary)."""
    apart = seconds(lambda: [model.embed([ids]) for ids in token_lists], repeat=1)
    groups = embedding_groups([len(ids) for ids in token_lists])
    together = seconds(lambda: [model.embed([token_lists[i] for i in group]) for group in groups], repeat=1)
    one, n, tokens = apart / len(token_lists), len(token_lists), sum(map(len, token_lists))
    return [
        {"name": f"{name}: embed 1 input", "value": round(one * 1000, 1), "unit": "ms",
         "tokens": round(tokens / n, 1)},
        {"name": f"{name}: embed {n} apart", "value": round(apart * 1000), "unit": "ms", "x_one": n},
        {"name": f"{name}: embed {n} together", "value": round(together * 1000), "unit": "ms",
         "x_one": round(together / one, 1), "steps": len(groups), "tokens": tokens},
    ]


def agreement_rows(name: str, path, model, texts: list[str]) -> list[dict]:
    try:
        import llama_cpp
    except ImportError:
        return []
    rows = []
    for pooling in ("mean", "cls", "last"):
        code = getattr(llama_cpp, f"LLAMA_POOLING_TYPE_{pooling.upper()}")
        oracle = llama_cpp.Llama(model_path=str(path), embedding=True, pooling_type=code, n_ctx=512, verbose=False)
        try:
            theirs = [np.asarray(oracle.embed(text, normalize=True)) for text in texts]
        finally:
            oracle.close()
        ours = [np.frombuffer(v, "<f4") for v in model.embed([model.tokenize(t) for t in texts], pooling)]
        cosines = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(ours, theirs)]
        rows.append({"name": f"{name}: cosine to llama.cpp, {pooling}", "value": round(min(cosines), 5),
                     "median": round(statistics.median(cosines), 5)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[prompts.MODELS[0]])
    parser.add_argument("--json", metavar="FILE", help="write the rows here")
    args = parser.parse_args()
    rows = []
    texts = sentences()
    for name in args.models:
        path = prompts.model_path(name)
        with load_model(path) as model:
            token_lists = [model.tokenize(text) for text in texts]
            rows += batching_rows(name, model, token_lists)
            rows += agreement_rows(name, path, model, texts)
    for row in rows:
        extra = " ".join(f"{k}={v}" for k, v in row.items() if k not in ("name", "value", "unit"))
        print(f"{row['name']:<55} {row['value']:>10} {row.get('unit', '')}  {extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

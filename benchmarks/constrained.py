"""What constrained decoding costs: token masks per step, and constrained vs free decoding.

1. Mask cost, both vocabularies (SmolLM2 49,152 tokens, Gemma 3 262,144), no model needed:
   a "model" of random logits writes documents for a few schemas (and, apart, for
   FORMATS_SCHEMA) under the sampler's rule
   (draw, `allows()`, else mask and draw again). Reported per step: how often a mask was
   needed, the time of a freshly computed mask, and the whole constraint time per step
   (allows + mask + advance, caches warm as in a real run); and the same with a budget of
   40 tokens, which the documents need more than: the masks near its end are exact for it.
2. Slowdown with the real SmolLM2 (from the model store): greedy decoding of the same prompt
   free, with a JSON schema, with a 20-field schema of formats and patterns (FORMATS_SCHEMA)
   and with a required tool call (masks and transitions cold); time
   per generated token each way (best of 2, interleaved: the machine is shared), and the
   time spent inside the constraint per token, which is the slowdown free of the noise of
   other processes.

    python -m benchmarks.constrained            # both parts
    python -m benchmarks.constrained --masks    # part 1 only
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine.constrain import TokenIndex, json_constraint
from tests.tiny import load_tokenizer_meta
from engine.tokenizer import Tokenizer
from engine.tools import tool_constraint

DATA = __import__("pathlib").Path(__file__).parent.parent / "tests" / "data"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "member"],
}
# 20 fields, half of them formats and patterns (engine/constrain/regex.py's DFAs), all required
FORMATS_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "created": {"type": "string", "format": "date-time"},
        "birthday": {"type": "string", "format": "date"},
        "alarm": {"type": "string", "format": "time"},
        "timeout": {"type": "string", "format": "duration"},
        "email": {"type": "string", "format": "email", "maxLength": 40},
        "homepage": {"type": "string", "format": "uri", "maxLength": 60},
        "ipv4": {"type": "string", "format": "ipv4"},
        "ipv6": {"type": "string", "format": "ipv6"},
        "host": {"type": "string", "format": "hostname", "maxLength": 40},
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"},
        "phone": {"type": "string", "pattern": "^\\+?\\d{1,3}[ -]?\\d{3}[ -]?\\d{4}$"},
        "zip": {"type": "string", "pattern": "^\\d{5}(-\\d{4})?$"},
        "color": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
        "slug": {"type": "string", "pattern": "^[a-z0-9]+(-[a-z0-9]+)*$", "maxLength": 30},
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "status": {"enum": ["active", "inactive", "banned"]},
        "verified": {"type": "boolean"},
    },
    "additionalProperties": False,
}
FORMATS_SCHEMA["required"] = list(FORMATS_SCHEMA["properties"])
TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}},
    {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 40}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
        "required": ["query"]}},
]


def mask_cost(vocab: str, runs: int = 6, max_tokens: int = 120, budget: int | None = None,
              schema: dict | None = None) -> dict:
    """Constraint time per step over random-logit decodes (see the module docstring): the
    schema and the tools by turns, or `schema` alone; with a `budget`, each decode may take
    that many tokens and must close its document within them."""
    tok = Tokenizer.from_metadata(load_tokenizer_meta(DATA / f"tokenizer-meta.{vocab}.json.gz"))
    start = time.perf_counter()
    index = TokenIndex.of(tok)
    build = time.perf_counter() - start
    steps = masks = 0
    mask_seconds: list[float] = []
    constraint_seconds = 0.0
    for run in range(runs):
        rng = np.random.default_rng(run)
        if schema is not None:
            c = json_constraint(schema, index)
        else:
            c = json_constraint(SCHEMA, index) if run % 2 == 0 else tool_constraint(TOOLS, "required", index)
        c.grammar._masks.clear()  # cold masks: measure computing them, not the cache
        c.grammar._needs.clear()
        if budget is not None:
            c.limit(budget)
        for _ in range(max_tokens if budget is None else budget):
            if c.is_done():
                break
            logits = rng.random(index.n_vocab, dtype=np.float32)   # (V,)
            t0 = time.perf_counter()
            token = int(np.argmax(logits))
            if not c.allows(token):
                m0 = time.perf_counter()
                cached = c.state in c.grammar._masks and (budget is None or c.state in c.grammar._needs)
                mask = c.mask()                                     # (V,) bool
                if not cached:
                    mask_seconds.append(time.perf_counter() - m0)
                masks += 1
                token = int(np.argmax(np.where(mask, logits, -np.inf)))
                while not c.allows(token):  # (far from the budget's end a mask may hold a few more)
                    mask[token] = False
                    token = int(np.argmax(np.where(mask, logits, -np.inf)))
            c.advance(token)
            constraint_seconds += time.perf_counter() - t0
            steps += 1
    return {
        "vocab": vocab, "schema": "formats" if schema is not None else "schema+tools", "n_vocab": index.n_vocab,
        "budget": budget, "index_build_s": round(build, 2), "steps": steps,
        "mask_fraction": round(masks / steps, 2),
        "mask_ms_median": round(1000 * float(np.median(mask_seconds)), 2),
        "mask_ms_mean": round(1000 * float(np.mean(mask_seconds)), 2),
        "constraint_ms_per_step": round(1000 * constraint_seconds / steps, 2),
    }


class _Timed:
    """A constraint that adds up the time spent in it (the overhead constrained decoding adds)."""

    def __init__(self, constraint):
        self.inner, self.seconds = constraint, 0.0

    def _call(self, method, *args):
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def allows(self, token_id):
        return self._call(self.inner.allows, token_id)

    def mask(self):
        return self._call(self.inner.mask)

    def advance(self, token_id):
        return self._call(self.inner.advance, token_id)

    def is_done(self):
        return self._call(self.inner.is_done)


def slowdown(path, max_tokens: int = 48, repeats: int = 2) -> dict:
    """Greedy decode of SmolLM2, free and JSON-constrained: ms per generated token (best of
    `repeats`, interleaved), and the time spent inside the constraint per token."""
    import trio

    from engine.model import load_model
    from engine.api import SamplingParams

    model = load_model(path)
    prompt = model.apply_chat_template([{"role": "user", "content":
        "Describe a person called Ada Lovelace from London as JSON with name, age, city, tags, score, member."}])
    ids = model.tokenize(prompt, parse_special=True)
    index = TokenIndex.of(model.tokenizer)

    async def run(constraint):
        gen = model.generate(ids, max_tokens=max_tokens, sampling=SamplingParams(temperature=0),
                             constraint=constraint)
        n, first = 0, None
        async for _ in gen:
            n += 1
            if first is None:
                first = time.perf_counter()  # decode steps only, the prefill is not counted
        return (time.perf_counter() - first) / max(n - 1, 1), n

    trio.run(run, None)  # warm up
    kinds = {"json": lambda: json_constraint(SCHEMA, index),
             "json_formats": lambda: json_constraint(FORMATS_SCHEMA, index),
             # the model would rather answer in words: the first tokens need masks
             "tool_call": lambda: tool_constraint(TOOLS, "required", index)}
    for make in kinds.values():
        make()  # grammars compiled once, as a repeated request would find them
    free = float("inf")
    best = {kind: float("inf") for kind in kinds}
    inside = {}
    for _ in range(repeats):
        free = min(free, trio.run(run, None)[0])
        for kind, make in kinds.items():
            timed = _Timed(make())
            timed.inner.grammar._masks.clear()  # cold: masks and transitions computed anew
            timed.inner.grammar._steps.clear()
            timed.inner.grammar._needs.clear()
            timed.inner.limit(max_tokens)  # (as Generation does for a GrammarConstraint: the wrapper hides it)
            seconds, n = trio.run(run, timed)
            best[kind] = min(best[kind], seconds)
            inside[kind] = timed.seconds / n
    out = {"free_ms_per_token": round(1000 * free, 1)}
    for kind in kinds:
        out[kind] = {"ms_per_token": round(1000 * best[kind], 1),
                     "slowdown_pct": round(100 * (best[kind] / free - 1), 1),
                     "constraint_ms_per_token": round(1000 * inside[kind], 2),
                     "constraint_share_pct": round(100 * inside[kind] / free, 1)}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masks", action="store_true", help="only the mask costs (no model)")
    args = parser.parse_args(argv)
    for vocab in ("smollm2", "gemma3"):
        print(mask_cost(vocab))
        print(mask_cost(vocab, budget=40))  # documents cut by their budget: the exact masks near its end
        print(mask_cost(vocab, max_tokens=400, schema=FORMATS_SCHEMA))
    if not args.masks:
        from lmsp_min import fetch
        print(slowdown(fetch.pull("smollm2:135m-instruct-q4_1")))


if __name__ == "__main__":
    main()

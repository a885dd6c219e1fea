"""Drafts (engine/speculate.py) and forced text (engine/jump_forward.py) change no output.

A draft is verified by the request's own `pick` at every drafted position, so greedy
decoding gives the tokens of one token per step (up to the near ties the batch rules
allow, tests/test_scheduler.py), seeded sampling the same draws, and sampling the same
distribution (a chi-square test against the probabilities of engine/reference.py's
float64 forward). Two kinds of drafts are checked: the context's own (prompt lookup, as
served), and an oracle's (the continuation decoding one token per step gave, with a
wrong token planted), which makes every path run: taken runs, rejections, rollbacks.
"""

import json
import math
import threading

import jsonschema
import numpy as np
import pytest
import trio

import engine.speculate as speculate
from engine import load_model
from engine.api import ChatRequest, TextDelta, ToolCall
from engine.constrain import json_constraint, TokenIndex
from engine.jump_forward import draft_bytes, forced_bytes
from engine.reference import reference_logits
from engine.api import SamplingParams
from engine.sampling import Sampler
from engine.scheduler import Scheduler
from test_scheduler import assert_same_greedy, greedy
from tiny import ARCHITECTURES, write_tiny_model
from waiting import wait_until


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{request.param}.gguf"
    with load_model(write_tiny_model(path, request.param)) as model:
        yield model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    with load_model(write_tiny_model(path, "llama")) as model:
        yield model


def repeating_prompt(n: int = 60, period: int = 7, seed: int = 0) -> list[int]:
    """A prompt that repeats a few tokens: the context has matches for the drafter."""
    base = np.random.default_rng(seed).integers(2, 40000, period).tolist()
    return [1] + (base * (n // period + 1))[: n - 1]


async def run(scheduler: Scheduler, prompt: list[int], n: int, pick=greedy, **submit) -> list[int]:
    with scheduler.submit(prompt, pick=pick, max_tokens=n, **submit) as steps:
        return [step.token async for step in steps]


class OracleDrafts:
    """Drafts that are the expected continuation, with one planted error every `wrong`
    tokens, and acceptance rates that always make the drafts worth sending."""

    def __init__(self, monkeypatch, prompt: list[int], expected: list[int], wrong: int = 5):
        self.prompt, self.expected, self.wrong = prompt, expected, wrong
        self.proposed = 0
        oracle = self

        def propose(drafter, limit):
            done = len(drafter.lookup.tokens) - len(oracle.prompt)  # tokens taken so far
            draft = list(oracle.expected[done: done + limit])
            if len(draft) > 2:
                draft[2 if done % oracle.wrong else 1] = 3  # (3: a token that is never the argmax here)
            oracle.proposed += len(draft)
            return draft, speculate.Acceptance(0.99)

        monkeypatch.setattr(speculate.Drafter, "propose", propose)


async def test_greedy_output_is_the_same_with_drafts_from_the_context(model):
    prompt = repeating_prompt()
    plain = Scheduler(model, speculate=False)
    drafted = Scheduler(model)
    try:
        expected = await run(plain, prompt, 40)
        got = await run(drafted, prompt, 40)
    finally:
        plain.close()
        drafted.close()
    assert_same_greedy(model, prompt, expected, got)


async def test_greedy_output_is_the_same_with_oracle_drafts(model, monkeypatch):
    prompt = repeating_prompt(seed=1)
    plain = Scheduler(model, speculate=False)
    expected = await run(plain, prompt, 30)
    plain.close()
    oracle = OracleDrafts(monkeypatch, prompt, expected)
    drafted = Scheduler(model)
    steps = model.steps
    try:
        got = await run(drafted, prompt, 30)
    finally:
        drafted.close()
    assert_same_greedy(model, prompt, expected, got)
    assert oracle.proposed and drafted.drafting.accepted and drafted.drafting.accepted < drafted.drafting.drafted  # taken and rejected
    assert model.steps - steps < 30 // 2  # several tokens per step


@pytest.mark.parametrize("kv_positions", [None, 600])
async def test_batched_sequences_with_drafts_give_the_same_tokens(llama, kv_positions):
    prompts = [repeating_prompt(40 + 9 * i, period=3 + i, seed=i) for i in range(5)]
    plain = Scheduler(llama, speculate=False)
    expected = [await run(plain, p, 24) for p in prompts]
    plain.close()
    # (600 positions: two requests' caches at a time, the others wait, drafts within the bound)
    budget = kv_positions and kv_positions * llama.kv_bytes_per_position
    drafted = Scheduler(llama, max_batch=4, prefill_chunk=32, kv_cache_bytes=budget)
    got = [None] * len(prompts)

    async def one(i: int) -> None:
        got[i] = await run(drafted, prompts[i], 24)

    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    finally:
        drafted.close()
    for p, e, g in zip(prompts, expected, got):
        assert_same_greedy(llama, p, e, g)


async def test_the_prefix_cache_after_drafts_holds_only_taken_tokens(llama, monkeypatch):
    prompt = repeating_prompt(seed=2)
    plain = Scheduler(llama, speculate=False)
    expected = await run(plain, prompt, 20)
    plain.close()
    OracleDrafts(monkeypatch, prompt, expected)
    drafted = Scheduler(llama)
    try:
        await run(drafted, prompt, 20)
        (tokens, seq), = drafted.prefix_cache._entries.values()
        assert list(tokens) == (prompt + expected)[: seq.cache.length]
        assert seq.cache.length == len(prompt) + len(expected) - 1  # the last token taken: never fed
        # its KV cache is the one-token-per-step cache: a continuation from it agrees
        again = await run(drafted, prompt + expected, 6)
    finally:
        drafted.close()
    alone = Scheduler(llama, speculate=False, prefix_cache_bytes=0)
    assert_same_greedy(llama, prompt + expected, await run(alone, prompt + expected, 6), again)
    alone.close()


async def test_max_tokens_and_stop_ids_end_a_taken_run(llama, monkeypatch):
    prompt = repeating_prompt(seed=3)
    plain = Scheduler(llama, speculate=False)
    expected = await run(plain, prompt, 30)
    plain.close()
    OracleDrafts(monkeypatch, prompt, expected, wrong=1000)
    drafted = Scheduler(llama)
    try:
        assert await run(drafted, prompt, 7) == expected[:7]
        stop = expected[9]
        with drafted.submit(prompt, pick=greedy, max_tokens=30, stop_ids=frozenset({stop})) as steps:
            got = [step async for step in steps]
        assert [s.token for s in got] == expected[: expected.index(stop) + 1]
        assert got[-1].finish_reason == "stop" and steps.finish_reason == "stop"
    finally:
        drafted.close()


async def test_a_cancel_during_a_draft_step_leaves_no_draft_token_behind(llama, monkeypatch):
    prompt = repeating_prompt(seed=4)
    plain = Scheduler(llama, speculate=False)
    expected = await run(plain, prompt, 30)
    plain.close()
    OracleDrafts(monkeypatch, prompt, expected, wrong=1000)
    drafted = Scheduler(llama)
    inner = llama.step
    entered, release = trio.Event(), threading.Event()
    token = trio.lowlevel.current_trio_token()

    def gated_step(sequences, **kw):
        if any(s.n_pending > 1 and s.cache.length >= len(prompt) for s in sequences):  # a draft step
            token.run_sync_soon(entered.set)
            release.wait(30)
        return inner(sequences, **kw)

    monkeypatch.setattr(llama, "step", gated_step)
    try:
        with trio.fail_after(30):
            with drafted.submit(prompt, pick=greedy, max_tokens=30) as steps:
                first = await steps.__anext__()
                await entered.wait()
                steps.cancel()  # while the draft step runs
                release.set()
            assert first.token == expected[0]
            await wait_until(lambda: not drafted.running, "the worker stopped")
    finally:
        release.set()
        drafted.close()
    (tokens, seq), = drafted.prefix_cache._entries.values()
    assert list(tokens) == (prompt + expected)[: seq.cache.length]  # no draft token left in it


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile for a standard normal quantile z (Wilson-Hilferty;
    3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def top_k_probs(logits: np.ndarray, k: int) -> dict[int, float]:
    """The top-k distribution the sampler draws from at temperature 1."""
    ids = np.argsort(-logits, kind="stable")[:k]
    z = logits[ids].astype(np.float64)
    p = np.exp(z - z.max())
    return dict(zip(ids.tolist(), (p / p.sum()).tolist()))


async def test_sampling_with_drafts_keeps_the_distribution(llama, monkeypatch):
    """Seeded draws repeat exactly with drafts; over many seeds the pairs of tokens after
    the first follow the exact top-k distribution (chi-square, fixed seeds)."""
    k, n = 3, 1000
    prompt = repeating_prompt(20, seed=5)
    first = max(p := top_k_probs(reference_logits(llama, prompt)[-1], k), key=p.get)
    second_p = top_k_probs(reference_logits(llama, prompt + [first])[-1], k)
    second = max(second_p, key=second_p.get)
    third_p = {t: top_k_probs(reference_logits(llama, prompt + [first, t])[-1], k) for t in second_p}
    # drafts: the likeliest path, whatever came before (so that they are taken and rejected)

    def propose(drafter, limit):
        return [second, max(third_p[second], key=third_p[second].get)][:limit], speculate.Acceptance(0.99)

    def sampler(seed: int) -> Sampler:
        return Sampler(SamplingParams(temperature=1.0, top_k=k, seed=seed))

    async def draws(scheduler: Scheduler, seeds) -> list[tuple[int, ...]]:
        out = [None] * len(seeds)

        async def one(i: int) -> None:
            out[i] = tuple(await run(scheduler, prompt, 3, pick=sampler(seeds[i]).pick))

        async with trio.open_nursery() as nursery:
            for i in range(len(seeds)):
                nursery.start_soon(one, i)
        return out

    plain = Scheduler(llama, speculate=False)
    expected = await draws(plain, range(8))
    plain.close()
    monkeypatch.setattr(speculate.Drafter, "propose", propose)
    drafted = Scheduler(llama, max_batch=32, max_queue=n)
    try:
        assert await draws(drafted, range(8)) == expected  # the same draws in the same order
        got = await draws(drafted, range(100, 100 + n))
    finally:
        drafted.close()
    assert drafted.drafting.accepted and drafted.drafting.accepted < drafted.drafting.drafted
    # (token 2, token 3) given token 1 = first: its exact distribution from the float64 forward
    pairs = [g[1:] for g in got if g[0] == first]
    cells = {(a, b): second_p[a] * third_p[a][b] for a in second_p for b in third_p[a]}
    counts = {c: 0 for c in cells}
    for pair in pairs:
        counts[pair] += 1
    chi2 = sum((counts[c] - len(pairs) * q) ** 2 / (len(pairs) * q) for c, q in cells.items())
    assert len(pairs) > n // 8
    assert chi2 < chi_square_critical(len(cells) - 1), (chi2, counts)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"enum": ["Paris", "Lima", "Oslo"]},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "city", "member", "tags"],
}


def test_forced_bytes_are_what_the_schema_leaves_no_choice_about(llama):
    constraint = json_constraint(SCHEMA, TokenIndex.of(llama.tokenizer))
    assert forced_bytes(constraint) == b'{"name":'
    for token in llama.tokenize('{"name": "Ada", ', add_special=False):
        constraint.advance(token)
    assert forced_bytes(constraint) == b'"age":'


def test_drafts_assume_the_space_after_commas_and_colons_where_forced_text_follows(llama):
    constraint = json_constraint(SCHEMA, TokenIndex.of(llama.tokenizer))
    assert draft_bytes(constraint) == b'{"name": "'  # the space, then the string's quote
    for token in llama.tokenize('{"name": "Ada",', add_special=False):
        constraint.advance(token)
    assert forced_bytes(constraint) == b""  # a space or none: the model's choice
    assert draft_bytes(constraint) == b' "age":'  # an integer follows: no guess past the colon
    for token in llama.tokenize(' "age": 7', add_special=False):
        constraint.advance(token)
    assert draft_bytes(constraint) == b""  # inside the number: free


async def chat_text(model, request: ChatRequest) -> tuple[str, list]:
    prepared = model.prepare_chat(request)
    events = [e async for e in model.generate_chat(prepared)]
    return "".join(e.text for e in events if isinstance(e, TextDelta)), events


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_constrained_output_is_the_same_and_valid_with_forced_text(model, temperature):
    outputs = []
    drafted = model.scheduler.drafting.drafted
    for speculate_on in (False, True):
        model.scheduler.speculate = speculate_on
        try:
            request = ChatRequest([{"role": "user", "content": "A person, please."}], max_tokens=120,
                                  sampling=SamplingParams(temperature=temperature, seed=7), json_schema=SCHEMA)
            text, events = await chat_text(model, request)
        finally:
            model.scheduler.speculate = True
        assert events[-1].reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        outputs.append(text)
    assert outputs[0] == outputs[1]  # greedy, or seeded: the same draws in the same order
    assert model.scheduler.drafting.drafted > drafted  # forced text was drafted


async def test_a_constrained_prompt_carries_its_forced_start_in_its_last_step(llama, monkeypatch):
    """The text a schema forces first (`{"name": "`) is drafted after the prompt, in the
    step that computes the prompt's end, not in a step of its own after it."""
    request = ChatRequest([{"role": "user", "content": "Someone else, please."}], max_tokens=40,
                          sampling=SamplingParams(temperature=0), json_schema=SCHEMA)
    prepared = llama.prepare_chat(request)
    first_step = []
    real_step = llama.step

    def step(sequences, **kwargs):
        if not first_step:
            first_step.append(len(sequences[0].tokens) - len(prepared.prompt_ids))  # tokens fed after the prompt
        return real_step(sequences, **kwargs)

    monkeypatch.setattr(llama, "step", step)
    events = [e async for e in llama.generate_chat(prepared)]
    assert first_step[0] > 0
    assert events[-1].reason in ("stop", "length")


async def test_a_tool_call_is_the_same_with_forced_text(model):
    tools = [{"name": "get_weather", "description": "the weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}]
    calls = []
    for speculate_on in (False, True):
        model.scheduler.speculate = speculate_on
        try:
            request = ChatRequest([{"role": "user", "content": "Weather in Oslo?"}], max_tokens=80,
                                  sampling=SamplingParams(temperature=0), tools=tools, tool_choice="required")
            _, events = await chat_text(model, request)
        finally:
            model.scheduler.speculate = True
        calls.append([(e.name, e.arguments) for e in events if isinstance(e, ToolCall)])
    assert calls[0] == calls[1] and calls[0] and calls[0][0][0] == "get_weather"


async def test_a_stop_sequence_inside_a_taken_run_ends_the_text_and_the_count(llama, monkeypatch):
    prompt = repeating_prompt(seed=6)
    plain = Scheduler(llama, speculate=False)
    expected = await run(plain, prompt, 30)
    plain.close()
    text = llama.detokenize(expected)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    results = []
    for oracle in (False, True):
        if oracle:
            OracleDrafts(monkeypatch, prompt, expected, wrong=1000)
        generation = llama.generate(prompt, max_tokens=30, sampling=SamplingParams(temperature=0), stop=[stop])
        got = "".join([t.text async for t in generation])
        results.append((got, generation.n_generated, generation.finish_reason))
    assert results[0] == results[1]
    assert results[0][2] == "stop" and stop not in results[0][0] and text.startswith(results[0][0])


def test_draft_lengths_back_off_where_drafts_do_not_pay():
    cost = speculate.StepCost()
    for rows, seconds in ((1, 1.0), (2, 1.3), (5, 1.9), (9, 2.8)):
        cost.record(rows, seconds)
    sure, doubtful = speculate.Acceptance(0.95), speculate.Acceptance(0.1)
    draft = list(range(8))
    assert speculate.draft_lengths([(draft, sure)], 1, 1, cost)[0] >= 4
    assert speculate.draft_lengths([(draft, doubtful)], 1, 1, cost) == [0]
    for _ in range(6):  # drafts that keep failing stop being sent
        sure.observe(8, 0)
    assert speculate.draft_lengths([(draft, sure)], 1, 1, cost) == [0]
    # beside a long prompt chunk, a row more costs little: a doubtful draft pays there
    cost.record(64, 8.0)
    cost.record(66, 8.1)
    assert speculate.draft_lengths([(draft, doubtful)], 64, 1, cost)[0] > 0


def test_prompt_lookup_drafts_what_followed_the_longest_match():
    lookup = speculate.PromptLookup([5, 6, 7, 8, 9, 1, 6, 7, 2, 6])
    assert lookup.propose(3) == ([7, 2, 6], 1)  # "6": its latest occurrence
    lookup.extend([7])
    assert lookup.propose(3) == ([2, 6, 7], 2)  # "6 7": latest earlier occurrence at 6..7
    lookup.extend([2])
    assert lookup.propose(2) == ([6, 7], 3)


@pytest.mark.slow
async def test_smollm2_greedy_output_is_the_same_with_speculation(smollm2_path):
    passage = ("Maria ran the small bakery on the corner of the main street. She started work at four "
               "every morning, mixing flour, water and salt in a wooden trough.")
    with load_model(smollm2_path, n_ctx=2048) as model:
        outputs = []
        for speculate_on in (False, True):
            model.scheduler.speculate = speculate_on
            for content in (f"Copy this text exactly:\n\n{passage}", "Tell me about lighthouses."):
                request = ChatRequest([{"role": "system", "content": "You copy text exactly."},
                                       {"role": "user", "content": content}], max_tokens=80,
                                      sampling=SamplingParams(temperature=0))
                outputs.append((await chat_text(model, request))[0])
            request = ChatRequest([{"role": "user", "content": "A person, please."}], max_tokens=100,
                                  sampling=SamplingParams(temperature=0), json_schema=SCHEMA)
            text = (await chat_text(model, request))[0]
            jsonschema.validate(json.loads(text), SCHEMA)
            outputs.append(text)
        assert model.scheduler.drafting.accepted > 0
    assert outputs[:3] == outputs[3:]

"""The output budget (issue 39): a constrained answer cut by max_tokens parses and validates all
the same, a limit below the shortest answer is refused before any token, and greedy answers
that fitted the limit are what they were. jsonschema is the oracle throughout."""

import json
import random

import jsonschema
import pytest

from engine.api import ChatRequest, SamplingParams, TextDelta
from engine.constrain import TokenIndex, json_constraint
from engine.errors import OutputBudgetTooSmall
from engine.tokenizer import Tokenizer
from test_constrain import run_concurrently, smollm2_model, tiny  # noqa: F401 (fixtures)
from tests.conftest import DATA
from tiny import load_tokenizer_meta


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema of the subset the compiler supports: objects, arrays, enums, strings with
    lengths, integers and numbers with bounds, booleans, nested up to three levels."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        schema = {"type": "string"}
        if rng.random() < 0.5:
            schema["minLength"] = rng.randint(0, 6)
        if rng.random() < 0.5:
            schema["maxLength"] = schema.get("minLength", 0) + rng.randint(0, 12)
        return schema
    if kind in ("integer", "number"):
        schema = {"type": kind}
        if rng.random() < 0.6:
            schema["minimum"] = rng.choice([-1000, -5, 0, 3, 100, 12345])
        if rng.random() < 0.6:
            schema["maximum"] = schema.get("minimum", -10**6) + rng.choice([0, 1, 10, 999, 10**6])
        if kind == "number" and schema.get("maximum", 10**7) > schema.get("minimum", 0.25) and rng.random() < 0.3:
            schema["exclusiveMinimum"] = schema.pop("minimum", 0.25)
        return schema
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "a much longer blue", 7, None, True, "ünï"], rng.randint(1, 4))}
    if kind == "array":
        schema = {"type": "array", "items": random_schema(rng, depth + 1)}
        if rng.random() < 0.5:
            schema["minItems"] = rng.randint(0, 2)
        if rng.random() < 0.5:
            schema["maxItems"] = schema.get("minItems", 0) + rng.randint(0, 3)
        return schema
    names = rng.sample(["name", "age", "city", "tags", "score", "planet", "notable", "x"], rng.randint(1, 4))
    return {"type": "object", "properties": {name: random_schema(rng, depth + 1) for name in names},
            "required": [name for name in names if rng.random() < 0.6]}


# Leaves of the keywords the compiler gained beside the budget (formats, patterns, multiples,
# oneOf, prefixItems): a budget must close them too.
RICH_LEAVES = [
    {"type": "string", "format": "date-time"}, {"type": "string", "format": "email"},
    {"type": "string", "format": "uuid"}, {"type": "string", "format": "ipv4"},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,6}$"}, {"type": "string", "pattern": "^(ab|cd)+x?$"},
    {"type": "integer", "multipleOf": 7, "minimum": 10}, {"type": "integer", "multipleOf": 5},
    {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "string", "format": "date"}], "items": False},
]


def random_rich_schema(rng: random.Random, depth: int = 0) -> dict:
    """random_schema's objects and arrays, with RICH_LEAVES among their leaves."""
    if depth >= 3 or rng.random() < 0.4:
        return dict(rng.choice(RICH_LEAVES))
    if rng.random() < 0.3:
        return {"type": "array", "items": random_rich_schema(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["when", "who", "id", "code", "count", "either"], rng.randint(1, 4))
    return {"type": "object", "properties": {name: random_rich_schema(rng, depth + 1) for name in names},
            "required": [name for name in names if rng.random() < 0.6]}


def cases(n: int, seed: int, schemas=random_schema):
    """n (schema, extra tokens over its shortest answer, sampling) triples, seeded."""
    rng = random.Random(seed)
    for i in range(n):
        sampling = SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.0, seed=i)
        yield schemas(rng, depth=rng.choice([0, 2])), rng.choice([0, 1, 2, 3, 5, 8, 13, 24, 40]), sampling


def shortest_answer(model, schema) -> int:
    """The tokens of the schema's shortest answer, as the refusal names them."""
    try:
        model.prepare_chat(ChatRequest(MESSAGES, max_tokens=1, json_schema=schema))
    except OutputBudgetTooSmall as refused:
        return refused.needed
    return 1


MESSAGES = [{"role": "user", "content": "Answer in JSON: the planet Jupiter, its moons, what is notable."}]


async def answer(model, schema, max_tokens, sampling) -> tuple[str, str, int]:
    """(text, finish reason, output tokens) of the chat answer to MESSAGES under `schema`."""
    prepared = model.prepare_chat(ChatRequest(MESSAGES, max_tokens=max_tokens, sampling=sampling, json_schema=schema))
    events = [event async for event in model.generate_chat(prepared)]
    return "".join(e.text for e in events if isinstance(e, TextDelta)), events[-1].reason, events[-1].output_tokens


async def check_answers(model, n: int, seed: int, at_once: int = 8, schemas=random_schema) -> list:
    """Every answer of n random (schema, budget) pairs parses, validates (formats checked too)
    and keeps the budget."""
    triples = list(cases(n, seed, schemas))

    async def run(i):
        schema, extra, sampling = triples[i]
        budget = shortest_answer(model, schema) + extra
        return budget, await answer(model, schema, budget, sampling)

    results = await run_concurrently(run, n, at_once=at_once)
    for i, (budget, (text, reason, used)) in sorted(results.items()):
        schema = triples[i][0]
        assert used <= budget and reason in ("stop", "length"), (schema, budget, text)
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return [results[i] for i in range(n)]


async def test_every_answer_of_random_schemas_and_budgets_parses_and_validates_on_a_tiny_model(tiny):
    results = await check_answers(tiny, 24, seed=39)
    assert any(reason == "length" for _, (_, reason, _) in results)  # some were cut, and whole all the same


async def test_answers_with_formats_patterns_and_multiples_close_within_their_budgets_too(tiny):
    results = await check_answers(tiny, 24, seed=43, schemas=random_rich_schema)
    assert any(reason == "length" for _, (_, reason, _) in results)


def test_a_budget_below_the_shortest_answer_is_refused_before_any_token_and_that_many_is_enough(tiny):
    schema = {"type": "object", "properties": {"planet": {"type": "string", "minLength": 3},
              "moons": {"type": "integer", "minimum": 10}}, "required": ["planet", "moons"]}
    needed = shortest_answer(tiny, schema)
    assert needed > 1
    with pytest.raises(OutputBudgetTooSmall) as refused:
        tiny.prepare_chat(ChatRequest(MESSAGES, max_tokens=needed - 1, json_schema=schema))
    assert refused.value.needed == needed and str(needed) in str(refused.value)
    tiny.prepare_chat(ChatRequest(MESSAGES, max_tokens=needed, json_schema=schema))


async def test_greedy_answers_that_fitted_their_budget_are_unchanged_on_a_tiny_model(tiny):
    await check_unchanged(tiny, 12, seed=7)


async def check_unchanged(model, n: int, seed: int) -> None:
    """A greedy answer that ends by itself within a roomy budget comes out byte for byte the
    same under a budget of one token more than it took (room for its end token), and a few more."""
    rng = random.Random(seed)
    greedy = SamplingParams(temperature=0)
    checked = 0
    for _ in range(n):
        schema = random_schema(rng, depth=2)
        text, reason, used = await answer(model, schema, 400, greedy)
        if reason != "stop":
            continue
        for budget in (used + 1, used + 2, used + 5):
            assert (await answer(model, schema, budget, greedy))[:2] == (text, "stop"), (schema, budget)
        checked += 1
    assert checked >= n // 3


def test_the_bytes_a_completion_is_made_of_are_tokens_in_both_real_vocabularies():
    """The budget counts a completion in tokens of its bytes (TokenIndex.count_tokens), at
    most one each where each byte is a token: printable ASCII (JSON's structure, numbers,
    escapes, the spaces that fill a minLength) and the bytes of characters up to U+3FFFF
    in keys and enum values. (SmolLM2 has no F1-F3 lead byte: a key of a rarer character
    would be unwritable whatever the budget.)"""
    for vocab in ("smollm2", "gemma3"):
        index = TokenIndex.of(Tokenizer.from_metadata(load_tokenizer_meta(DATA / f"tokenizer-meta.{vocab}.json.gz")))
        completion_bytes = set(range(0x20, 0x7F)) | set(range(0x80, 0xC0)) | set(range(0xC2, 0xF1))
        assert all(bytes((b,)) in index.token_set for b in completion_bytes), vocab
        constraint = json_constraint({"type": "string", "minLength": 3}, index)
        with pytest.raises(OutputBudgetTooSmall) as refused:
            constraint.limit(1)
        assert 1 < refused.value.needed <= len(b'"   "')


# -- the real models (slow) ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3_model(gemma3_path):
    from engine.model import load_model

    return load_model(gemma3_path)


@pytest.mark.slow
async def test_every_answer_of_200_random_schemas_and_budgets_parses_and_validates_on_smollm2(smollm2_model):
    results = await check_answers(smollm2_model, 200, seed=2039)
    assert sum(reason == "length" for _, (_, reason, _) in results) >= 20


@pytest.mark.slow
async def test_random_schemas_and_budgets_parse_and_validate_on_gemma3(gemma3_model):
    await check_answers(gemma3_model, 40, seed=3039, at_once=4)


@pytest.mark.slow
async def test_greedy_answers_that_fitted_their_budget_are_unchanged_on_both_real_models(smollm2_model, gemma3_model):
    await check_unchanged(smollm2_model, 12, seed=11)
    await check_unchanged(gemma3_model, 6, seed=12)


WEATHER = {"name": "get_weather", "description": "Get the current weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.slow
async def test_smollm2s_call_followed_by_a_cut_repeat_ends_finished_and_a_cut_call_parses(smollm2_model):
    """Issue 39's case: SmolLM2 calls get_weather for Oslo in about 32 tokens, then starts
    the same call again. Cut inside the repeat, the answer is that one call, finished;
    cut inside the call, the call is closed in time: it parses and validates, and is cut."""
    from engine.api import ToolCall

    async def calls_and_reason(budget):
        prepared = smollm2_model.prepare_chat(ChatRequest(
            [{"role": "user", "content": "What is the weather in Oslo?"}], max_tokens=budget, tools=[WEATHER],
            tool_choice="required", sampling=SamplingParams(temperature=0)))
        events = [event async for event in smollm2_model.generate_chat(prepared)]
        return [e for e in events if isinstance(e, ToolCall)], events[-1].reason

    for budget in range(40, 60, 3):
        calls, reason = await calls_and_reason(budget)
        assert reason == "stop" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city":"Oslo"}')]
    for budget in range(24, 31, 3):
        calls, reason = await calls_and_reason(budget)
        assert reason == "length" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])

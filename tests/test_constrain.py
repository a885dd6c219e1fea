"""Constrained decoding: the matcher accepts exactly the documents it should, masks agree
with allows(), and random "models" over the real vocabularies only write valid JSON."""

import json
import math
from urllib.parse import unquote

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engine.constrain import Literal, TokenIndex, compile_schema, json_constraint, validate
from engine.constrain.matcher import MAX_CONFIGURATIONS, MAX_DEPTH
from engine.constrain.schema import MAX_ENUM, MAX_ENUM_VALUES, MAX_PROPERTIES, MAX_SUBSCHEMAS
from engine.errors import OutputBudgetTooSmall, SchemaError
from tiny import load_tokenizer_meta
from engine.tokenizer import Tokenizer
from tests.conftest import DATA

# A vocabulary of the 256 single bytes plus an end token: a document is then exactly the
# byte sequence the matcher accepts.
BYTES = TokenIndex([bytes([b]) for b in range(256)] + [b""], eos_ids=[256])


def accepts(schema, text: str) -> bool:
    """Is `text` a complete document for `schema` (every byte accepted, EOS allowed)?"""
    c = json_constraint(schema, BYTES)
    for b in text.encode():
        if not c.allows(b):
            return False
        c.advance(b)
    return c.allows(256)


@pytest.fixture(scope="module")
def smollm2():
    tok = Tokenizer.from_metadata(load_tokenizer_meta(DATA / "tokenizer-meta.smollm2.json.gz"))
    return TokenIndex.of(tok)


def random_run(constraint, n_vocab, seed, max_tokens=400):
    """Decode with random logits as a model would with the sampler: draw, check allows(),
    else draw again from the mask. Returns (bytes written, complete?)."""
    rng = np.random.default_rng(seed)
    for _ in range(max_tokens):
        if constraint.is_done():
            break
        logits = rng.random(n_vocab, dtype=np.float32)             # (V,)
        token = int(np.argmax(logits))
        if not constraint.allows(token):
            mask = constraint.mask()                               # (V,) bool
            assert mask.any()
            token = int(np.argmax(np.where(mask, logits, -np.inf)))
        constraint.advance(token)
    return bytes(constraint.text), constraint.complete()


# Bounded schemas (strings have maxLength, arrays maxItems): a random model has no reason
# to ever close an unbounded string, the constraint only guarantees it can.
SCHEMAS = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "email": {"type": "string", "minLength": 3, "maxLength": 20},
                    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                    "score": {"type": "number", "minimum": -1, "maximum": 1},
                    "active": {"type": "boolean"}},
     "required": ["name", "age", "active"], "additionalProperties": False},
    {"$defs": {"node": {"type": "object",
                        "properties": {"value": {"type": "integer", "exclusiveMinimum": -5, "maximum": 500},
                                       "children": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                    "maxItems": 2}},
                        "required": ["value"]}},
     "$ref": "#/$defs/node"},
    {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "integer", "minimum": 10, "maximum": 20},
               {"type": "null"}, {"const": {"kind": "fixed", "n": [1, 2]}}]},
    {"type": "array", "items": {"type": ["integer", "boolean", "null"]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "title": "Point", "description": "a point",
     "properties": {"x": {"type": "number"}, "y": {"type": "number"},
                    "label": {"type": ["string", "null"], "maxLength": 8}},
     "required": ["x", "y", "label"]},
]


def test_random_model_writes_valid_json_in_50_of_50_runs(smollm2):
    for seed in range(50):
        schema = SCHEMAS[seed % len(SCHEMAS)]
        text, complete = random_run(json_constraint(schema, smollm2), smollm2.n_vocab, seed)
        assert complete, (seed, text)
        jsonschema.validate(json.loads(text), schema)


def test_mask_agrees_with_allows(smollm2):
    """The fast paths (plain string tokens, trie walk) decide exactly as allows() does."""
    schema = SCHEMAS[0]
    c = json_constraint(schema, smollm2)
    rng = np.random.default_rng(1)
    sample = rng.choice(smollm2.n_vocab, 3000, replace=False)
    for prefix in ['{"name":"', '{"name":"a\\', '{"name":"ab", "age":1', '{"name":"ab","age":12,"active":tr']:
        c = json_constraint(schema, smollm2)
        for t in _encode_exact(smollm2, prefix):
            c.advance(t)
        mask = c.mask()
        for t in sample.tolist() + sorted(smollm2.eos_ids):
            assert mask[t] == c.allows(t), (prefix, t, smollm2.token_bytes[t])


def test_a_mask_inside_a_string_two_alternatives_share_takes_the_string_shortcut(smollm2, monkeypatch):
    """Two alternatives inside one string (anyOf of strings, of objects sharing a key) made the
    mask walk the whole vocabulary byte by byte: 70 ms for SmolLM2's, 0.5 s for Gemma's, at
    every token whose state was new. The mask is the union of the stacks' own: each takes
    its shortcut, and decides as allows() does. (Which way a mask was computed shows in no
    result, only in its time, which a test must not race: the trie walk that the others
    share is watched.)"""
    schema = {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "string", "minLength": 3},
                        {"enum": ["abc\\n", "abd"]}]}
    c = json_constraint(schema, smollm2)
    for t in _encode_exact(smollm2, '"ab'):
        c.advance(t)
    assert len(c.state) == 3
    walked = []
    trie_walk = TokenIndex.trie_walk
    monkeypatch.setattr(TokenIndex, "trie_walk",
                        lambda self, recognizer, state: walked.append(state) or trie_walk(self, recognizer, state))
    mask = c.mask()
    assert [[type(stack[-1][0]) for stack in state] for state in walked] == [[Literal]]
    sample = np.random.default_rng(2).choice(smollm2.n_vocab, 3000, replace=False).tolist()
    quote_or_backslash = [i for i, data in enumerate(smollm2.token_bytes) if b'"' in data or b"\\" in data]
    for t in sample + quote_or_backslash + sorted(smollm2.eos_ids):
        assert mask[t] == c.allows(t), (t, smollm2.token_bytes[t])
    assert mask[_encode_exact(smollm2, '"')[0]] and mask[_encode_exact(smollm2, "\\")[0]]


def _encode_exact(index, text):
    """Single-byte tokens spelling `text` (every byte is a token in a byte-level BPE)."""
    single = {data: i for i, data in enumerate(index.token_bytes) if len(data) == 1}
    return [single[bytes([b])] for b in text.encode()]


def test_eos_only_when_complete_and_control_tokens_never(smollm2):
    c = json_constraint({"type": "integer", "minimum": 1, "maximum": 99}, smollm2)
    control = [i for i, data in enumerate(smollm2.token_bytes) if not data]
    assert not c.mask()[control].any()
    c.advance(_encode_exact(smollm2, "4")[0])
    assert c.mask()[sorted(smollm2.eos_ids)].all() and not c.is_done()
    c.advance(_encode_exact(smollm2, "2")[0])
    assert c.is_done()          # two digits are the most 99 allows: nothing can follow
    assert c.mask()[sorted(smollm2.eos_ids)].all() and c.mask().sum() == len(smollm2.eos_ids)


def test_gemma3_vocabulary():
    tok = Tokenizer.from_metadata(load_tokenizer_meta(DATA / "tokenizer-meta.gemma3.json.gz"))
    index = TokenIndex.of(tok)
    for seed in range(3):
        schema = SCHEMAS[seed]
        text, complete = random_run(json_constraint(schema, index), index.n_vocab, seed)
        assert complete, text
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer", "minimum": -3, "maximum": 250},
     ["-3", "0", "7", "250", "199"], ["-4", "251", "007", "-0", "1.0", "", "1e2", " 1"]),
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 1},
     ["0.5", "1", "0.000001", "1.0"], ["0", "0.0", "1.5", "-0.1", ".5", "1.", "0.0000001"]),
    ({"type": "string", "minLength": 2, "maxLength": 3},
     ['"ab"', '"héé"', '"a\\n"', '"\\u00e9z"', '"日本"'], ['"a"', '"abcd"', '"a\nb"', '"\\x"', '"\\ud800a"', '"a']),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "null"}},
      "required": ["b"]},
     ['{"b":"x"}', '{"a":1,"b":""}', '{"a": 1, "b": "", "c": null}', '{"b":"x","c":null}'],
     ['{}', '{"a":1}', '{"b":"x","a":1}', '{"b":"x",}', '{ "b":"x"}', '{"b":"x"} ', '{"b":  "x"}', '{"b":"x","d":1}']),
    ({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
     ["[true]", "[true, false]", "[false,false]"], ["[]", "[true,true,true]", "[true,]", "[1]"]),
    ({"enum": ["a", 1, None, [1, 2]], "type": ["string", "array"]},
     ['"a"', "[1,2]"], ["1", "null", '"b"']),
    ({"type": "object", "additionalProperties": {"type": "integer"}},
     ['{}', '{"x":1,"y":-2}', '{"x": 1, "y": 2}'], ['{"x":"1"}', '{"x":1,}']),
    ({}, ['{"a":[1,"x",null,{"b":true}]}', "-1.5", '"s"'], ["nul", "{'a':1}"]),
])
def test_documents_accepted_and_rejected(schema, good, bad):
    for text in good:
        assert accepts(schema, text), text
        jsonschema.validate(json.loads(text), schema)
    for text in bad:
        assert not accepts(schema, text), text


def test_number_prefixes_never_dead_end():
    """Every accepted prefix of a bounded number can still be completed."""
    schema = {"type": "integer", "minimum": 37, "maximum": 4211}
    c = json_constraint(schema, BYTES)
    seen = 0
    for value in range(0, 5000, 7):
        text = str(value).encode()
        c = json_constraint(schema, BYTES)
        for b in text:
            if not c.allows(b):
                break
            c.advance(b)
            assert c.mask().any()
        else:
            seen += 1
            assert c.allows(256) == (37 <= value <= 4211)
    assert seen > 500


@pytest.mark.parametrize("schema, keyword, path", [
    ({"type": "string", "pattern": "^(?=a)a+$"}, "pattern", "/pattern"),           # a lookahead
    ({"type": "object", "properties": {"d": {"type": "string", "format": "iri"}}}, "format", "/properties/d/format"),
    ({"oneOf": [{"type": "string"}, {"maxLength": 3}]}, "oneOf", "/oneOf"),         # may overlap
    ({"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}, "allOf", "/allOf"),       # two patterns
    ({"type": "array", "items": {"type": "number", "multipleOf": 0.1}}, "multipleOf", "/items/multipleOf"),
    ({"type": "object", "patternProperties": {}}, "patternProperties", "/patternProperties"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems", "/uniqueItems"),
    ({"type": "object", "minProperties": 1}, "minProperties", "/minProperties"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"not": {}}}}, "not", "/$defs/a/not"),
])
def test_unsupported_keywords_are_rejected_by_name(schema, keyword, path):
    with pytest.raises(SchemaError) as e:
        compile_schema(schema)
    assert e.value.keyword == keyword and e.value.path == path and keyword in str(e.value)


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 5, "maximum": 4},
    {"type": "string", "minLength": 4, "maxLength": 2},
    {"$ref": "https://example.com/schema"},
    {"$ref": "#/$defs/missing"},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},    # a reference loop
    {"enum": []},
    {"type": "string", "enum": [1, 2]},                              # no enum value fits
    {"type": "decimal"},
    False,
])
def test_unsatisfiable_or_malformed_schemas_are_rejected(schema):
    with pytest.raises(SchemaError):
        compile_schema(schema)


@pytest.mark.parametrize("schema, keyword, path", [
    # the enum's values were checked against keywords no one had checked: a TypeError (500)
    ({"enum": ["abc"], "properties": {}, "minLength": "2"}, "minLength", "/minLength"),
    ({"enum": [5], "minItems": 2, "minimum": None}, "minimum", "/minimum"),
    ({"type": "integer", "maxLength": -1}, "maxLength", "/maxLength"),     # whatever the type reads
    ({"type": [{}]}, "type", "/type"),
    ({"type": ["string", ["null"]]}, "type", "/type"),
    # ... or against a $ref not yet compiled, or whose cost was the value's times the schema's
    ({"enum": [{"a": 1}], "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": 5}}, "properties", "/properties"),
    ({"enum": [[1]], "items": {"$ref": "#/$defs/x"}, "$defs": {"x": {"anyOf": [{"const": 2}] * 64}}}, "items", "/items"),
    ({"const": {}, "additionalProperties": False}, "additionalProperties", "/additionalProperties"),
])
def test_a_malformed_keyword_or_a_subschema_beside_an_enum_is_refused_by_name(schema, keyword, path):
    with pytest.raises(SchemaError) as e:
        compile_schema(schema)
    assert (e.value.keyword, e.value.path) == (keyword, path)


def test_an_enum_keeps_the_values_a_const_beside_it_allows():
    schema = {"enum": [1, 2, "a"], "const": 1}
    assert accepts(schema, "1") and not accepts(schema, "2") and not accepts(schema, '"a"')
    assert accepts({"enum": ["a", "b", 3], "type": "string", "maxLength": 1}, '"b"')
    assert accepts({"enum": [{"a": 1}, {"b": 1}], "required": ["b"]}, '{"b":1}')
    with pytest.raises(SchemaError):
        compile_schema({"const": 3, "enum": [1, 2]})


def test_a_reference_loop_is_named_where_it_is_entered():
    """(as every other $ref error is: the client's `param` points at it, not at the root)"""
    loop = {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
            "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}
    with pytest.raises(SchemaError, match="refers to itself") as e:
        compile_schema(loop)
    assert (e.value.path, e.value.keyword) == ("/properties/x/$ref", "$ref")


# -- the engine's own validator, against an independent one (jsonschema) ------------------------
# compile_schema keeps with it the values of an enum that the keywords beside it allow.

def oracle(schema):
    """jsonschema's validator for `schema` (Draft 2020-12, unless its $schema says otherwise)."""
    return jsonschema.validators.validator_for(schema)(schema)


@pytest.mark.parametrize("value, schema, valid", [
    ({"name": "x", "age": 3, "active": True}, SCHEMAS[0], True),
    ({"name": "x", "active": True}, SCHEMAS[0], False),                       # age is required
    ({"name": "x", "age": 3.0, "active": True}, SCHEMAS[0], True),            # 3.0 is an integer
    ({"name": "x", "age": True, "active": True}, SCHEMAS[0], False),          # true is not
    ({"name": "x", "age": 3, "active": True, "zzz": 1}, SCHEMAS[0], False),   # additionalProperties
    ({"name": "x", "age": 3, "active": True, "tags": ["pink"]}, SCHEMAS[0], False),
    ({"value": 1, "children": [{"value": -5}]}, SCHEMAS[1], False),          # exclusiveMinimum, via $ref
    ({"kind": "fixed", "n": [1, 2.0]}, SCHEMAS[2], True),                    # 2.0 is the const's 2
    (1, {"enum": [True, "1"]}, False),                                       # ... but true is not 1
    (True, {"const": 1}, False),
])
def test_the_validator_agrees_with_jsonschema(value, schema, valid):
    assert (validate(value, schema) is None) == valid
    assert oracle(schema).is_valid(value) == valid


def test_the_validator_names_what_is_not_valid():
    assert "missing required property 'age'" in validate({"name": "x", "active": True}, SCHEMAS[0])
    assert validate({"value": 1, "children": [{"value": -5}]}, SCHEMAS[1]).startswith("/children/0/value")


ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-20, 20) | st.floats(-20, 20) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6)
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def near(schema, root, depth=0):
    """Documents close to `schema`'s, to be judged: each part follows the schema with its
    bounds straddled by one (lengths, counts, numbers), a required key may be missing, an
    undeclared one may come, and one part in five is any JSON value."""
    if depth > 3 or isinstance(schema, bool):
        return ANY_JSON
    follows = following(schema, root, depth + 1)
    return st.one_of(ANY_JSON, follows, follows, follows, follows)  # (one_of draws each alike)


def following(schema, root, depth):
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/") if schema["$ref"] != "#" else []:
            target = target[unquote(part)]
        return near(target, root, depth)
    if "anyOf" in schema:
        return st.one_of([near(option, root, depth) for option in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    types = schema.get("type", ["null", "boolean", "number", "string", "array", "object"])
    return st.one_of([of_type(t, schema, root, depth) for t in (types if isinstance(types, list) else [types])])


def of_type(kind, schema, root, depth):
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        bounds = [schema[key] for key in BOUNDS if key in schema]
        lo, hi = math.floor(min(bounds, default=-50)) - 1, math.ceil(max(bounds, default=50)) + 1
        values = st.integers(lo, hi) | st.integers(lo, hi).map(float) | st.sampled_from(bounds or [0])
        return values if kind == "integer" else values | st.floats(lo, hi)
    if kind == "string":
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        return st.text(min_size=max(0, lo - 1), max_size=(lo + 4 if hi is None else hi) + 1)
    if kind == "array":
        lo, hi = schema.get("minItems", 0), schema.get("maxItems")
        return st.lists(near(schema.get("items", True), root, depth),
                        min_size=max(0, lo - 1), max_size=(lo + 2 if hi is None else hi) + 1)
    properties, required = schema.get("properties", {}), schema.get("required", [])
    extra = schema.get("additionalProperties", True)
    values = {name: near(properties.get(name, extra), root, depth) for name in [*properties, *required]}
    values["zz"] = near(extra, root, depth)  # a key no schema above declares
    need = {name: values[name] for name in required}
    rest = {name: v for name, v in values.items() if name not in need}
    return st.fixed_dictionaries(need, optional=rest) | st.fixed_dictionaries({}, optional=values)


# schemas of the supported subset (the test compiles each), among them every keyword it reads
SUBSET = SCHEMAS + [
    {"type": "integer", "minimum": -3, "maximum": 250},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "string", "minLength": 2, "maxLength": 3},
    {"enum": ["a", 1, None, [1, 2], True, {"k": 1.0}], "type": ["string", "array", "boolean", "object"]},
    {"enum": [0, 1.5, False], "minimum": 1},
    {"type": "object", "required": ["a", "b"], "additionalProperties": {"type": "integer", "maximum": 9}},
    {"type": "object", "properties": {"a": {"const": 1}, "b": {}}, "additionalProperties": False},
    {"type": "array", "items": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}, "maxItems": 2},
    {"$ref": "#/definitions/a%20b", "definitions": {"a b": {"type": "boolean"}}},
    {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 0}, {"type": "string", "maxLength": 1}, False]},
]


@pytest.mark.parametrize("schema", SUBSET)
def test_the_validator_agrees_with_jsonschema_on_documents_near_the_schema(schema):
    """The engine's verdict on random documents is jsonschema's; both verdicts occur."""
    compile_schema(schema)
    judge, verdicts = oracle(schema), set()

    @settings(max_examples=100, deadline=None, derandomize=True, database=None)
    @given(near(schema, schema))
    def agree(value):
        valid = judge.is_valid(value)
        assert (validate(value, schema) is None) == valid, value
        verdicts.add(valid)

    agree()
    assert verdicts == {True, False}


class WordVocabulary:
    """A stand-in tokenizer over a list of token bytes (token 0 is the end token)."""

    def __init__(self, words):
        self.words, self.n_vocab, self.eos_ids = words, len(words), frozenset({0})

    def token_bytes(self, i):
        return self.words[i]


def test_can_constrain():
    from engine.constrain import can_constrain

    for name in ("smollm2", "gemma3"):
        assert can_constrain(Tokenizer.from_metadata(load_tokenizer_meta(DATA / f"tokenizer-meta.{name}.json.gz")))
    assert not can_constrain(WordVocabulary([b"", b"{", b"}", b'"', b"ab"]))
    assert can_constrain(WordVocabulary([b""] + [bytes([b]) for b in range(256)]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine.model import load_model
    from tiny import write_tiny_chat_model

    return load_model(write_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "chat.gguf"))


async def generate_text(model, constraint, seed, max_tokens=300):
    """A tiny random-weight model's seeded sample under `constraint`: (text, finish reason)."""
    from engine.api import SamplingParams

    ids = model.tokenize(model.apply_chat_template([{"role": "user", "content": "Answer in JSON."}]),
                         parse_special=True)
    generation = model.generate(ids, max_tokens=max_tokens, sampling=SamplingParams(temperature=1.0, seed=seed),
                                constraint=constraint)
    text = "".join([token.text async for token in generation])
    return text, generation.finish_reason


async def run_concurrently(make_run, n, at_once=8):
    """n seeded generations, `at_once` at a time (the model batches their steps); results by seed."""
    import trio

    results = {}
    limiter = trio.CapacityLimiter(at_once)

    async def one(seed):
        async with limiter:
            results[seed] = await make_run(seed)

    async with trio.open_nursery() as nursery:
        for seed in range(n):
            nursery.start_soon(one, seed)
    return results


async def test_tiny_model_writes_valid_json_in_50_of_50_runs(tiny):
    index = TokenIndex.of(tiny.tokenizer)
    schema = SCHEMAS.__getitem__
    results = await run_concurrently(
        lambda seed: generate_text(tiny, json_constraint(schema(seed % len(SCHEMAS)), index), seed), 50)
    for seed, (text, reason) in results.items():
        assert reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), schema(seed % len(SCHEMAS)))


async def chat_events(model, request):
    return [event async for event in model.generate_chat(model.prepare_chat(request))]


async def test_chat_json_schema(tiny):
    from engine.api import ChatRequest, Finished, SamplingParams, TextDelta

    assert {"tools", "structured_output"} <= set(tiny.info.capabilities)
    messages = [{"role": "user", "content": "A person, as JSON."}]
    for seed in range(3):
        request = ChatRequest(messages, sampling=SamplingParams(seed=seed), json_schema=SCHEMAS[0], stop=('"',))
        events = await chat_events(tiny, request)
        assert isinstance(events[-1], Finished) and events[-1].reason == "stop"
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        jsonschema.validate(json.loads(text), SCHEMAS[0])     # stop sequences do not cut it
    with pytest.raises(OutputBudgetTooSmall) as refused:  # below its shortest answer: refused at once
        tiny.prepare_chat(ChatRequest(messages, max_tokens=3, json_schema=SCHEMAS[0]))
    events = await chat_events(tiny, ChatRequest(messages, max_tokens=refused.value.needed, json_schema=SCHEMAS[0]))
    assert events[-1].reason in ("stop", "length")  # (its last token may close the document)
    jsonschema.validate(json.loads("".join(e.text for e in events if isinstance(e, TextDelta))), SCHEMAS[0])
    with pytest.raises(SchemaError):
        tiny.prepare_chat(ChatRequest(messages, json_schema={"type": "string", "pattern": "(?=a)"}))


# -- the real SmolLM2-135M-Instruct (slow) ------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
          "maximum": 150}}, "required": ["name", "age"]}
REAL_JSON = [
    ("Describe a 30 year old named Bob.", PERSON),
    ("Give me a person called Alice who is 42.", PERSON),
    ("A recipe for pancakes: name and a list of ingredients.",
     {"type": "object", "properties": {"name": {"type": "string"},
      "ingredients": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 8}},
      "required": ["name", "ingredients"]}),
    ("Is the sky blue? Answer yes or no with a confidence.",
     {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
      "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]}),
    ("List three colors.", {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 3, "maxItems": 3}),
    ("How many legs does a spider have?", {"type": "integer", "minimum": 0, "maximum": 100}),
    ("Name the capital of France.", {"type": "string", "maxLength": 40}),
    ("Classify the sentiment of: I love this phone!",
     {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
      "required": ["sentiment"], "additionalProperties": False}),
    ("A book: title, author and year.",
     {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
      "year": {"type": "integer", "minimum": 1000, "maximum": 2030}}, "required": ["title", "author", "year"]}),
    ("Give the coordinates of Paris.",
     {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
      "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]}),
    ("Make a todo list with two tasks.",
     {"type": "object", "properties": {"tasks": {"type": "array", "maxItems": 5, "items": {
         "type": "object", "properties": {"title": {"type": "string", "maxLength": 60}, "done": {"type": "boolean"}},
         "required": ["title", "done"]}}}, "required": ["tasks"]}),
    ("Is 7 a prime number?", {"type": "boolean"}),
    ("Describe the weather today.",
     {"type": "object", "properties": {"condition": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
      "temperature": {"type": "integer", "minimum": -50, "maximum": 60}, "note": {"type": ["string", "null"],
      "maxLength": 80}}, "required": ["condition", "temperature"]}),
    ("A movie and its rating out of 10.",
     {"$defs": {"rating": {"type": "integer", "minimum": 1, "maximum": 10}},
      "type": "object", "properties": {"movie": {"type": "string"}, "rating": {"$ref": "#/$defs/rating"}},
      "required": ["movie", "rating"]}),
    ("An address in London.",
     {"type": "object", "properties": {"street": {"type": "string"}, "city": {"const": "London"},
      "postcode": {"type": "string", "minLength": 5, "maxLength": 8}}, "required": ["street", "city", "postcode"]}),
    ("Pick a number or say none.", {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9}, {"type": "null"}]}),
    ("Translate hello into French and Spanish.",
     {"type": "object", "properties": {"fr": {"type": "string", "maxLength": 30}, "es": {"type": "string", "maxLength": 30}},
      "required": ["fr", "es"]}),
    ("A user profile with an email and some tags.",
     {"type": "object", "properties": {"email": {"type": "string", "maxLength": 60},
      "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 4}},
      "required": ["email", "tags"]}),
    ("Summarize: The cat sat on the mat all day.",
     {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 120},
      "words": {"type": "integer", "minimum": 0}}, "required": ["summary"]}),
    ("Product: a red t-shirt for 19.99 dollars.",
     {"type": "object", "properties": {"product": {"type": "string"}, "price": {"type": "number", "minimum": 0},
      "currency": {"enum": ["USD", "EUR"]}, "in_stock": {"type": "boolean"}},
      "required": ["product", "price", "currency", "in_stock"]}),
]


@pytest.fixture(scope="module")
def smollm2_model(smollm2_path):
    from engine.model import load_model

    return load_model(smollm2_path)


@pytest.mark.slow
async def test_smollm2_json_documents_are_valid(smollm2_model):
    from engine.api import ChatRequest, SamplingParams, TextDelta

    def request(i):
        text, schema = REAL_JSON[i]
        return ChatRequest([{"role": "user", "content": text}], max_tokens=400,
                           sampling=SamplingParams(temperature=0), json_schema=schema)

    results = await run_concurrently(lambda i: chat_events(smollm2_model, request(i)), len(REAL_JSON), at_once=4)
    for i, events in results.items():
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        assert events[-1].reason == "stop", (REAL_JSON[i][0], text)
        jsonschema.validate(json.loads(text), REAL_JSON[i][1])


def test_properties_come_in_schema_order():
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    ba = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert accepts(ab, '{"a":1,"b":2}') and not accepts(ab, '{"b":2,"a":1}')
    assert accepts(ba, '{"b":2,"a":1}') and not accepts(ba, '{"a":1,"b":2}')   # not the cached ab grammar


def test_a_schema_nested_too_deeply_to_compile_is_a_schema_error():
    """The compiler recurses per level: a client's deep schema is refused (400), not a crash (500)."""
    schema = {"type": "string"}
    for _ in range(2000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaError, match="nested too deeply"):
        compile_schema(schema)


def test_what_a_schema_may_cost_is_bounded():
    """D9: many optional properties (each tried at every byte of a key) or a huge enum are refused by name,
    and alternatives that multiply as the output goes on stop at a bound, not a stall."""
    with pytest.raises(SchemaError) as e:
        json_constraint({"type": "object", "properties": {f"p{i}": {} for i in range(MAX_PROPERTIES + 1)}},
                        BYTES)
    assert e.value.keyword == "properties"
    with pytest.raises(SchemaError) as e:
        json_constraint({"enum": list(range(MAX_ENUM + 1))}, BYTES)
    assert e.value.keyword == "enum"
    with pytest.raises(SchemaError) as e:  # refused before generating, not on its first byte
        json_constraint({"anyOf": [{"const": i} for i in range(MAX_CONFIGURATIONS + 1)]}, BYTES)
    assert e.value.keyword == "anyOf"
    # each level: an array of one or of up to two of the level below: both stay possible
    # after "[", so n levels of "[" are 2^n ways to read the output
    defs = {"L0": {"type": "integer"}}
    for k in range(1, 11):
        one = {"type": "array", "items": {"$ref": f"#/$defs/L{k - 1}"}, "minItems": 1, "maxItems": 1}
        defs[f"L{k}"] = {"anyOf": [one, {**one, "maxItems": 2}]}
    c = json_constraint({"$ref": "#/$defs/L10", "$defs": defs}, BYTES)
    with pytest.raises(SchemaError) as e:
        for b in b"[" * 10:
            c.advance(b)
    assert e.value.keyword == "anyOf"


def schema_of(n: int) -> dict:
    """An object schema of exactly n subschemas: the root, objects of up to 255 strings."""
    properties, left = {}, n - 1
    while left:
        strings = min(255, left - 1)
        properties[f"o{len(properties)}"] = {"type": "object",
                                             "properties": {f"p{i}": {"type": "string"} for i in range(strings)}}
        left -= 1 + strings
    return {"type": "object", "properties": properties}


def test_a_whole_schema_past_its_size_bounds_is_refused_by_name():
    """D9: MAX_PROPERTIES and MAX_ENUM bound one object and one enum, not a schema: 256
    objects of 256 properties (a 2 MB body) compiled for 1.6 s, 256 objects of 64 enums
    of 40 values for 4.3 s. MAX_SUBSCHEMAS and MAX_ENUM_VALUES bound the whole, and the
    compiler stops where one is crossed."""
    compile_schema(schema_of(MAX_SUBSCHEMAS))
    with pytest.raises(SchemaError, match=f"more than {MAX_SUBSCHEMAS:,} subschemas") as e:
        compile_schema(schema_of(MAX_SUBSCHEMAS + 1))
    assert e.value.path == "/properties/o39/properties/p14"  # the last one, where the bound is crossed
    enums = MAX_ENUM_VALUES // MAX_ENUM
    spread = {"type": "object", "properties": {f"e{i}": {"enum": list(range(MAX_ENUM))} for i in range(enums)}}
    spread["properties"]["rest"] = {"enum": list(range(MAX_ENUM_VALUES - enums * MAX_ENUM))}
    compile_schema(spread)
    spread["properties"]["one more"] = {"const": 0}
    with pytest.raises(SchemaError, match=f"more than {MAX_ENUM_VALUES:,} enum and const values") as e:
        compile_schema(spread)
    assert (e.value.path, e.value.keyword) == ("/properties/one more/const", "const")


@pytest.mark.parametrize("value", [{}, {"type": "number"}, {"type": "boolean"}])
def test_a_schema_compiles_in_memory_in_proportion_to_its_size(value):
    """D9: MAX_PROPERTIES bounds one object, not a request: each object kept the properties
    that may come next after each of its own (n^2: 2.8 MB for 256), each `{}` built its own
    any-value nodes and each number its own digit tables; 8 objects of 256 properties, a
    24 to 60 kB body, took 18 to 25 MB (a 4 MB body, gigabytes and a minute)."""
    import tracemalloc

    schema = {"type": "object", "properties": {
        f"o{k}": {"type": "object", "properties": {f"p{i}": value for i in range(256)}} for k in range(8)}}
    tracemalloc.start()
    try:
        compile_schema(schema)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * len(json.dumps(schema)), peak


def open_all(c, byte):
    """Advance c by `byte` as long as it is allowed (at most 1,000 times): how many times."""
    for n in range(1000):
        if not c.allows(byte):
            return n
        c.advance(byte)
    return n + 1


def test_values_nest_at_most_max_depth_deep_and_can_always_end():
    """D9: a recursive schema had no bound on nesting: each "[" was one more frame in every
    state after it, kept by the caches (260 MB after 8,000 "[[" tokens, and each slower than
    the last). Only a value that can still end within MAX_DEPTH frames may begin."""
    from engine.tools import tool_constraint

    nested = {"$defs": {"n": {"anyOf": [{"type": "null"},
                                        {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}]}},
              "$ref": "#/$defs/n"}
    c = json_constraint(nested, BYTES)
    depth = open_all(c, ord("["))
    assert depth == MAX_DEPTH - 1
    assert np.flatnonzero(c.mask()).tolist() == [ord("n")]   # the innermost item can only be null
    assert accepts(nested, "[" * depth + "null" + "]" * depth)
    assert not accepts(nested, "[" * (depth + 1) + "null" + "]" * (depth + 1))
    # objects too, and around a tool call's arguments: a required property that may nest
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}},
                                             "leaf": {"type": "boolean"}}, "required": ["leaf"]}
    c = tool_constraint([{"name": "t", "parameters": tree}], "required", BYTES)
    for b in b'<tool_call>{"name":"t","arguments":':
        c.advance(b)
    opened = 0
    while c.allows(ord("{")):
        for b in b'{"kids":[':
            c.advance(b)
        opened += 1
    assert 0 < opened < MAX_DEPTH // 2      # two frames a level, and the call's
    for b in b'],"leaf":true}' * opened + b"}</tool_call>":
        c.advance(b)
    assert c.complete()
    # a schema whose every document nests deeper is refused at once
    deep = {"type": "boolean"}
    for _ in range(MAX_DEPTH):
        deep = {"type": "array", "items": deep, "minItems": 1}
    with pytest.raises(SchemaError, match="nests more than"):
        json_constraint(deep, BYTES)


def test_a_long_const_or_enum_costs_memory_in_proportion_to_its_length():
    """D9: a Literal kept every prefix of every value: n^2 bytes, 400 MB for a const of
    20,000 characters (a 60 kB body took more than 2.5 GB, well within the 4 MB limit)."""
    import tracemalloc

    value = "x" * 20_000
    tracemalloc.start()
    try:
        c = json_constraint({"const": value}, BYTES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10_000_000, peak
    for b in json.dumps(value).encode():
        c.advance(b)
    assert c.allows(256) and c.is_done()
    enum = {"enum": ["ab", "abc", "b", "", "abd", {"k": "ab"}]}  # one a prefix of another, the empty string
    for doc in ('"ab"', '"abc"', '"b"', '""', '"abd"', '{"k":"ab"}'):
        assert accepts(enum, doc), doc
    assert not any(accepts(enum, doc) for doc in ('"a"', '"abe"', '"abcd"', '{"k":"a"}', '"ba"'))


def test_nested_anyofs_are_counted_as_the_matcher_follows_them():
    """An anyOf of 20 anyOfs of 20 strings is 400 ways to read the quote that begins its
    value: refused when compiled, wherever it is (it failed on that byte, mid-generation);
    400 integers, whose first digit leaves at most 111 of them, decode as before."""
    strings = {"anyOf": [{"anyOf": [{"const": f"s{i}_{j}"} for j in range(20)]} for i in range(20)]}
    with pytest.raises(SchemaError) as e:
        json_constraint({"type": "object", "properties": {"a": strings}}, BYTES)
    assert e.value.keyword == "anyOf" and e.value.path == "/properties/a/anyOf"
    defs = {"all": {"anyOf": [{"$ref": f"#/$defs/d{i}"} for i in range(20)]},
            **{f"d{i}": strings["anyOf"][i] for i in range(20)}}
    with pytest.raises(SchemaError) as e:
        json_constraint({"type": "array", "items": {"$ref": "#/$defs/all"}, "$defs": defs}, BYTES)
    assert e.value.path == "/$defs/all/anyOf"
    integers = {"anyOf": [{"anyOf": [{"const": 20 * i + j} for j in range(20)]} for i in range(20)]}
    schema = {"type": "object", "properties": {"a": integers}}
    assert accepts(schema, '{"a": 399}') and accepts(schema, '{"a": 1}')
    for seed in range(10):
        text, complete = random_run(json_constraint(schema, BYTES), 257, seed, max_tokens=20)
        assert complete, text
        jsonschema.validate(json.loads(text), schema)


def test_counting_the_ways_to_read_a_first_byte_stops_at_the_bound(monkeypatch):
    """D9: the count gives up past MAX_CONFIGURATIONS. It went on: for 250 anyOfs that
    each hold a $ref to one anyOf of 62,500 strings it kept 250 sets of 62,500 before it
    refused the schema (the compile's peak went from 0.4 to 1.5 GB). (The sets are the
    compiler's own, private, and a schema small enough for a test shows no difference in
    memory: the count is watched.)"""
    from engine.constrain import schema as compiler

    sizes = []
    first_byte = compiler._first_byte

    def measured(node, b, memo):
        found = first_byte(node, b, memo)
        sizes.append(0 if found is None else len(found))  # (None: past the bound)
        return found

    monkeypatch.setattr(compiler, "_first_byte", measured)
    big = {"anyOf": [{"anyOf": [{"const": f"s{i}_{j}"} for j in range(20)]} for i in range(20)]}
    holders = {f"d{k}": {"anyOf": [{"$ref": "#/$defs/big"}, {"const": k}]} for k in range(5)}
    with pytest.raises(SchemaError) as e:
        compile_schema({"anyOf": [{"$ref": f"#/$defs/d{k}"} for k in range(5)], "$defs": {"big": big, **holders}})
    assert e.value.keyword == "anyOf" and e.value.path == "/anyOf"
    assert sizes and max(sizes) <= MAX_CONFIGURATIONS


def test_anyofs_in_what_is_left_out_are_not_counted():
    """An anyOf inside a subschema no value satisfies, left out where it is optional, is
    never followed: it refused the schema all the same (400 naming it)."""
    strings = {"anyOf": [{"anyOf": [{"const": f"s{i}_{j}"} for j in range(20)]} for i in range(20)]}
    never = {"type": "object", "properties": {"s": strings, "n": {"type": "integer", "minimum": 1, "maximum": 0}},
             "required": ["s", "n"]}
    for schema, text in (({"type": "object", "properties": {"a": never, "b": {"const": 1}}}, '{"b": 1}'),
                         ({"anyOf": [never, {"const": 1}]}, "1"),
                         ({"type": "object", "properties": {"a": {"$ref": "#/$defs/never"}},
                           "$defs": {"never": never}}, "{}")):
        assert accepts(schema, text), schema


def test_alternatives_that_share_a_ref_are_followed_once():
    """Each level an anyOf of the level below twice: the frames it starts with are L0's two,
    not 2^levels (25 levels took 1.7 s to compile, and each level more twice as long)."""
    defs = {"L0": {"anyOf": [{"const": 1}, {"const": 2}]}}
    for k in range(1, 20):
        defs[f"L{k}"] = {"anyOf": [{"$ref": f"#/$defs/L{k - 1}"}, {"$ref": f"#/$defs/L{k - 1}"}]}
    node = compile_schema({"$ref": "#/$defs/L19", "$defs": defs})
    assert len(node.expand()) == 2
    assert accepts({"$ref": "#/$defs/L19", "$defs": defs}, "2")


def test_a_number_means_what_a_double_reads():
    """The decimal the grammar checks against the bounds is the double a reader parses:
    at most MAX_SIGNIFICANT digits. 100000000000.000001 read as 1e11 and broke an
    exclusiveMinimum of 1e11."""
    with pytest.raises(SchemaError):  # no 15-digit number lies in (1e11, 1e11 + 2e-5]
        json_constraint({"type": "number", "exclusiveMinimum": 100000000000, "maximum": 100000000000.00002}, BYTES)
    schema = {"type": "number", "exclusiveMinimum": 1234567890.5, "maximum": 1234567891}
    assert not accepts(schema, "1234567890.500001")  # 16 digits: 15 at most
    assert accepts(schema, "1234567890.50001") and accepts(schema, "1234567891")
    rng = np.random.default_rng(0)
    for _ in range(200):  # random walks: every document's double satisfies the bounds
        c, text = json_constraint(schema, BYTES), b""
        while not (c.allows(256) and (len(text) > 12 or rng.random() < 0.3)):
            allowed = np.flatnonzero(c.mask()[:256])
            b = int(rng.choice(allowed))
            c.advance(b)
            text += bytes([b])
        jsonschema.validate(json.loads(text), schema)
        assert 1234567890.5 < float(text) <= 1234567891, text


def test_an_integer_part_has_at_most_15_digits_whatever_the_bounds():
    """Bounds on both sides set how many integer digits are written, but never more than
    MAX_INT_DIGITS: [0, 1e20) let the model write 99999999999999999999, which a reader's
    double reads as 1e20, outside the bounds (and [-1e300, 1e300] a 300-digit number)."""
    for schema in ({"type": "integer", "minimum": 0, "exclusiveMaximum": 1e20},
                   {"type": "number", "minimum": 0, "exclusiveMaximum": 1e20},
                   {"type": "number", "minimum": -1e300, "maximum": 1e300}):
        assert accepts(schema, "999999999999999"), schema
        assert not accepts(schema, "1000000000000000") and not accepts(schema, "99999999999999999999"), schema
        for seed in range(20):
            text, complete = random_run(json_constraint(schema, BYTES), 257, seed, max_tokens=40)
            assert complete and len(text.lstrip(b"-").split(b".")[0]) <= 15, text
            jsonschema.validate(json.loads(text), schema)
    assert accepts({"type": "number", "minimum": -1e300, "maximum": 1e300}, "-123456789012.125")


def test_numbers_bounded_finer_than_a_millionth_get_the_fraction_digits_they_need():
    """6 fraction digits, or as many as the bounds need (15 digits in all at most): (0, 1e-7]
    was refused though 0.0000001 and 0.00000005 lie in it."""
    schema = {"type": "number", "exclusiveMinimum": 0, "maximum": 1e-7}
    assert accepts(schema, "0.0000001") and accepts(schema, "0.00000005")
    assert not any(accepts(schema, text) for text in ("0", "0.00000011", "0.000001", "0.000000000000000001"))
    tight = {"type": "number", "minimum": -12.0000000000035, "maximum": -12.0000000000031}
    assert accepts(tight, "-12.0000000000033") and not accepts(tight, "-12.000000000003")
    for schema in (schema, tight):
        for seed in range(30):
            text, complete = random_run(json_constraint(schema, BYTES), 257, seed, max_tokens=40)
            assert complete, text
            jsonschema.validate(json.loads(text), schema)
    assert not accepts({"type": "number", "minimum": 0, "maximum": 1}, "0.0000001")  # 6 are enough there
    with pytest.raises(SchemaError, match="no number of at most 15 fraction digits lies between"):
        json_constraint({"type": "number", "exclusiveMinimum": 0, "maximum": 1e-16}, BYTES)
    with pytest.raises(SchemaError, match="no number of at most 15 integer digits lies between"):
        json_constraint({"type": "number", "minimum": 1e20}, BYTES)


@pytest.mark.parametrize("schema, documents", [
    # an optional property, an alternative, an array's items that no value satisfies are left out
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                       "b": {"type": "integer", "minimum": 1, "maximum": 0}}, "required": ["a"]},
     ['{"a": "x"}']),
    ({"anyOf": [{"type": "integer", "minimum": 1, "maximum": 0}, {"type": "string", "maxLength": 2}]}, ['"ok"']),
    ({"type": "object", "properties": {"a": False, "b": {"const": 1}}}, ['{}', '{"b": 1}']),
    ({"type": "array", "items": False}, ["[]"]),
    ({"type": "object", "additionalProperties": {"type": "integer", "minimum": 2, "maximum": 1}}, ["{}"]),
    ({"type": "array", "items": {"enum": ["a"], "type": "integer"}, "maxItems": 0}, ["[]"]),
    ({"$ref": "#/$defs/a%20b", "$defs": {"a b": {"const": 7}}}, ["7"]),  # a %-encoded pointer
    # numbers the writer cannot write: past 15 integer digits, or finer than 15 fraction digits
    ({"anyOf": [{"type": "boolean"}, {"type": "number", "minimum": 1e20}]}, ["true"]),
    ({"type": "array", "items": {"type": "integer", "maximum": -1e16}}, ["[]"]),
    ({"anyOf": [{"const": 1}, {"type": "number", "exclusiveMinimum": 0, "maximum": 1e-17}]}, ["1"]),
])
def test_what_no_value_satisfies_is_left_out_where_it_is_optional(schema, documents):
    for text in documents:
        assert accepts(schema, text), text
        jsonschema.validate(json.loads(text), schema)
    for seed in range(20):
        text, complete = random_run(json_constraint(schema, BYTES), 257, seed, max_tokens=60)
        if complete:
            jsonschema.validate(json.loads(text), schema)


NEVER = {"type": "integer", "minimum": 1, "maximum": 0}


@pytest.mark.parametrize("inline, documents", [
    ({"type": "object", "properties": {"a": NEVER, "b": {"const": 1}}}, ["{}", '{"b": 1}']),
    ({"anyOf": [NEVER, {"const": "x"}]}, ['"x"']),
    ({"type": "array", "items": NEVER}, ["[]"]),
    ({"type": "object", "additionalProperties": NEVER}, ["{}"]),
])
def test_what_no_value_satisfies_is_left_out_through_a_ref_as_inline(inline, documents):
    """A $ref to a subschema no value satisfies is left out where it is optional, as the
    subschema written inline is (it refused the schema: refs were compiled after the rest)."""
    by_ref = json.loads(json.dumps(inline).replace(json.dumps(NEVER), '{"$ref": "#/$defs/never"}'))
    for schema in (inline, {**by_ref, "$defs": {"never": NEVER}},
                   {**by_ref, "$defs": {"never": {"$ref": "#/$defs/needs"},  # through a required property
                                        "needs": {"properties": {"n": NEVER}, "required": ["n"]}}}):
        for text in documents:
            assert accepts(schema, text), (schema, text)
        for seed in range(10):
            text, complete = random_run(json_constraint(schema, BYTES), 257, seed, max_tokens=60)
            if complete:
                jsonschema.validate(json.loads(text), schema)
    with pytest.raises(SchemaError) as e:  # where it is required, refused as inline
        compile_schema({"properties": {"a": {"$ref": "#/$defs/never"}}, "required": ["a"], "$defs": {"never": NEVER}})
    assert e.value.path == "/$defs/never"


def test_a_ref_refused_where_it_is_required_says_why():
    """Through a $ref that leads to another, the 400 names what no value satisfies, as the
    schema written inline does; it said the schema could only repeat itself."""
    for inner, path, keyword in ((NEVER, "/$defs/y", "minimum"), (False, "/$defs/y", None),
                                 ({"type": "array", "items": {"$ref": "#/$defs/x"}, "minItems": 1}, "/$defs/x",
                                  "required")):
        schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
                  "$defs": {"x": {"$ref": "#/$defs/y"}, "y": inner}}
        with pytest.raises(SchemaError) as e:
            compile_schema(schema)
        assert (e.value.path, e.value.keyword) == (path, keyword), e.value
        assert ("own object again" in str(e.value)) == (keyword == "required"), e.value


def test_what_has_no_finite_document_is_left_out_where_it_is_optional():
    """A list whose items must be lists again has no end: the model would write "[[[[..."
    until the token limit. Where it is optional it is never begun."""
    schema = {"type": "object", "properties": {"c": {"$ref": "#/$defs/list"}, "d": {"const": 1}},
              "$defs": {"list": {"type": "array", "items": {"$ref": "#/$defs/list"}, "minItems": 1}}}
    assert accepts(schema, "{}") and accepts(schema, '{"d": 1}')
    c = json_constraint(schema, BYTES)
    for b in b'{"':
        c.advance(b)
    assert not c.allows(ord("c")) and c.allows(ord("d"))


def test_what_no_value_satisfies_where_it_is_required_is_refused():
    for schema in ({"type": "object", "properties": {"b": {"type": "integer", "minimum": 1, "maximum": 0}},
                    "required": ["b"]},
                   {"type": "array", "items": False, "minItems": 1},
                   {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 0}, False]}):
        with pytest.raises(SchemaError):
            json_constraint(schema, BYTES)


def test_required_keys_not_declared_are_written_with_the_values_additional_properties_allows():
    """JSON Schema: `required` alone asks for the keys, whatever their values, or as
    additionalProperties says (it was refused: not declared in `properties`)."""
    schema = {"type": "object", "required": ["a", "b"]}
    assert accepts(schema, '{"a": 1, "b": [true, {"c": null}]}')
    assert not accepts(schema, '{"a": 1}') and not accepts(schema, '{}')
    typed = {"type": "object", "required": ["a"], "additionalProperties": {"type": "integer", "maximum": 9}}
    assert accepts(typed, '{"a": 3}') and not accepts(typed, '{"a": "x"}') and not accepts(typed, '{"a": 10}')
    mixed = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 2}}, "required": ["y", "x"]}
    assert accepts(mixed, '{"x": "s", "y": null}')  # declared ones first, then the others
    for schema in (typed, mixed, {"anyOf": [{"type": "object", "required": ["a"], "additionalProperties": False},
                                            {"type": "null"}]}):
        for seed in range(10):
            text, complete = random_run(json_constraint(schema, BYTES), 257, seed, max_tokens=60)
            if complete:
                jsonschema.validate(json.loads(text), schema)
    with pytest.raises(SchemaError) as e:  # no other key is allowed: no object satisfies it
        compile_schema({"type": "object", "required": ["a"], "additionalProperties": False})
    assert e.value.keyword == "required" and e.value.path == "/required"
    with pytest.raises(SchemaError) as e:  # D9: as many keys as declared properties may be
        compile_schema({"type": "object", "required": [f"k{i}" for i in range(MAX_PROPERTIES + 1)]})
    assert e.value.keyword == "required"


def test_a_schema_without_a_finite_document_is_refused():
    """The model could only write it until the token limit: D5 wants a 400, not a best effort."""
    for schema in ({"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]},
                   {"$ref": "#/$defs/list", "$defs": {"list": {"type": "array", "items": {"$ref": "#/$defs/list"},
                                                                "minItems": 1}}}):
        with pytest.raises(SchemaError):
            json_constraint(schema, BYTES)
    # recursive, but it may stop: fine
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["v", "kids"]}
    assert accepts(tree, '{"v": 1, "kids": [{"v": 2, "kids": []}]}')
    assert accepts({"type": "object", "properties": {"c": {"$ref": "#"}}}, '{"c": {}}')

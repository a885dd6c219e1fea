"""Tool calling: prompt rendering, the call grammar under each tool_choice, parsing of calls."""

import json

import jsonschema
import pytest

from engine.api import TextDelta, ToolCall
from engine.chat_template import ChatTemplate
from engine.constrain import TokenIndex
from engine.constrain.schema import MAX_SUBSCHEMAS
from engine.errors import OutputBudgetTooSmall, SchemaError
from tiny import load_tokenizer_meta
from engine.tokenizer import Tokenizer
from engine.tools import (CLOSER, MAX_CALLS, OPENER, ToolCallParser, either_constraint, render_generic,
                          tool_constraint, uses_native_format)
from tests.conftest import DATA
from tests.test_constrain import random_run, smollm2_model, tiny  # noqa: F401 (fixtures)

TOOLS = [
    {"name": "get_weather", "description": "Get the current weather for a city.",
     "parameters": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"]}},
    {"name": "add", "description": "Add two integers.",
     "parameters": {"type": "object",
                    "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                   "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                    "required": ["a", "b"], "additionalProperties": False}},
    {"name": "get_time", "description": "The time now.", "parameters": {"type": "object", "properties": {}}},
]


@pytest.fixture(scope="module")
def smollm2():
    tok = Tokenizer.from_metadata(load_tokenizer_meta(DATA / "tokenizer-meta.smollm2.json.gz"))
    return tok, TokenIndex.of(tok)


def parse(text: str) -> list:
    parser = ToolCallParser()
    return parser.feed(text) + parser.finish()


def check_calls(events, tools):
    """Every call names a listed tool and its arguments satisfy its parameters (as jsonschema
    reads them); returns the calls."""
    calls = [e for e in events if isinstance(e, ToolCall)]
    by_name = {t["name"]: t for t in tools}
    for call in calls:
        assert call.name in by_name
        jsonschema.validate(json.loads(call.arguments), by_name[call.name]["parameters"])
    return calls


def test_random_model_makes_valid_calls_in_50_of_50_runs(smollm2):
    _, index = smollm2
    for seed in range(50):
        choice = "required" if seed % 2 else {"type": "function", "name": TOOLS[seed % 3]["name"]}
        text, complete = random_run(tool_constraint(TOOLS, choice, index), index.n_vocab, seed, max_tokens=600)
        assert complete, (seed, text)
        calls = check_calls(parse(text.decode()), TOOLS)
        assert 1 <= len(calls) <= MAX_CALLS
        if isinstance(choice, dict):  # a named function is called exactly once
            assert [c.name for c in calls] == [choice["name"]]
        assert parse(text.decode())[0] == calls[0]   # nothing before the first call


def test_auto_is_free_until_the_opener_then_constrained(smollm2):
    tok, index = smollm2
    for seed in range(10):
        c = tool_constraint(TOOLS, "auto", index)
        assert c.complete()                          # the model may just answer
        for t in tok.encode("Let me check. <tool_call>", add_special=False):
            c.advance(t)
        assert not c.complete()
        text, complete = random_run(c, index.n_vocab, seed, max_tokens=600)
        assert complete
        events = parse(text.decode())
        assert events[0] == "Let me check. "
        assert len(check_calls(events, TOOLS)) >= 1


def test_none_never_completes_the_opener(smollm2):
    tok, index = smollm2
    c = tool_constraint(TOOLS, "none", index)
    for t in tok.encode("Sure <tool_call", add_special=False):
        c.advance(t)
    mask = c.mask()
    for t in range(index.n_vocab):
        data = index.token_bytes[t]
        if data.startswith(b">"):
            assert not mask[t] and not c.allows(t)
    assert mask[sorted(index.eos_ids)].all()
    assert mask[tok.encode(" no", add_special=False)[0]]


def test_without_parallel_calls_one_call_ends_the_response(smollm2):
    """parallel_tool_calls false: after one call only the end may come, not another call."""
    tok, index = smollm2
    for choice in ("auto", "required"):
        c = tool_constraint(TOOLS, choice, index, parallel=False)
        for t in tok.encode('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', add_special=False):
            c.advance(t)
        assert c.complete() and not c.allows(tok.encode("\n", add_special=False)[0]), choice
        assert not c.allows(tok.encode("<tool_call>", add_special=False)[0]), choice


def test_calls_end_the_response(smollm2):
    """After a call only another call or the end may come, never free text."""
    tok, index = smollm2
    c = tool_constraint(TOOLS, "required", index)
    for t in tok.encode('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', add_special=False):
        c.advance(t)
    assert c.complete() and not c.is_done()
    assert not c.allows(tok.encode("Hello", add_special=False)[0])
    assert c.allows(tok.encode("\n", add_special=False)[0])


def test_allowed_tools_narrow_the_calls_to_those_named(smollm2):
    _, index = smollm2
    allowed = ("add", "get_time")
    names = set()
    for seed in range(30):
        choice = ("required", "auto")[seed % 2]
        text, complete = random_run(tool_constraint(TOOLS, choice, index, allowed=allowed), index.n_vocab, seed,
                                    max_tokens=600)
        calls = check_calls(parse(text.decode(errors="replace")), TOOLS)  # (auto: free text is random bytes)
        assert complete and all(call.name in allowed for call in calls), text
        names |= {call.name for call in calls}
    assert names == set(allowed)  # both, never get_weather
    text, _ = random_run(tool_constraint(TOOLS, {"type": "function", "name": "add"}, index, allowed=allowed),
                         index.n_vocab, 0, max_tokens=600)
    assert [call.name for call in check_calls(parse(text.decode()), TOOLS)] == ["add"]
    for bad_allowed, choice in (((), "auto"), (("nope",), "auto"), (("add",), {"type": "function", "name": "get_time"})):
        with pytest.raises(SchemaError):
            tool_constraint(TOOLS, choice, index, allowed=bad_allowed)


def test_unknown_named_tool_and_bad_parameters_are_rejected(smollm2):
    _, index = smollm2
    with pytest.raises(SchemaError):
        tool_constraint(TOOLS, {"type": "function", "name": "nope"}, index)
    bad = [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "format": "iri"}}}}]
    with pytest.raises(SchemaError) as e:
        tool_constraint(bad, "auto", index)
    assert e.value.keyword == "format" and e.value.path == "/0/parameters/properties/x/format"
    for name in ("get_time", "f"):  # whichever is chosen, named by its index in the tools
        with pytest.raises(SchemaError) as e:
            tool_constraint([TOOLS[2], *bad], {"type": "function", "name": name}, index)
        assert e.value.path == "/1/parameters/properties/x/format"


def test_parameters_by_ref_or_anyof_of_objects_are_objects(smollm2):
    """A function call's arguments are a JSON object: parameters given as a $ref, or an anyOf,
    are fine when every document they allow is one, and refused (naming them) otherwise."""
    _, index = smollm2
    by_ref = {"$ref": "#/$defs/args", "$defs": {"args": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
    either = {"anyOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                        {"$ref": "#/$defs/b"}, {"type": "string", "minLength": 2, "maxLength": 1}],  # (no string)
              "$defs": {"b": {"properties": {"b": {"const": "x"}}, "required": ["b"], "additionalProperties": False}}}
    tools = [{"name": "f", "parameters": by_ref}, {"name": "g", "parameters": either}]
    for seed in range(10):
        text, complete = random_run(tool_constraint(tools, "required", index), index.n_vocab, seed, max_tokens=300)
        assert complete, text
        assert check_calls(parse(text.decode()), tools)
    for parameters in ({"anyOf": [{"type": "object"}, {"type": "null"}]},
                       {"$ref": "#/$defs/s", "$defs": {"s": {"type": "string"}}},
                       {"type": ["object", "array"]}, {"description": "anything"},
                       False):  # (no arguments at all, not "no parameters")
        with pytest.raises(SchemaError) as e:
            tool_constraint([TOOLS[2], {"name": "h", "parameters": parameters}], "auto", index)
        assert e.value.path == "/1/parameters", parameters


def test_parser_streams_text_and_calls():
    parser = ToolCallParser()
    out = []
    text = 'Checking.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>{"name":"get_time","arguments":{}}</tool_call>'
    for i in range(0, len(text), 3):           # in small pieces, the opener split across them
        out += parser.feed(text[i:i + 3])
    out += parser.finish()
    assert "".join(e for e in out if isinstance(e, str)) == "Checking."
    assert [e for e in out if not isinstance(e, str)] == [
        ToolCall(0, "add", '{"a":1,"b":2}'), ToolCall(1, "get_time", "{}")]
    assert "".join(parse("a < b, <tool_ is text")) == "a < b, <tool_ is text"
    twice = '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    assert parse(twice) == [ToolCall(0, "f", '{"a":1}')]     # a repeated call is dropped
    parser = ToolCallParser()
    parser.feed(twice[: len(twice) // 2 + 20])
    assert not parser.repeated
    parser.feed(twice[len(twice) // 2 + 20:])
    assert parser.repeated                                     # and ends the response (chat.py)


def test_the_start_of_an_opener_cut_by_the_limit_is_not_text():
    parser = ToolCallParser()
    assert parser.feed("Sure. <tool_ca") == ["Sure. "]
    assert parser.finish(complete=False) == []  # a call the limit cut off, never text
    parser = ToolCallParser()
    assert parser.feed("a <tool_ca") + parser.finish(complete=True) == ["a ", "<tool_ca"]  # it ended there


def test_a_closer_inside_an_argument_is_text():
    text = '<tool_call>\n{"name": "render", "arguments": {"tag": "</tool_call>", "n": 1}}\n</tool_call>'
    for size in (1, 5, len(text)):
        parser = ToolCallParser()
        out = [e for i in range(0, len(text), size) for e in parser.feed(text[i:i + size])] + parser.finish()
        assert out == [ToolCall(0, "render", '{"tag":"</tool_call>","n":1}')]


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"c": 17}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"c": 21}'},
]


def test_generic_rendering():
    messages = render_generic(HISTORY, TOOLS)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in messages[0]["content"] and OPENER in messages[0]["content"]
    assert messages[2]["content"] == (
        f'{OPENER}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSER}\n'
        f'{OPENER}\n{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}\n{CLOSER}')
    assert messages[3]["content"] == 'The tool result is {"c": 17}. The tool result is {"c": 21}. Answer the question.'
    assert all(set(m) == {"role", "content"} for m in messages)
    # tool_choice "none": no tool list, the history still rendered
    assert render_generic(HISTORY, None)[0] == {"role": "system", "content": "Be brief."}


def test_native_format_detection(smollm2):
    tok, _ = smollm2
    meta = load_tokenizer_meta(DATA / "tokenizer-meta.smollm2.json.gz")
    smol = ChatTemplate(meta["tokenizer.chat_template"], vocab=("<|im_start|>", "<|im_end|>"))
    assert not uses_native_format(smol)                 # ChatML without tools: generic format
    fallback = ChatTemplate(None, vocab=("<start_of_turn>", "<end_of_turn>"))
    assert uses_native_format(fallback)                 # our fallbacks write <tool_call>
    prompt = fallback.render(HISTORY, tools=TOOLS)
    assert OPENER in prompt and "<tool_response>" in prompt and "get_weather" in prompt


def test_output_plan(smollm2):
    from types import SimpleNamespace

    from engine.tools import plan_output

    tok, _ = smollm2
    meta = load_tokenizer_meta(DATA / "tokenizer-meta.smollm2.json.gz")
    smol = SimpleNamespace(tokenizer=tok, chat_template=ChatTemplate(meta["tokenizer.chat_template"]))
    native = SimpleNamespace(tokenizer=tok, chat_template=ChatTemplate(None, vocab=("<|im_start|>", "<|im_end|>")))

    def request(**kw):
        return SimpleNamespace(**{"messages": HISTORY, "tools": None, "tool_choice": "auto",
                                  "parallel_tool_calls": True, "allowed_tools": None, "json_schema": None, **kw})

    plan = plan_output(smol, request(tools=TOOLS))
    assert plan.tool_calls and plan.template_tools is None and plan.messages == render_generic(HISTORY, TOOLS)
    plan = plan_output(native, request(tools=TOOLS, tool_choice="required"))
    assert plan.tool_calls and plan.template_tools == TOOLS and plan.messages is HISTORY
    assert not plan.constraint.complete()               # "required": a call must come
    plan = plan_output(smol, request(tools=TOOLS, tool_choice="none"))
    assert "# Tools" not in plan.messages[0]["content"] and plan.constraint.complete()
    plan = plan_output(smol, request(json_schema={"type": "boolean"}))
    assert not plan.tool_calls and plan.constraint is not None
    # no tools offered: the history's calls and results are still written for a template
    # that cannot write them (a follow-up without `tools` lost them)
    plan = plan_output(smol, request())
    assert plan.constraint is None and plan.messages == render_generic(HISTORY, None)
    assert OPENER in plan.messages[2]["content"] and "The tool result is" in plan.messages[3]["content"]
    assert plan_output(native, request()).messages is HISTORY
    assert plan_output(smol, request(messages=HISTORY[:2])).messages == HISTORY[:2]
    # tools and a json_schema (D5): "auto" calls or the document, "none" the document only
    plan = plan_output(smol, request(tools=TOOLS, json_schema={"type": "boolean"}))
    assert plan.tool_calls and plan.constraint.complete() is False and "# Tools" in plan.messages[0]["content"]
    plan = plan_output(smol, request(tools=TOOLS, tool_choice="none", json_schema={"type": "boolean"}))
    assert not plan.tool_calls and "# Tools" not in plan.messages[0]["content"]
    with pytest.raises(SchemaError) as e:
        plan_output(smol, request(json_schema={"type": "string", "format": "iri"}))
    assert e.value.field == "json_schema"
    # whichever the choice, what cannot be enforced is refused, named by the field it is in
    bad_tool = [*TOOLS, {"name": "f", "parameters": {"type": "object", "properties": {"x": {"pattern": "(?=a)"}}}}]
    for choice in ("auto", "none", "required", {"type": "function", "name": "add"}):
        with pytest.raises(SchemaError) as e:
            plan_output(smol, request(tools=TOOLS, tool_choice=choice, json_schema={"type": "string", "format": "x"}))
        assert (e.value.field, e.value.path) == ("json_schema", "/format"), choice
        with pytest.raises(SchemaError) as e:
            plan_output(smol, request(tools=bad_tool, tool_choice=choice, json_schema={"type": "boolean"}))
        assert (e.value.field, e.value.path) == ("tools", "/3/parameters/properties/x/pattern"), choice


def test_a_bound_only_the_output_reaches_is_named_by_the_field_being_written():
    from types import SimpleNamespace

    from engine.tools import output_field

    def field(output=b"", **kw):
        request = SimpleNamespace(**{"tools": TOOLS, "tool_choice": "auto", "json_schema": {"type": "object"}, **kw})
        return output_field(request, output)

    assert field(b"<tool_call>") == "tools" and field(b'{"a": [[') == "json_schema"
    assert field(b"{", tool_choice="required") == field(tool_choice={"name": "add"}) == "tools"
    assert field(b"[", tool_choice="none") == "json_schema"
    assert field(b"Sure", json_schema=None) == "tools" and field(b"[", tools=None) == "json_schema"


# an answer the schema describes, or calls: short, so that a random model ends both
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                           "sure": {"type": "boolean"}}, "required": ["answer"],
          "additionalProperties": False}


def calls_or_answer(events, tools, schema) -> str:
    """Valid calls and no text, or no call and one document valid for `schema`, never
    neither (jsonschema reads both): "calls" or "answer"."""
    calls = check_calls(events, tools)
    text = "".join(e if isinstance(e, str) else e.text for e in events if isinstance(e, (str, TextDelta)))
    if calls:
        assert text == "", text
        return "calls"
    jsonschema.validate(json.loads(text), schema)
    return "answer"


def test_random_model_with_tools_and_a_schema_calls_or_answers(smollm2):
    """tool_choice "auto" with a json_schema: over 60 seeds every output is calls or the
    document, and both happen (the first byte decides, and the random model takes both)."""
    _, index = smollm2
    kinds = []
    for seed in range(60):
        text, complete = random_run(either_constraint(TOOLS, ANSWER, index), index.n_vocab, seed, max_tokens=600)
        assert complete, (seed, text)
        parser = ToolCallParser(leading=True)
        kinds.append(calls_or_answer(parser.feed(text.decode()) + parser.finish(), TOOLS, ANSWER))
    assert set(kinds) == {"calls", "answer"}
    c = either_constraint(TOOLS, ANSWER, index)
    assert not c.complete() and not c.allows(sorted(index.eos_ids)[0])   # something must be written
    c = either_constraint(TOOLS, ANSWER, index, parallel=False)
    tok, _ = smollm2
    for t in tok.encode('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', add_special=False):
        c.advance(t)
    assert c.complete() and not c.allows(tok.encode("\n", add_special=False)[0])


def test_the_opener_inside_a_document_is_text():
    """With a json_schema, calls can only begin the output: a `<tool_call>` in one of the
    document's strings is text, however the output is cut into pieces."""
    document = '{"answer": "<tool_call>{\\"name\\": \\"f\\", \\"arguments\\": {}}</tool_call>"}'
    for size in (1, 4, len(document)):
        parser = ToolCallParser(leading=True)
        out = [e for i in range(0, len(document), size) for e in parser.feed(document[i:i + size])] + parser.finish()
        assert "".join(out) == document and json.loads("".join(out))["answer"].startswith(OPENER)
    parser = ToolCallParser(leading=True)
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    out = [e for i in range(0, len(call), 2) for e in parser.feed(call[i:i + 2])] + parser.finish()
    assert out == [ToolCall(0, "get_time", "{}")]


# short calls: the tiny model's steps are the cost of this test, not the constraint's
TINY_TOOLS = [
    {"name": "set_light", "parameters": {"type": "object", "properties": {
        "on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["on"]}},
    {"name": "pick", "parameters": {"type": "object", "properties": {
        "color": {"enum": ["red", "blue"]}, "note": {"type": "string", "maxLength": 3}}, "required": ["color"]}},
]


async def test_tiny_model_makes_valid_calls_in_50_of_50_runs(tiny):
    from tests.test_constrain import generate_text, run_concurrently

    index = TokenIndex.of(tiny.tokenizer)

    def choice_of(seed):
        return "required" if seed % 2 else {"type": "function", "name": TINY_TOOLS[seed % 4 // 2]["name"]}

    results = await run_concurrently(
        lambda seed: generate_text(tiny, tool_constraint(TINY_TOOLS, choice_of(seed), index), seed, 400), 50)
    for seed, (text, reason) in results.items():
        choice = choice_of(seed)
        assert reason == "stop", (seed, text)
        calls = check_calls(parse(text), TINY_TOOLS)
        assert 1 <= len(calls) <= MAX_CALLS
        if isinstance(choice, dict):
            assert {c.name for c in calls} == {choice["name"]}


async def test_chat_tool_calls(tiny):
    from engine.api import ChatRequest, Finished, SamplingParams, TextDelta, ToolCall
    from tests.test_constrain import chat_events

    messages = [{"role": "user", "content": "Lights on."}]
    for seed in range(3):
        request = ChatRequest(messages, sampling=SamplingParams(seed=seed), tools=TINY_TOOLS, tool_choice="required")
        events = await chat_events(tiny, request)
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert [c.index for c in calls] == list(range(len(calls))) and calls
        check_calls(calls, TINY_TOOLS)
        assert not [e for e in events if isinstance(e, TextDelta)]
        assert isinstance(events[-1], Finished) and events[-1].reason == "stop"
    # a limit below the shortest call is refused at once; at that limit, the call is whole
    with pytest.raises(OutputBudgetTooSmall) as refused:
        tiny.prepare_chat(ChatRequest(messages, max_tokens=4, tools=TINY_TOOLS, tool_choice="required"))
    events = await chat_events(tiny, ChatRequest(messages, max_tokens=refused.value.needed, tools=TINY_TOOLS,
                                                 tool_choice="required"))
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert len(calls) == 1 and events[-1].reason in ("stop", "length")
    check_calls(calls, TINY_TOOLS)
    # "none": the prompt does not list the tools and no call comes
    request = ChatRequest(messages, max_tokens=20, tools=TINY_TOOLS, tool_choice="none")
    assert "set_light" not in tiny.prepare_chat(request).prompt
    assert not [e for e in await chat_events(tiny, request) if isinstance(e, ToolCall)]


async def test_chat_with_tools_and_a_schema_calls_or_answers(tiny):
    """D5, through prepare_chat / generate_chat: over seeds and temperatures "auto" gives
    valid calls or a valid document, never neither; "required" and a named function calls
    only, "none" the document only."""
    from engine.api import ChatRequest, SamplingParams
    from tests.test_constrain import chat_events, run_concurrently

    messages = [{"role": "user", "content": "Lights on, or say why not."}]
    choices = ["auto", "auto", "auto", "required", {"type": "function", "name": "pick"}, "none"]

    def request(seed):
        sampling = SamplingParams(temperature=(0.7, 1.0, 1.5)[seed % 3], seed=seed)
        return ChatRequest(messages, max_tokens=200, tools=TINY_TOOLS, tool_choice=choices[seed % len(choices)],
                           json_schema=ANSWER, sampling=sampling)

    results = await run_concurrently(lambda seed: chat_events(tiny, request(seed)), 24)
    kinds = {}
    for seed, events in results.items():
        choice = choices[seed % len(choices)]
        assert events[-1].reason == "stop", (seed, events)
        kind = calls_or_answer(events[:-1], TINY_TOOLS, ANSWER)
        kinds.setdefault(json.dumps(choice), set()).add(kind)
        if isinstance(choice, dict):
            assert {e.name for e in events if isinstance(e, ToolCall)} == {"pick"}
    assert kinds == {'"auto"': {"calls", "answer"}, '"required"': {"calls"},
                     '{"type": "function", "name": "pick"}': {"calls"}, '"none"': {"answer"}}
    # a document that holds the opener is an answer, under "auto" and "none" alike
    schema = {"const": "<tool_call>"}
    for choice in ("auto", "none"):
        events = await chat_events(tiny, ChatRequest(messages, tools=TINY_TOOLS, tool_choice=choice,
                                                     json_schema=schema, sampling=SamplingParams(temperature=0)))
        if calls_or_answer(events[:-1], TINY_TOOLS, schema) == "answer" or choice == "none":
            assert "".join(e.text for e in events if isinstance(e, TextDelta)) == '"<tool_call>"', choice


# -- the real SmolLM2-135M-Instruct (slow) ------------------------------------------------------

REAL_TOOLS = [
    {"name": "get_weather", "description": "Get the current weather for a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "description": "City name"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}},
    {"name": "send_email", "description": "Send an email.",
     "parameters": {"type": "object", "properties": {
         "to": {"type": "string"}, "subject": {"type": "string", "maxLength": 80},
         "body": {"type": "string", "maxLength": 200}}, "required": ["to", "subject", "body"]}},
    {"name": "set_timer", "description": "Start a timer.",
     "parameters": {"type": "object", "properties": {
         "minutes": {"type": "integer", "minimum": 1, "maximum": 600}}, "required": ["minutes"],
         "additionalProperties": False}},
    {"name": "search_web", "description": "Search the web.",
     "parameters": {"type": "object", "properties": {
         "query": {"type": "string", "maxLength": 100},
         "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}, "required": ["query"]}},
    {"name": "convert_currency", "description": "Convert an amount of money.",
     "parameters": {"type": "object", "properties": {
         "amount": {"type": "number", "minimum": 0}, "from": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
         "to": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]}}, "required": ["amount", "from", "to"]}},
]
REAL_REQUESTS = [
    ("What is the weather in Paris?", "required"),
    ("Is it raining in Tokyo right now? Use fahrenheit.", "required"),
    ("Email bob@example.com that the meeting moved to 3pm.", "required"),
    ("Set a timer for 25 minutes.", "required"),
    ("Search the web for the tallest building in the world.", "required"),
    ("How much is 100 US dollars in euros?", "required"),
    ("Remind me in 10 minutes to check the oven.", "required"),
    ("Find recent news about solar power.", "required"),
    ("Tell Alice (alice@example.org) happy birthday by email.", "required"),
    ("What's the temperature in Cairo?", "required"),
    ("What is the weather in Berlin?", "get_weather"),
    ("I am going to London tomorrow.", "get_weather"),
    ("Write to sam@example.com asking for the report.", "send_email"),
    ("Let me know when my tea is ready, 4 minutes.", "set_timer"),
    ("Cook pasta for 12 minutes.", "set_timer"),
    ("Who wrote War and Peace?", "search_web"),
    ("Python list comprehension tutorial", "search_web"),
    ("Convert 50 pounds to yen.", "convert_currency"),
    ("I have 20 euros, how many dollars is that?", "convert_currency"),
    ("Hello there!", "get_weather"),
]


@pytest.mark.slow
async def test_smollm2_tool_calls_are_valid(smollm2_model):
    from engine.api import ChatRequest, SamplingParams, ToolCall
    from tests.test_constrain import chat_events, run_concurrently

    def request(i):
        text, choice = REAL_REQUESTS[i]
        choice = choice if choice == "required" else {"type": "function", "name": choice}
        return ChatRequest([{"role": "user", "content": text}], max_tokens=400,
                           sampling=SamplingParams(temperature=0), tools=REAL_TOOLS, tool_choice=choice)

    results = await run_concurrently(lambda i: chat_events(smollm2_model, request(i)), len(REAL_REQUESTS), at_once=4)
    for i, events in results.items():
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert events[-1].reason == "stop" and calls, (REAL_REQUESTS[i], events)
        check_calls(calls, REAL_TOOLS)
        if REAL_REQUESTS[i][1] != "required":
            assert {c.name for c in calls} == {REAL_REQUESTS[i][1]}


@pytest.mark.slow
async def test_smollm2_tool_round_trip(smollm2_model):
    from engine.api import ChatRequest, SamplingParams, TextDelta, ToolCall
    from tests.test_constrain import chat_events

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    events = await chat_events(smollm2_model, ChatRequest(
        messages, max_tokens=200, sampling=SamplingParams(temperature=0), tools=REAL_TOOLS, tool_choice="required"))
    call = next(e for e in events if isinstance(e, ToolCall))
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Paris"
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 17, "condition": "light rain"}'},
    ]
    events = await chat_events(smollm2_model, ChatRequest(
        messages, max_tokens=80, sampling=SamplingParams(temperature=0), tools=REAL_TOOLS, tool_choice="auto"))
    answer = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert not [e for e in events if isinstance(e, ToolCall)] and answer.strip(), events
    assert "rain" in answer and "<tool" not in answer, answer     # it answers from the result


@pytest.mark.slow
async def test_smollm2_with_tools_and_a_schema_calls_or_answers(smollm2_model):
    """The real model, tools and a json_schema under "auto" (an agent's request): each
    response is valid calls or a valid answer, whichever it chose."""
    from engine.api import ChatRequest, SamplingParams
    from tests.test_constrain import chat_events, run_concurrently

    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 80}},
              "required": ["answer"], "additionalProperties": False}
    asks = ["What is the weather in Paris?", "Set a timer for 25 minutes.", "What is the capital of France?",
            "Say hello."]

    def request(i):
        return ChatRequest([{"role": "user", "content": asks[i]}], max_tokens=160,
                           sampling=SamplingParams(temperature=0), tools=REAL_TOOLS, json_schema=schema)

    results = await run_concurrently(lambda i: chat_events(smollm2_model, request(i)), len(asks), at_once=4)
    for i, events in results.items():
        assert events[-1].reason == "stop", (asks[i], events)
        calls_or_answer(events[:-1], REAL_TOOLS, schema)


def test_the_tools_of_a_request_are_bounded_together_as_one_schema(smollm2):
    """D9: the tools are one grammar, and were compiled each within the bounds of one schema:
    128 tools cost 128 schemas. Their parameters share MAX_SUBSCHEMAS, the tool where it is
    crossed named."""
    _, index = smollm2
    each = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(255)}}  # 256 subschemas
    tools = [{"name": f"t{k}", "parameters": each} for k in range(MAX_SUBSCHEMAS // 256 + 1)]
    tool_constraint(tools[:-1], "required", index)
    with pytest.raises(SchemaError, match=f"more than {MAX_SUBSCHEMAS:,} subschemas") as e:
        tool_constraint(tools, "required", index)
    assert e.value.path.startswith(f"/{len(tools) - 1}/parameters/properties/"), e.value.path

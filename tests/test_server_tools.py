"""Tools and structured output end to end (6.5, D5), enforced while decoding even by a tiny random model."""

import json

import jsonschema
import pytest
import trio

from server_harness import make_service, parse_sse, server, start_server, tiny_path  # noqa: F401

TINY_ID = "tiny:chat-q8_0"
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
                   "required": ["city"], "additionalProperties": False},
}
TIME = {"type": "function", "name": "get_time", "description": "The time now.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
ASK = [{"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "What is the weather in Hangzhou?"}]}]


def body(**fields) -> dict:
    return {"model": TINY_ID, "input": ASK, "temperature": 0, "max_output_tokens": 96,
            "tools": [WEATHER, TIME], **fields}


def calls_of(response: dict) -> list[dict]:
    return [item for item in response["output"] if item["type"] == "function_call"]


def check_call(call: dict, tools=(WEATHER, TIME)) -> None:
    """A function_call item of one of `tools`, its arguments valid for its parameters (jsonschema)."""
    assert set(call) == {"id", "type", "call_id", "name", "arguments"}
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    (tool,) = [tool for tool in tools if tool["name"] == call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), tool["parameters"])


async def test_required_always_calls_a_listed_tool(server):
    reply = await server.responses(body(tool_choice="required"))
    assert reply.status == 200, reply.body
    response = reply.json()
    assert response["status"] in ("completed", "incomplete")  # a random model may call and call
    calls = calls_of(response)
    assert calls
    for call in calls:
        check_call(call)
    assert len({call["call_id"] for call in calls}) == len(calls)


async def test_a_named_tool_is_the_one_called(server):
    response = (await server.responses(body(tool_choice={"type": "function", "name": "get_time"}))).json()
    calls = calls_of(response)
    assert calls and all(call["name"] == "get_time" for call in calls)
    for call in calls:
        check_call(call)


async def test_none_never_calls(server):
    response = (await server.responses(body(tool_choice="none", max_output_tokens=16))).json()
    assert not calls_of(response)


async def test_streamed_calls_arrive_complete_in_output_item_done(server):
    reply = await server.responses(body(tool_choice="required", stream=True))
    events = parse_sse(reply.body)
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert events[-1].event in ("response.completed", "response.incomplete")
    added = [e.data["item"] for e in events if e.event == "response.output_item.added"
             and e.data["item"]["type"] == "function_call"]
    done = [e.data["item"] for e in events if e.event == "response.output_item.done"
            and e.data["item"]["type"] == "function_call"]
    assert done and len(added) == len(done)
    for started, call in zip(added, done):
        assert started["id"] == call["id"] and started["call_id"] == call["call_id"]
        check_call(call)


async def test_round_trip_with_the_tool_result(server):
    response = (await server.responses(body(tool_choice="required"))).json()
    call = calls_of(response)[0]
    follow_up = body(max_output_tokens=8, input=[
        *ASK, call, {"type": "function_call_output", "call_id": call["call_id"],
                     "output": json.dumps({"temperature_c": 17})}])
    assert (await server.responses(follow_up)).status == 200


@pytest.mark.parametrize("parameters", [{}, {"properties": {"n": {"type": "integer"}}, "required": ["n"]}])
async def test_parameters_without_a_type_still_give_object_arguments(server, parameters):
    tool = {"type": "function", "name": "count", "parameters": parameters}
    response = (await server.responses(body(tools=[tool], tool_choice="required"))).json()
    call = calls_of(response)[0]
    check_call(call, [tool])
    assert isinstance(json.loads(call["arguments"]), dict)  # arguments are an object, whatever the parameters
    follow_up = body(tools=[tool], max_output_tokens=8, input=[
        *ASK, call, {"type": "function_call_output", "call_id": call["call_id"], "output": "3"}])
    assert (await server.responses(follow_up)).status == 200  # the call goes back as it came


async def test_parameters_by_ref_or_anyof_give_object_arguments(server):
    """Every document such parameters allow is an object: accepted; one that allows another value is not."""
    by_ref = {"$ref": "#/$defs/args", "$defs": {"args": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
    either = {"anyOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                         "additionalProperties": False}, {"$ref": "#/$defs/args"}], "$defs": by_ref["$defs"]}
    for parameters in (by_ref, either):
        tool = {"type": "function", "name": "pick", "parameters": parameters}
        reply = await server.responses(body(tools=[tool], tool_choice="required"))
        assert reply.status == 200, reply.body
        check_call(calls_of(reply.json())[0], [tool])
    tool = {"type": "function", "name": "pick",
            "parameters": {"anyOf": [{"$ref": "#/$defs/args"}, {"type": "null"}], "$defs": by_ref["$defs"]}}
    reply = await server.responses(body(tools=[WEATHER, tool]))
    assert reply.status == 400 and reply.json()["param"] == "tools[1].parameters", reply.body


async def test_structured_output_is_valid_json_for_the_schema(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    reply = await server.responses({"model": TINY_ID, "input": ASK, "temperature": 0,
                                    "max_output_tokens": 32, "response_format": fmt})
    assert reply.status == 200, reply.body
    response = reply.json()
    assert response["status"] == "completed"
    jsonschema.validate(json.loads(response["output"][-1]["content"][0]["text"]), schema)


ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"],
          "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


def calls_or_answer(response: dict) -> str:
    """D5 with tools and a json_schema: valid calls and no message, or no call and a message
    whose text is valid for the schema (jsonschema), never neither."""
    calls = calls_of(response)
    messages = [item for item in response["output"] if item["type"] == "message"]
    for call in calls:
        check_call(call)
    if calls:
        assert not messages, response
        return "calls"
    (message,) = messages
    jsonschema.validate(json.loads(message["content"][0]["text"]), ANSWER)
    return "answer"


async def test_tools_with_a_json_schema_give_calls_or_a_valid_answer(server):
    """An agent's request (tools, and a structured answer when it does not call): over seeds
    "auto" does both, each valid; "required" and a named tool call, "none" answers."""
    def request(seed, choice="auto", **fields):
        return body(tool_choice=choice, response_format=ANSWER_FORMAT, temperature=1.0, max_output_tokens=200,
                    extensions={"lmsp-min": {"seed": seed}}, **fields)

    kinds, first = {}, {}
    for seed, choice in enumerate(["auto"] * 8 + ["required", {"type": "function", "name": "get_time"}, "none"]):
        reply = await server.responses(request(seed, choice))
        assert reply.status == 200, reply.body
        assert reply.json()["status"] == "completed", reply.body
        kinds.setdefault(json.dumps(choice), set()).add(calls_or_answer(reply.json()))
        first = first or reply.json()
    assert kinds == {'"auto"': {"calls", "answer"}, '"required"': {"calls"},
                     '{"type": "function", "name": "get_time"}': {"calls"}, '"none"': {"answer"}}
    events = parse_sse((await server.responses(request(0, stream=True))).body)
    assert events[-1].event == "response.completed"  # streamed: the same output, as its events say
    streamed = {"output": [e.data["item"] for e in events if e.event == "response.output_item.done"]}
    assert calls_or_answer(streamed) == calls_or_answer(first)


async def test_tools_with_a_json_schema_name_the_one_refused(server):
    """With both, a schema that cannot be enforced is named where it is, whatever the choice,
    also when only the output reaches its bound (the tools' case: test_tools.py's output_field)."""
    bad = {"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)"}}}}
    bad_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "string", "format": "x"}}}
    for choice in ("auto", "none", "required"):
        reply = await server.responses(body(tools=[WEATHER, bad], tool_choice=choice, response_format=ANSWER_FORMAT))
        assert reply.status == 400 and reply.json()["param"] == "tools[1].parameters.properties.x.pattern", reply.body
        reply = await server.responses(body(tool_choice=choice, response_format=bad_format))
        assert reply.status == 400 and reply.json()["param"] == "response_format.json_schema.schema.format", reply.body
    defs = {"L0": {"type": "integer"}}  # (the bound only the output reaches: each "[" doubles the ways)
    for k in range(1, 11):
        one = {"type": "array", "items": {"$ref": f"#/$defs/L{k - 1}"}, "minItems": 1, "maxItems": 1}
        defs[f"L{k}"] = {"anyOf": [one, {**one, "maxItems": 2}]}
    nested = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"$ref": "#/$defs/L10", "$defs": defs}}}
    reply = await server.responses(body(tool_choice="none", response_format=nested, max_output_tokens=32))
    assert reply.status == 400 and reply.json()["param"] == "response_format.json_schema.schema", reply.body


def objects_of_strings(n_objects: int, n_strings: int) -> dict:
    """An object of `n_objects` objects of `n_strings` strings: 1 + n_objects * (1 + n_strings) subschemas."""
    inner = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n_strings)}}
    return {"type": "object", "properties": {f"o{k}": inner for k in range(n_objects)}}


async def test_a_schema_past_the_size_bound_is_refused_before_any_token_naming_the_bound(server):
    """D9: each object and enum was bounded, a whole schema not: 256 objects of 256 properties
    (2 MB) compiled for 1.6 s and generated, 128 tools for 128 times one tool. Past 10,000
    subschemas, in a json_schema or in all the tools' parameters together, it is a 400 that
    names the bound and the param where it was crossed."""
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": objects_of_strings(40, 250)}}
    with trio.fail_after(60):
        reply = await server.responses({"model": TINY_ID, "input": ASK, "max_output_tokens": 4, "response_format": fmt})
    assert reply.status == 400, reply.body
    problem = reply.json()
    assert problem["code"] == "invalid_request" and "more than 10,000 subschemas" in problem["detail"]
    assert problem["param"].startswith("response_format.json_schema.schema.properties.o39.properties.p")
    each = objects_of_strings(1, 254)  # 256 subschemas: 39 such tools are 9,984
    tools = [{"type": "function", "name": f"t{k}", "parameters": each} for k in range(40)]
    with trio.fail_after(60):
        reply = await server.responses(body(tools=tools, tool_choice="required", max_output_tokens=4))
    assert reply.status == 400, reply.body
    problem = reply.json()
    assert problem["code"] == "invalid_request" and "more than 10,000 subschemas" in problem["detail"]
    assert problem["param"].startswith("tools[39].parameters"), problem


async def test_required_keys_without_properties_are_written(server):
    """JSON Schema: `required` alone asks for the keys, their values as additionalProperties says."""
    schema = {"type": "object", "required": ["a", "b"], "additionalProperties": {"type": "boolean"}}
    fmt = {"type": "json_schema", "json_schema": {"name": "flags", "schema": schema}}
    reply = await server.responses({"model": TINY_ID, "input": ASK, "temperature": 0,
                                    "max_output_tokens": 32, "response_format": fmt})
    assert reply.status == 200, reply.body
    value = json.loads(reply.json()["output"][-1]["content"][0]["text"])
    jsonschema.validate(value, schema)
    assert set(value) == {"a", "b"}  # no other key is written
    tool = {"type": "function", "name": "flag", "parameters": schema}
    response = (await server.responses(body(tools=[tool], tool_choice="required"))).json()
    call = calls_of(response)[0]
    check_call(call, [tool])
    assert set(json.loads(call["arguments"])) == {"a", "b"}


async def test_an_optional_property_no_value_satisfies_is_left_out_through_a_ref(server):
    """As it is written inline: it is never written (a $ref to it was a 400)."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/never"}, "b": {"type": "boolean"}},
              "required": ["b"], "$defs": {"never": {"type": "integer", "minimum": 1, "maximum": 0}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}
    reply = await server.responses({"model": TINY_ID, "input": ASK, "temperature": 0,
                                    "max_output_tokens": 32, "response_format": fmt})
    assert reply.status == 200, reply.body
    jsonschema.validate(json.loads(reply.json()["output"][-1]["content"][0]["text"]), schema)


async def test_a_number_bounded_below_a_millionth_is_written(server):
    schema = {"type": "number", "exclusiveMinimum": 0, "maximum": 1e-7}
    fmt = {"type": "json_schema", "json_schema": {"name": "tiny", "schema": schema}}
    reply = await server.responses({"model": TINY_ID, "input": ASK, "temperature": 0,
                                    "max_output_tokens": 32, "response_format": fmt})
    assert reply.status == 200, reply.body
    jsonschema.validate(json.loads(reply.json()["output"][-1]["content"][0]["text"]), schema)


async def test_a_keyword_that_cannot_be_enforced_is_named(server):
    schema = {"type": "string", "pattern": "^[a-z]+(?!x)$"}
    fmt = {"type": "json_schema", "json_schema": {"name": "word", "schema": schema}}
    reply = await server.responses({"model": TINY_ID, "input": ASK, "response_format": fmt})
    assert reply.status == 400
    doc = reply.json()
    assert doc["code"] == "invalid_request" and "pattern" in doc["detail"]
    assert doc["param"].startswith("response_format.json_schema.schema")


async def test_a_tool_schema_keyword_is_named_as_validation_names_params(server):
    # array indices in brackets, as in "tools[0].name" and "input[2].content[0]"
    tool = {"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"0": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "(?=a)"}]}}}}
    reply = await server.responses({"model": TINY_ID, "input": ASK, "tools": [tool]})
    assert reply.status == 400
    assert reply.json()["param"] == "tools[0].parameters.properties.0.anyOf[1].pattern"


async def test_nested_alternatives_past_the_bound_are_refused_before_generating(server):
    """D9: 400 ways to read one byte is a 400 naming the anyOf, not a response that fails on that byte."""
    strings = {"anyOf": [{"anyOf": [{"const": f"s{i}_{j}"} for j in range(20)]} for i in range(20)]}
    schema = {"type": "object", "properties": {"a": strings}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}
    reply = await server.responses({"model": TINY_ID, "input": ASK, "response_format": fmt})
    assert reply.status == 400, reply.body
    assert reply.json()["param"] == "response_format.json_schema.schema.properties.a.anyOf"
    tool = {"type": "function", "name": "f", "parameters": schema}
    reply = await server.responses(body(tools=[tool], tool_choice="required"))
    assert reply.status == 400, reply.body
    assert reply.json()["param"] == "tools[0].parameters.properties.a.anyOf"


async def test_alternatives_that_grow_past_the_bound_while_generating_are_named(server):
    """D5: a schema refused by the bound only the output reaches (each "[" doubles the ways
    to read it: 512 after nine) names the schema as one refused before generating does,
    synchronous (the param was missing) and streamed (in response.failed's error). It fails
    that request alone: the scheduler's thread, which meets the bound first when it looks
    ahead for forced text to draft, goes on (an exception there would end it, failing every
    request it ran; pyproject.toml makes a thread's death a test failure)."""
    defs = {"L0": {"type": "integer"}}
    for k in range(1, 11):
        one = {"type": "array", "items": {"$ref": f"#/$defs/L{k - 1}"}, "minItems": 1, "maxItems": 1}
        defs[f"L{k}"] = {"anyOf": [one, {**one, "maxItems": 2}]}
    fmt = {"type": "json_schema", "json_schema": {"name": "nested", "schema": {"$ref": "#/$defs/L10", "$defs": defs}}}
    request = {"model": TINY_ID, "input": ASK, "max_output_tokens": 32, "response_format": fmt}
    reply = await server.responses(request)
    assert reply.status == 400, reply.body
    assert reply.json()["code"] == "invalid_request" and "256" in reply.json()["detail"]
    assert reply.json()["param"] == "response_format.json_schema.schema"
    events = parse_sse((await server.responses({**request, "stream": True})).body)
    assert events[-1].event == "response.failed"
    assert events[-1].data["error"] == reply.json()


@pytest.mark.parametrize("chosen", ["get_time", "f"])
async def test_a_tool_schema_is_named_by_its_index_whichever_tool_is_chosen(server, chosen):
    tool = {"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)"}}}}
    reply = await server.responses({"model": TINY_ID, "input": ASK, "tools": [TIME, tool],
                                    "tool_choice": {"type": "function", "name": chosen}})
    assert reply.status == 400, reply.body
    assert reply.json()["param"] == "tools[1].parameters.properties.x.pattern"


@pytest.mark.parametrize("capability", ["tools", "structured_output"])
async def test_the_tiny_model_lists_what_it_can_do(server, capability):
    model = (await server.request("GET", f"/lmsp/v1/models/{TINY_ID}")).json()
    assert capability in model["capabilities"]


async def thinking_model_server(nursery, tmp_path):
    """A server of a tiny model whose template opens a <think> block: it reasons (D4)."""
    from tiny import SMOLLM2_TOKENIZER, load_tokenizer_meta, write_tiny_model

    meta = load_tokenizer_meta(SMOLLM2_TOKENIZER)
    meta["tokenizer.chat_template"] += "{% if add_generation_prompt %}<think>\n{% endif %}"
    path = write_tiny_model(tmp_path / "think-chat-q8_0.gguf", "llama", tokenizer_meta=meta)
    server = await start_server(nursery, await make_service([path]))
    return server, (await server.request("GET", "/lmsp/v1/models")).json()["data"][0]["id"]


async def test_a_reasoning_model_answers_a_json_schema_in_its_message(nursery, tmp_path):
    """D5: the document is the message text, even when the template opens a <think>."""
    server, model_id = await thinking_model_server(nursery, tmp_path)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}
    response = (await server.responses({"model": model_id, "input": ASK, "temperature": 1.0, "max_output_tokens": 40,
                                        "response_format": fmt, "extensions": {"lmsp-min": {"seed": 3}}})).json()
    assert response["status"] == "completed", response
    assert [item["type"] for item in response["output"]] == ["message"]
    jsonschema.validate(json.loads(response["output"][0]["content"][0]["text"]), schema)


async def test_a_reasoning_model_keeps_its_thought_out_of_the_message_with_tools(nursery, tmp_path):
    """D4 holds with tools on: the template opens <think>, so the text is a thought."""
    server, model_id = await thinking_model_server(nursery, tmp_path)
    response = (await server.responses({"model": model_id, "input": ASK, "temperature": 0, "max_output_tokens": 12,
                                        "tools": [TIME], "tool_choice": "auto"})).json()
    assert [item["type"] for item in response["output"]] == ["reasoning"]


async def test_a_malformed_keyword_beside_an_enum_is_named(server):
    """The enum's values were checked against it before it was: a 500, not a 400."""
    schema = {"enum": ["a", "b"], "properties": {}, "minLength": "2"}
    fmt = {"type": "json_schema", "json_schema": {"name": "word", "schema": schema}}
    reply = await server.responses({"model": TINY_ID, "input": ASK, "response_format": fmt})
    assert reply.status == 400, reply.body
    doc = reply.json()
    assert doc["code"] == "invalid_request" and doc["param"] == "response_format.json_schema.schema.minLength"


async def test_structured_output_cut_by_max_output_tokens_is_incomplete_and_whole(server):
    """D4: the token budget ends a document as it ends any text, incomplete, never a failure;
    and the document it ends is closed in time: it parses and validates (issue 39)."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}
    reply = await server.responses({"model": TINY_ID, "input": ASK, "temperature": 0,
                                    "max_output_tokens": 12, "response_format": fmt})
    assert reply.status == 200, reply.body
    response = reply.json()
    assert response["status"] == "incomplete" and response["error"] is None
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    jsonschema.validate(json.loads(response["output"][-1]["content"][0]["text"]), schema)

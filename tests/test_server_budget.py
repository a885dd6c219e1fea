"""The output budget through the server (issue 39), in the three faces (LMSP, OpenAI Responses,
Chat Completions), streamed or not: a constrained answer cut by its limit is incomplete and
parses, a limit below the shortest answer is refused naming the face's own field, and an
answer whose calls are all complete ends completed / tool_calls when only a repeat was cut."""

import json

import jsonschema
import pytest

from server_harness import parse_sse, server, tiny_path  # noqa: F401 (fixtures)
from test_openai_wire import chat_data

TINY_ID = "tiny:chat-q8_0"
ASK = "What time is it? Answer as JSON."
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
GET_TIME = {"name": "get_time", "description": "The time now.",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
FACES = ["lmsp", "responses", "chat"]


def request(face: str, limit: int, *, schema=None, tool=None, stream=False, limit_name=None):
    """(path, body) of a request in `face`: a json_schema answer or a required call of `tool`."""
    body = {"model": TINY_ID, "temperature": 0, "stream": stream}
    if face == "chat":
        body.update(messages=[{"role": "user", "content": ASK}], **{limit_name or "max_tokens": limit})
        if stream:
            body["stream_options"] = {"include_usage": True}
        if schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}
        if tool is not None:
            body.update(tools=[{"type": "function", "function": tool}], tool_choice="required")
        return "/v1/chat/completions", body
    body.update(input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}],
                max_output_tokens=limit)
    if schema is not None and face == "lmsp":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}
    elif schema is not None:
        body["text"] = {"format": {"type": "json_schema", "name": "doc", "schema": schema}}
    if tool is not None:
        body.update(tools=[{"type": "function", **tool}], tool_choice="required")
    return ("/lmsp/v1/responses" if face == "lmsp" else "/v1/responses"), body


async def outcome(server, face: str, limit: int, **kwargs) -> tuple[str, str, list, int]:
    """(finish: completed / incomplete, or the chat finish_reason; the message text; the
    calls as (name, arguments); output tokens) of one request, streamed or not."""
    path, body = request(face, limit, **kwargs)
    reply = await server.request("POST", path, json_body=body)
    assert reply.status == 200, reply.body
    if face == "chat":
        if body["stream"]:
            chunks = [c for c in chat_data(reply.body) if c != "[DONE]"]
            deltas = [c["choices"][0] for c in chunks if c["choices"]]
            text = "".join(d["delta"].get("content") or "" for d in deltas)
            calls = [(t["function"]["name"], t["function"]["arguments"])
                     for d in deltas for t in d["delta"].get("tool_calls") or ()]
            usage = [c["usage"] for c in chunks if c.get("usage")]
            return deltas[-1]["finish_reason"], text, calls, usage[-1]["completion_tokens"]
        reply = reply.json()
        message = reply["choices"][0]["message"]
        calls = [(t["function"]["name"], t["function"]["arguments"]) for t in message.get("tool_calls") or ()]
        return reply["choices"][0]["finish_reason"], message["content"] or "", calls, reply["usage"]["completion_tokens"]
    if body["stream"] and face == "lmsp":  # (its final event has the status and usage, not the output)
        events = parse_sse(reply.body)
        response = {"status": events[-1].data["status"], "usage": events[-1].data["usage"],
                    "incomplete_details": events[-1].data.get("incomplete_details"),
                    "output": [e.data["item"] for e in events if e.event == "response.output_item.done"]}
    else:
        response = parse_sse(reply.body)[-1].data["response"] if body["stream"] else reply.json()
    if response["status"] == "incomplete":
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    calls = [(item["name"], item["arguments"]) for item in response["output"] if item["type"] == "function_call"]
    return response["status"], text, calls, response["usage"]["output_tokens"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("face", FACES)
async def test_a_document_cut_by_its_limit_is_incomplete_and_parses(server, face, stream):
    for limit in (9, 12, 17):
        finish, text, _, used = await outcome(server, face, limit, schema=SCHEMA, stream=stream)
        assert finish in ("incomplete", "length") and used <= limit, (limit, text)
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("face, limit_name", [("lmsp", "max_output_tokens"), ("responses", "max_output_tokens"),
                                              ("chat", "max_tokens"), ("chat", "max_completion_tokens")])
async def test_a_limit_below_the_shortest_answer_is_refused_naming_the_field_and_the_tokens_needed(
        server, face, limit_name):
    path, body = request(face, 2, schema=SCHEMA, limit_name=limit_name)
    reply = await server.request("POST", path, json_body=body)
    assert reply.status == 400, reply.body
    error = reply.json() if face == "lmsp" else reply.json()["error"]
    assert error["param"] == limit_name
    needed = int(error["detail" if face == "lmsp" else "message"].rsplit(" ", 1)[1])
    assert needed > 2
    path, body = request(face, needed, schema=SCHEMA, limit_name=limit_name)  # that many is enough
    assert (await server.request("POST", path, json_body=body)).status == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("face", FACES)
async def test_a_call_followed_by_a_cut_repeat_of_it_ends_finished(server, face, stream):
    """The tiny model calls get_time, then calls it again word for word (it has no arguments
    to vary): given room it writes the whole repeat, which is dropped; cut three tokens
    before the repeat's end, the answer is the same call, finished, not cut."""
    roomy = await outcome(server, face, 160, tool=GET_TIME, stream=stream)
    finished = "tool_calls" if face == "chat" else "completed"
    assert roomy[0] == finished and roomy[2] == [("get_time", "{}")], roomy
    finish, _, calls, used = await outcome(server, face, roomy[3] - 3, tool=GET_TIME, stream=stream)
    assert (finish, calls) == (finished, [("get_time", "{}")]) and used <= roomy[3] - 3

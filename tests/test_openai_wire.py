"""The OpenAI dialect on the wire: event sequences, SSE framing, error bodies, and that the
LMSP face does not move."""

import json
import math

import h11
import pytest
import trio

from lmsp_min.problems import unavailable
from server_harness import make_service, parse_sse, start_server, tiny_path  # noqa: F401
from test_tasks import gated
from waiting import wait_until

TINY_ID = "tiny:chat-q8_0"
ASK = "What is the weather in Hangzhou?"


@pytest.fixture
async def server(nursery, tiny_path, tmp_path):
    return await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path / "data"))


async def post(server, path: str, body: dict, headers=None):
    return await server.request("POST", path, json_body=body, headers=headers)


def chat_data(body: bytes) -> list:
    """The `data` of each message of a chat stream ([DONE] as the string)."""
    messages = [block for block in body.decode().split("\n\n") if block and not block.startswith(":")]
    assert all(block.startswith("data: ") and "\n" not in block for block in messages)
    return [block[6:] if block == "data: [DONE]" else json.loads(block[6:]) for block in messages]


def check_responses_stream(body: bytes) -> list[dict]:
    """The rules every Responses stream keeps; returns the events' data."""
    events = parse_sse(body)
    assert b"[DONE]" not in body and all(event.id is None for event in events)
    data = [event.data for event in events]
    assert all(event.event == event.data["type"] for event in events)  # the `event:` line is the type
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["type"] for d in data[:2]] == ["response.created", "response.in_progress"]
    created = data[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["object"] == "response"
    final = data[-1]
    assert final["type"] in ("response.completed", "response.incomplete", "response.failed")
    assert final["response"]["id"] == created["id"] and final["response"]["status"] == final["type"][9:]
    opened = {}  # output_index -> item id, between its added and done events
    for d in data[2:-1]:
        kind = d["type"]
        if kind == "response.output_item.added":
            assert d["output_index"] not in opened and d["item"]["status"] == "in_progress"
            opened[d["output_index"]] = d["item"]["id"]
        elif kind == "response.output_item.done":
            assert opened.pop(d["output_index"]) == d["item"]["id"]
            assert d["item"]["status"] == final["response"]["output"][d["output_index"]]["status"]
        elif kind != "error":
            assert opened[d["output_index"]] == d["item_id"], kind
    assert not opened or final["type"] == "response.failed"  # (a failure leaves its item as it was)
    return data


async def test_a_text_stream_event_by_event(server):
    reply = await post(server, "/v1/responses", {"model": TINY_ID, "input": "Tell me a story.", "stream": True,
                                                 "max_output_tokens": 5, "temperature": 0})
    assert reply.status == 200 and reply.headers["content-type"] == "text/event-stream"
    data = check_responses_stream(reply.body)
    kinds = [d["type"] for d in data]
    deltas = [d for d in data if d["type"] == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.incomplete"])
    assert all(d["content_index"] == 0 and d["output_index"] == 0 and d["logprobs"] == [] for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    assert data[-4]["text"] == text and data[-3]["part"] == {"type": "output_text", "text": text,
                                                             "annotations": [], "logprobs": []}
    final = data[-1]["response"]
    assert [item["id"] for item in final["output"]] == [data[-2]["item"]["id"]]
    assert final["output"][0]["content"] == data[-2]["item"]["content"] == [data[-3]["part"]]
    assert final["output"][0]["status"] == data[-2]["item"]["status"] == "incomplete"  # (cut by max_output_tokens)
    assert final["usage"]["output_tokens"] == 5 and final["incomplete_details"] == {"reason": "max_output_tokens"}
    stored = (await server.request("GET", f"/v1/responses/{final['id']}")).json()
    assert stored == final  # the stored response is the one the stream ended with


async def test_a_call_stream_sends_its_arguments(server):
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"],
        "additionalProperties": False}}
    reply = await post(server, "/v1/responses", {"model": TINY_ID, "input": ASK, "tools": [tool], "stream": True,
                                                 "tool_choice": {"type": "function", "name": "get_weather"},
                                                 "temperature": 0, "max_output_tokens": 64})
    data = check_responses_stream(reply.body)
    kinds = [d["type"] for d in data]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added, delta, done, item_done = data[2:6]
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    assert delta["delta"] == done["arguments"] == item_done["item"]["arguments"]
    assert set(json.loads(done["arguments"])) == {"city"}
    assert done["name"] == "get_weather" and item_done["item"]["call_id"] == added["item"]["call_id"]


async def test_a_response_failing_while_generating(server):
    """A schema whose bound only the output reaches (test_server_tools): a 400 synchronously,
    response.failed with the error in a stream, and the param named as this dialect names it."""
    defs = {"L0": {"type": "integer"}}
    for k in range(1, 11):
        one = {"type": "array", "items": {"$ref": f"#/$defs/L{k - 1}"}, "minItems": 1, "maxItems": 1}
        defs[f"L{k}"] = {"anyOf": [one, {**one, "maxItems": 2}]}
    body = {"model": TINY_ID, "input": ASK, "max_output_tokens": 32, "text": {"format": {
        "type": "json_schema", "name": "nested", "schema": {"$ref": "#/$defs/L10", "$defs": defs}}}}
    reply = await post(server, "/v1/responses", body)
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == "text.format.schema" and error["type"] == "invalid_request_error"
    data = check_responses_stream((await post(server, "/v1/responses", {**body, "stream": True})).body)
    assert data[-1]["type"] == "response.failed"
    # (a failed response's code is one of OpenAI's few: a 400's is invalid_prompt)
    assert data[-1]["response"]["error"] == {"code": "invalid_prompt", "message": error["message"]}


async def test_a_chat_stream_on_the_wire(server):
    reply = await post(server, "/v1/chat/completions", {
        "model": TINY_ID, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    assert reply.status == 200 and reply.headers["content-type"] == "text/event-stream"
    data = chat_data(reply.body)
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 2) + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["object"] == "chat.completion.chunk" and "usage" in c for c in chunks)


async def test_a_chat_stream_without_usage_has_no_usage_key(server):
    reply = await post(server, "/v1/chat/completions", {
        "model": TINY_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
    chunks = chat_data(reply.body)[:-1]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_a_failing_chat_stream_sends_an_error_then_done(server):
    defs = {"L0": {"type": "integer"}}
    for k in range(1, 11):
        one = {"type": "array", "items": {"$ref": f"#/$defs/L{k - 1}"}, "minItems": 1, "maxItems": 1}
        defs[f"L{k}"] = {"anyOf": [one, {**one, "maxItems": 2}]}
    reply = await post(server, "/v1/chat/completions", {
        "model": TINY_ID, "messages": [{"role": "user", "content": ASK}], "max_tokens": 32, "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "nested", "schema": {"$ref": "#/$defs/L10", "$defs": defs}}}})
    data = chat_data(reply.body)
    assert data[-1] == "[DONE]" and set(data[-2]) == {"error"}
    assert data[-2]["error"]["param"] == "response_format.json_schema.schema"


@pytest.mark.parametrize("method, path, status, code", [
    ("GET", "/v1/nope", 404, "not_found"),
    ("PUT", "/v1/responses", 405, "method_not_allowed"),
    ("GET", "/v1/responses/resp_nope", 404, "response_not_found"),
    ("DELETE", "/v1/responses/resp_nope", 404, "response_not_found"),
    ("GET", "/v1/models/nope", 404, "model_not_found"),
])
async def test_errors_are_openai_error_objects(server, method, path, status, code):
    reply = await server.request(method, path)
    assert reply.status == status and reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    if status == 405:
        assert reply.headers["allow"] == "POST"


async def test_a_body_that_is_not_json_is_a_400_and_a_wrong_type_a_415(server):
    reply = await server.request("POST", "/v1/chat/completions", body=b"{",
                                 headers={"Content-Type": "application/json"})
    assert reply.status == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    reply = await server.request("POST", "/v1/responses", body=b"{}", headers={"Content-Type": "text/plain"})
    assert reply.status == 415 and reply.json()["error"]["code"] == "unsupported_media_type"


async def test_auth_on_the_dialect_is_the_lmsp_auth(nursery, tiny_path, tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"token": "sk-reader", "principal": "bob", "scopes": ["models:read"]},
                                  {"token": "sk-writer", "principal": "ann",
                                   "scopes": ["models:read", "responses:write"]}]))
    server = await start_server(nursery, await make_service([tiny_path], tokens_file=tokens))
    unauthorized = await server.request("GET", "/v1/models")
    assert unauthorized.status == 401 and unauthorized.headers["www-authenticate"].startswith("Bearer")
    assert unauthorized.json()["error"]["type"] == "authentication_error"
    body = {"model": TINY_ID, "input": "hi", "max_output_tokens": 1}
    refused = await post(server, "/v1/responses", body, {"Authorization": "Bearer sk-reader"})
    assert refused.status == 403 and refused.json()["error"]["type"] == "permission_error"
    assert (await post(server, "/v1/responses", body, {"Authorization": "Bearer sk-writer"})).status == 200
    background = await post(server, "/v1/responses", {**body, "background": True},
                            {"Authorization": "Bearer sk-writer"})
    assert background.status == 403 and "tasks:write" in background.json()["error"]["message"]


async def test_any_bearer_on_loopback_without_tokens(server):
    reply = await server.request("GET", "/v1/models", headers={"Authorization": "Bearer sk-whatever"})
    assert reply.status == 200 and reply.json()["data"][0]["id"] == TINY_ID


async def test_a_background_stream_replays_from_zero_and_resumes(server):
    reply = await post(server, "/v1/responses", {"model": TINY_ID, "input": "Tell me a story.", "background": True,
                                                 "stream": True, "max_output_tokens": 4, "temperature": 0})
    live = check_responses_stream(reply.body)
    response_id = live[0]["response"]["id"]
    assert live[0]["response"]["background"] is True
    replayed = check_responses_stream((await server.request("GET", f"/v1/responses/{response_id}?stream=true")).body)
    assert replayed == live
    resumed = parse_sse((await server.request("GET", f"/v1/responses/{response_id}?stream=true&starting_after=5")).body)
    assert [event.data for event in resumed] == live[6:]
    bad = await server.request("GET", f"/v1/responses/{response_id}?stream=true&starting_after=x")
    assert bad.status == 400 and bad.json()["error"]["param"] == "starting_after"


async def test_a_background_stream_whose_end_cannot_be_committed_is_cut(server, monkeypatch):
    """As the LMSP face's followers (test_tasks.py): a cut, never a clean end without
    `response.completed` or `response.failed`, which the SDK would take for the end."""
    gate = gated(server.service.registry.get(TINY_ID).model, monkeypatch)

    async def lost(*args, **kwargs):
        raise unavailable()

    monkeypatch.setattr(server.service.store, "finish_task", lost)
    with trio.fail_after(30):
        async with server.connection() as client:
            await client.send("POST", "/v1/responses", json_body={
                "model": TINY_ID, "input": "Tell me a story.", "background": True, "stream": True,
                "max_output_tokens": 4, "temperature": 0})
            assert (await client.read_head()).status == 200  # (it follows the task, held at the gate)
            gate.allow(math.inf)
            with pytest.raises(h11.RemoteProtocolError, match="incomplete chunked read"):
                [chunk async for chunk in client.read_chunks()]


async def test_a_dialect_response_is_an_lmsp_conversation_too(server):
    first = (await post(server, "/v1/responses", {"model": TINY_ID, "input": "My name is Ada.",
                                                  "max_output_tokens": 3, "temperature": 0})).json()
    follow_up = await server.responses({"model": TINY_ID, "previous_response_id": first["id"], "max_output_tokens": 2,
                                        "input": [{"role": "user", "content": "What is my name?"}]})
    assert follow_up.status == 200 and follow_up.json()["object"] == "response"
    assert "tool_choice" not in follow_up.json()  # the LMSP face answers with LMSP objects


async def test_unknown_and_unhonoured_parameters_name_themselves(server):
    for body, param in (
        ({"model": TINY_ID, "input": "hi", "max_tokens": 3}, "max_tokens"),  # a chat parameter
        ({"model": TINY_ID, "input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"model": TINY_ID, "input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"model": TINY_ID, "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": TINY_ID, "input": "hi", "parallel_tool_calls": "no",
          "tools": [{"type": "function", "name": "f"}]}, "parallel_tool_calls"),
        ({"model": TINY_ID, "input": "hi" * 2000}, "input"),
        ({"model": TINY_ID, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 10_000},
         "max_output_tokens"),
        ({"model": TINY_ID, "input": "hi", "background": True, "store": False}, "store"),
    ):
        reply = await post(server, "/v1/responses", body)
        assert reply.status == 400, (param, reply.body)
        assert reply.json()["error"]["param"] == param, (param, reply.body)


async def test_keep_alives_are_sse_comments(nursery, tiny_path, monkeypatch):
    from lmsp_min.http import Limits
    from test_openai_sdk import paced

    server = await start_server(nursery, await make_service([tiny_path], limits=Limits(stream_keepalive=0.01)))
    paced(server.service.registry.get(TINY_ID).model, monkeypatch, 0.05)
    for path, body in (("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        reply = await post(server, path, {"model": TINY_ID, "stream": True, **body})
        assert b"\n\n: keep-alive\n\n" in reply.body, path
        if path == "/v1/responses":
            assert check_responses_stream(reply.body)[-1]["type"] == "response.incomplete"
        else:
            assert chat_data(reply.body)[-1] == "[DONE]"


async def test_a_reasoning_model_streams_its_thought_apart(nursery, tmp_path):
    """D4: a template that opens <think>: a reasoning item with its summary events; in chat,
    `reasoning_content` deltas and no content."""
    from tiny import SMOLLM2_TOKENIZER, load_tokenizer_meta, write_tiny_model

    meta = load_tokenizer_meta(SMOLLM2_TOKENIZER)
    meta["tokenizer.chat_template"] += "{% if add_generation_prompt %}<think>\n{% endif %}"
    path = write_tiny_model(tmp_path / "think-chat-q8_0.gguf", "llama", tokenizer_meta=meta)
    server = await start_server(nursery, await make_service([path]))
    model = (await server.request("GET", "/v1/models")).json()["data"][0]["id"]
    reply = await post(server, "/v1/responses", {"model": model, "input": ASK, "stream": True, "temperature": 0,
                                                 "max_output_tokens": 6})
    data = check_responses_stream(reply.body)
    kinds = [d["type"] for d in data]
    assert kinds[2:4] == ["response.output_item.added", "response.reasoning_summary_part.added"]
    assert data[2]["item"]["type"] == "reasoning" and "response.reasoning_summary_text.delta" in kinds
    thought = "".join(d["delta"] for d in data if d["type"] == "response.reasoning_summary_text.delta")
    assert data[-1]["response"]["output"][0]["summary"] == [{"type": "summary_text", "text": thought}]
    reply = await post(server, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": ASK}],
                                                        "stream": True, "temperature": 0, "max_tokens": 6})
    deltas = [c["choices"][0]["delta"] for c in chat_data(reply.body)[1:-2]]
    assert "".join(d["reasoning_content"] for d in deltas) == thought and not any("content" in d for d in deltas)
    sync = (await post(server, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": ASK}],
                                                        "temperature": 0, "max_tokens": 6})).json()
    assert sync["choices"][0]["message"]["reasoning_content"] == thought
    assert sync["choices"][0]["message"]["content"] == ""


async def test_a_response_is_its_principals_alone(nursery, tiny_path, tmp_path):
    scopes = ["models:read", "responses:write", "responses:read", "tasks:write", "tasks:read"]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"token": "sk-ann", "principal": "ann", "scopes": scopes},
                                  {"token": "sk-bob", "principal": "bob", "scopes": scopes}]))
    server = await start_server(nursery, await make_service([tiny_path], tokens_file=tokens, data_dir=tmp_path / "d"))
    ann, bob = {"Authorization": "Bearer sk-ann"}, {"Authorization": "Bearer sk-bob"}
    body = {"model": TINY_ID, "input": "hi", "max_output_tokens": 2}
    stored = (await post(server, "/v1/responses", body, ann)).json()
    background = (await post(server, "/v1/responses", {"model": TINY_ID, "input": "hi", "max_output_tokens": 2,
                                                       "background": True}, ann)).json()
    for response_id in (stored["id"], background["id"]):
        for method, path in (("GET", ""), ("GET", "?stream=true"), ("DELETE", ""), ("GET", "/input_items"),
                             ("POST", "/cancel")):
            reply = await server.request(method, f"/v1/responses/{response_id}{path}", headers=bob)
            assert reply.status == 404 and reply.json()["error"]["code"] == "response_not_found", (method, path)
        assert (await server.request("GET", f"/v1/responses/{response_id}", headers=ann)).status == 200
    follow_up = await post(server, "/v1/responses", {"model": TINY_ID, "input": "and?", "max_output_tokens": 2,
                                                     "previous_response_id": stored["id"]}, bob)
    assert follow_up.status == 404 and follow_up.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions"])
async def test_a_stream_the_client_leaves_stops_and_a_stored_one_is_kept(server, path):
    """D4 on the dialect: generation stops; a Responses stream, stored by default, is kept
    `cancelled` with what was generated (its client had the id from response.created)."""
    model = server.service.registry.get(TINY_ID).model
    steps_before = model.steps
    handled = sum(f"POST {path}" in line for line in server.service.log_lines)
    body = ({"input": "Tell me a story.", "max_output_tokens": 400} if path == "/v1/responses"
            else {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 400})
    async with server.connection() as client:
        await client.send("POST", path, json_body={"model": TINY_ID, "stream": True, "temperature": 0, **body})
        assert (await client.read_head()).status == 200
        seen = b""
        async for chunk in client.read_chunks():
            seen += chunk
            if seen.count(b'"delta"') + seen.count(b'"content":"') >= 3 and seen.endswith(b"\n\n"):
                break
    await wait_until(lambda: sum(f"POST {path}" in line for line in server.service.log_lines) > handled,
                     "the request logged")
    assert "client disconnected" in next(line for line in reversed(server.service.log_lines) if path in line)
    assert model.steps - steps_before < 400
    if path == "/v1/responses":
        events = parse_sse(seen)
        streamed = "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta")
        stored = (await server.request("GET", f"/v1/responses/{events[0].data['response']['id']}")).json()
        assert stored["status"] == "cancelled" and stored["output"][0]["content"][0]["text"].startswith(streamed)
        assert 2 <= stored["usage"]["output_tokens"] < 400

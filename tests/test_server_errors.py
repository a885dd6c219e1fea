"""Every row of D1's error table that POST /responses and the models routes can produce.

Each error must be an application/problem+json document with type
urn:lmsp:error:<code>, title, status, detail, code (and param where a field is
at fault), carry LMSP-Version, and leave the connection usable when the
request could be read.
"""

import json

import pytest
import trio

from server_harness import parse_sse, server, tiny_path  # noqa: F401
from waiting import wait_until

TINY_ID = "tiny:chat-q8_0"
USER = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]


def body(**fields) -> dict:
    return {"model": TINY_ID, "input": USER, "max_output_tokens": 2, **fields}


def assert_problem(reply, status: int, code: str, param: str | None = None) -> dict:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"] == "application/problem+json"
    assert reply.headers["lmsp-version"] == "1.0"
    doc = reply.json()
    assert doc["type"] == f"urn:lmsp:error:{code}"
    assert doc["code"] == code and doc["status"] == status
    assert isinstance(doc["title"], str) and isinstance(doc["detail"], str) and doc["detail"]
    assert set(doc) <= {"type", "title", "status", "detail", "code", "param"}
    if param is not None:
        assert doc.get("param") == param, doc
    return doc


async def post_raw(server, payload: bytes, content_type: str | None = "application/json", headers=None):
    all_headers = dict(headers or {})
    if content_type is not None:
        all_headers["Content-Type"] = content_type
    return await server.request("POST", "/lmsp/v1/responses", body=payload, headers=all_headers)


# -- 400 invalid_request ---------------------------------------------------------------


@pytest.mark.parametrize("payload", [b"{", b"", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"model": NaN}',
                                     b'{"model": "m", "input": [{"role": "user", "content": "\\ud800"}]}',
                                     b"[" * 100_000])
async def test_malformed_json(server, payload):
    assert_problem(await post_raw(server, payload), 400, "invalid_request")


@pytest.mark.parametrize("number", [b"1e400", b"-1" + b"0" * 400])
async def test_a_number_past_a_doubles_range_is_refused(server, number):
    # 1e400 would read as inf and be written back into a schema's output as Infinity;
    # a 400-digit integer made the schema's checks overflow (a 500)
    schema = b'{"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [' + number + b']}}}'
    payload = b'{"model": "' + TINY_ID.encode() + b'", "input": "x", "response_format": ' + schema + b'}'
    reply = await post_raw(server, payload)
    assert_problem(reply, 400, "invalid_request")
    assert "too large for a 64-bit float" in reply.json()["detail"]


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 5}, "max_tokens"),  # a typo is not ignored
    ({"instructions": "be brief"}, "instructions"),
    ({"model": 7}, "model"),
    ({"model": ""}, "model"),
    ({"input": "hello"}, "input"),
    ({"input": []}, "input"),
    ({"input": [42]}, "input[0]"),
    ({"input": [{"role": "user", "content": "x"}] * 4097}, "input"),  # D9: bounded input items
    ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "input[0].content[0].text"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{nope"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[" * 10**5 + "]" * 10**5}]},
     "input[0].arguments"),  # nested too deeply to read
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": 5}]}, "input[0].output"),
    ({"extensions": {"lmsp-min": {"stop": ["x" * 257]}}}, "extensions.lmsp-min.stop[0]"),
    ({"extensions": {"lmsp-min": {"stop": ["}"]}},
      "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
     "extensions.lmsp-min.stop"),
    ({"stream": "yes"}, "stream"),
    ({"store": 1}, "store"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 2.5}, "max_output_tokens"),
    ({"max_output_tokens": True}, "max_output_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}, "tools"),  # D9
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools[1].name"),
    ({"tools": [{"type": "retrieval", "name": "f"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "none"}]}, "tools[0].parameters"),
    # a call's arguments are a JSON object: a schema of anything else could never be sent back
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": ["object", "integer"]}}]},
     "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"anyOf": [{"type": "integer"}]}}]},
     "tools[0].parameters"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name"),
    ({"previous_response_id": 12}, "previous_response_id"),
    ({"extensions": []}, "extensions"),
    ({"extensions": {"lmsp-min": {"top_p": 0}}}, "extensions.lmsp-min.top_p"),
    ({"extensions": {"lmsp-min": {"top_k": -1}}}, "extensions.lmsp-min.top_k"),
    ({"extensions": {"lmsp-min": {"min_p": 2}}}, "extensions.lmsp-min.min_p"),
    ({"extensions": {"lmsp-min": {"seed": "7"}}}, "extensions.lmsp-min.seed"),
    ({"extensions": {"lmsp-min": {"stop": [""]}}}, "extensions.lmsp-min.stop[0]"),
    ({"extensions": {"lmsp-min": {"stop": 5}}}, "extensions.lmsp-min.stop"),
    ({"extensions": {"lmsp-min": {"allowed_tools": ["f"]}}}, "extensions.lmsp-min.allowed_tools[0]"),  # no tools
    ({"tools": [{"type": "function", "name": "f"}], "extensions": {"lmsp-min": {"allowed_tools": []}}},
     "extensions.lmsp-min.allowed_tools"),
    ({"tools": [{"type": "function", "name": "f"}], "extensions": {"lmsp-min": {"allowed_tools": ["f", "f"]}}},
     "extensions.lmsp-min.allowed_tools[1]"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g"}],
      "tool_choice": {"type": "function", "name": "g"}, "extensions": {"lmsp-min": {"allowed_tools": ["f"]}}},
     "tool_choice.name"),
])
async def test_invalid_fields_name_their_param(server, fields, param):
    assert_problem(await server.responses(body(**fields)), 400, "invalid_request", param)


async def test_missing_required_fields(server):
    assert_problem(await server.responses({"input": USER}), 400, "invalid_request", "model")
    assert_problem(await server.responses({"model": TINY_ID}), 400, "invalid_request", "input")


@pytest.mark.parametrize("kind", ["input_image", "input_audio", "input_file"])
async def test_reserved_content_types_are_named(server, kind):
    message = {"type": "message", "role": "user", "content": [{"type": kind, "url": "x"}]}
    doc = assert_problem(await server.responses(body(input=[message])), 400, "invalid_request",
                         "input[0].content[0].type")
    assert kind in doc["detail"]


async def test_unknown_extension_keys_are_ignored(server):
    extensions = {"lmsp-min": {"seed": 7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "stop": ["\n\n"],
                               "future_knob": 1},
                  "someone-else": {"anything": True}}
    reply = await server.responses(body(extensions=extensions))
    assert reply.status == 200, reply.body


# -- 400 unsupported_capability, context_length_exceeded, unsupported_version ---------------


async def test_tools_need_the_tools_capability(server, monkeypatch):
    monkeypatch.setattr(server.service.registry.get(TINY_ID), "capabilities", ("structured_output",))
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    assert_problem(await server.responses(body(tools=tools)), 400, "unsupported_capability", "tools")
    listed = (await server.request("GET", f"/lmsp/v1/models/{TINY_ID}")).json()["capabilities"]
    assert "tools" not in listed  # what is refused is what the listing says


async def test_structured_output_needs_its_capability(server, monkeypatch):
    monkeypatch.setattr(server.service.registry.get(TINY_ID), "capabilities", ("tools",))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert_problem(await server.responses(body(response_format=fmt)), 400, "unsupported_capability",
                   "response_format")


async def test_previous_response_id_needs_conversations(server):
    assert_problem(await server.responses(body(previous_response_id="resp_123")), 400,
                   "unsupported_capability", "previous_response_id")


async def test_store_is_ignored_without_conversations(server):
    assert (await server.responses(body(store=True))).status == 200


async def test_context_length_exceeded_before_any_generation(server):
    model = server.service.registry.get(TINY_ID).model
    steps = model.steps
    too_long = await server.responses(body(max_output_tokens=100_000))
    assert_problem(too_long, 400, "context_length_exceeded")
    assert too_long.json()["param"] == "max_output_tokens"  # the input fits: the bound is what to change
    huge_input = [{"role": "user", "content": "lorem ipsum " * 600}]  # > 512 tokens
    too_much = await server.responses(body(input=huge_input, max_output_tokens=None))
    assert_problem(too_much, 400, "context_length_exceeded")
    assert too_much.json()["param"] == "input"
    streamed = await server.responses(body(max_output_tokens=100_000, stream=True))
    assert_problem(streamed, 400, "context_length_exceeded")  # a problem, not an event stream
    assert model.steps == steps


@pytest.mark.parametrize("version, status", [("1.0", 200), ("1", 200), ("1.7", 200), ("1.0.1", 200), ("2.0", 400),
                                             ("0.9", 400), ("banana", 400), ("1.0, 1.0", 200),
                                             ("1.0, 2.0", 400), ("1.0,", 400)])
async def test_lmsp_version_header(server, version, status):
    reply = await server.request("GET", "/lmsp/v1/models", headers={"LMSP-Version": version})
    assert reply.status == status
    if status == 400:
        assert_problem(reply, 400, "unsupported_version")


# -- 404, 405, 415 -------------------------------------------------------------------------


async def test_unknown_model(server):
    assert_problem(await server.responses(body(model="nope:7b")), 404, "model_not_found", "model")
    assert_problem(await server.request("GET", "/lmsp/v1/models/nope:7b"), 404, "model_not_found")


@pytest.mark.parametrize("path", ["/", "/lmsp/v1", "/lmsp/v1/model", "/lmsp/v2/models", "/lmsp/v1/models/"])
async def test_unknown_route(server, path):
    assert_problem(await server.request("GET", path), 404, "not_found")


@pytest.mark.parametrize("method, path, allow", [
    ("DELETE", "/lmsp/v1/models", "GET"),
    ("POST", "/lmsp/v1/models/tiny:chat-q8_0", "GET"),
    ("GET", "/lmsp/v1/responses", "POST"),
    ("PUT", "/lmsp/v1/responses", "POST"),
    # the routes of tasks and stored responses (D3, D6)
    ("GET", "/lmsp/v1/tasks", "POST"),
    ("PUT", "/lmsp/v1/tasks/task_x", "DELETE, GET, HEAD"),
    ("POST", "/lmsp/v1/tasks/task_x/events", "GET, HEAD"),
    ("GET", "/lmsp/v1/tasks/task_x/cancel", "POST"),
    ("POST", "/lmsp/v1/responses/resp_x", "DELETE, GET, HEAD"),
])
async def test_wrong_method_is_405_with_allow(server, method, path, allow):
    reply = await server.request(method, path)
    assert_problem(reply, 405, "method_not_allowed")
    assert allow in reply.headers["allow"] and method not in reply.headers["allow"].split(", ")


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_body_must_be_json(server, content_type):
    assert_problem(await post_raw(server, b"{}", content_type), 415, "unsupported_media_type")


async def test_json_with_charset_is_fine(server):
    reply = await post_raw(server, json.dumps(body()).encode(), "application/json; charset=utf-8")
    assert reply.status == 200


# -- 429, 500 ------------------------------------------------------------------------------


async def test_generation_failure_is_500_generation_failed(server, monkeypatch):
    model = server.service.registry.get(TINY_ID).model

    async def broken(prepared):
        raise RuntimeError("/secret/path exploded")
        yield

    monkeypatch.setattr(model, "generate_chat", broken)
    doc = assert_problem(await server.responses(body()), 500, "generation_failed")
    assert "/secret" not in doc["detail"]


async def test_a_full_queue_refuses_a_stream_before_it_starts(server, monkeypatch):
    monkeypatch.setattr(server.service.registry.get(TINY_ID), "queue_depth", 0)
    reply = await server.responses(body(stream=True))
    assert_problem(reply, 429, "rate_limited")
    assert reply.headers["retry-after"] == "1"


async def test_a_burst_past_the_queue_gets_429_at_once(server, monkeypatch):
    """Concurrent requests are counted when admitted: past the bound a 429, never a 200
    whose response fails later (D9), even while the scheduler's first step holds the
    batch and every admitted request waits in its queue."""
    import threading

    entry = server.service.registry.get(TINY_ID)
    monkeypatch.setattr(entry.model.scheduler, "max_batch", 2)
    monkeypatch.setattr(entry, "queue_depth", 3)  # (one principal: all of it but the reserve, 2)
    go, step = threading.Event(), entry.model.step

    def held_step(*args, **kwargs):  # the worker thread's steps wait until the test says so
        go.wait(20)
        return step(*args, **kwargs)

    monkeypatch.setattr(entry.model, "step", held_step)
    replies = []

    async def post() -> None:
        replies.append(await server.request("POST", "/lmsp/v1/responses", json_body=body(stream=True)))

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(post)
        await wait_until(lambda: len(replies) == 2, "two refused")  # the two past the bound, while none has run
        assert entry.admitted == 2
        go.set()
    refused = [reply for reply in replies if reply.status == 429]
    assert len(refused) == 2 and all(reply.json()["code"] == "rate_limited" for reply in refused)
    for reply in replies:
        if reply.status != 429:
            assert reply.status == 200
            assert parse_sse(reply.body)[-1].event in ("response.completed", "response.incomplete")
    assert entry.admitted == 0


async def test_a_byte_order_mark_is_ignored(server):
    reply = await post_raw(server, b"\xef\xbb\xbf" + json.dumps(body()).encode())
    assert reply.status == 200

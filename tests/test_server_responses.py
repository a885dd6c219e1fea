"""POST /lmsp/v1/responses end to end: sync objects, event streams, stop sequences, cancellation."""

import json
import time
from contextlib import aclosing

import pytest
import trio
import trio.testing

from lmsp_min.http import Limits
from server_harness import Server, make_service, parse_sse, server, start_server, tiny_path  # noqa: F401
from waiting import wait_until

TINY_ID = "tiny:chat-q8_0"


def request(text: str = "Tell me a story.", **fields) -> dict:
    return {"model": TINY_ID, "input": [{"type": "message", "role": "user",
                                        "content": [{"type": "input_text", "text": text}]}],
            "temperature": 0, **fields}


def message_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


async def stream(server: Server, body: dict):
    reply = await server.responses({**body, "stream": True})
    assert reply.status == 200 and reply.headers["content-type"] == "text/event-stream"
    return parse_sse(reply.body)


def check_stream(events) -> str:
    """The rules of 6.3 / 6.4 / D4; returns the streamed message text."""
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert events[0].event == "response.created" and events[0].data["status"] == "in_progress"
    final = events[-1]
    assert final.event in ("response.completed", "response.incomplete")
    assert not any(e.event in ("response.completed", "response.incomplete", "response.failed",
                               "response.cancelled", "error") for e in events[:-1])
    response_id = events[0].data["response_id"]
    assert response_id.startswith("resp_") and all(e.data["response_id"] == response_id for e in events)
    open_items = {}
    texts = {}
    for e in events[1:-1]:
        if e.event == "response.output_item.added":
            item = e.data["item"]
            open_items[item["id"]] = e.data["output_index"]
            if item["type"] == "message":
                assert item["content"] == [] and item["role"] == "assistant"
                texts[item["id"]] = ""
        elif e.event == "response.output_text.delta":
            assert e.data["item_id"] in open_items and e.data["delta"]
            e.data["delta"].encode("utf-8")  # a complete string: no lone surrogate
            texts[e.data["item_id"]] += e.data["delta"]
        elif e.event == "response.output_item.done":
            item = e.data["item"]
            assert open_items.pop(item["id"]) == e.data["output_index"]
            if item["type"] == "message":
                assert item["content"][0]["text"] == texts[item["id"]]
    assert not open_items
    usage = final.data["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    return "".join(texts.values())


async def test_sync_response_object(server):
    reply = await server.responses(request(max_output_tokens=5))
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    response = reply.json()
    assert set(response) == {"id", "object", "created_at", "status", "model", "output", "usage", "error",
                             "incomplete_details"}
    assert response["id"].startswith("resp_") and response["object"] == "response"
    assert response["model"] == TINY_ID and isinstance(response["created_at"], int)
    assert abs(response["created_at"] - time.time()) < 60  # seconds since the epoch (not milliseconds)
    assert response["status"] in ("completed", "incomplete") and response["error"] is None
    (item,) = response["output"]
    assert set(item) == {"id", "type", "role", "content"} and item["id"].startswith("msg_")
    assert item["content"][0]["type"] == "output_text"
    usage = response["usage"]
    assert 0 < usage["output_tokens"] <= 5 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    await wait_until(lambda: _handled(server), "the request logged")  # the line is written once the response is sent
    line = server.service.log_lines[-1]  # the access log: never the prompt
    assert line.startswith("POST /lmsp/v1/responses 200 ") and "ms" in line
    assert f"tokens={usage['input_tokens']}+{usage['output_tokens']}" in line and "story" not in line


async def test_max_output_tokens_gives_incomplete(server):
    response = (await server.responses(request(max_output_tokens=3))).json()
    # the tiny model is seeded and greedy: it always writes past 3 tokens here
    assert response["usage"]["output_tokens"] == 3
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_without_max_output_tokens_generation_stops_at_the_window(server):
    # D4: no max_output_tokens, no refusal: the response fills the window and ends
    # incomplete, as at a token limit (a long input leaves a few dozen tokens to write)
    window = (await server.request("GET", f"/lmsp/v1/models/{TINY_ID}")).json()["context_window"]
    body = request("Tell me a story. " * 90)
    response = (await server.responses(body)).json()
    assert response["status"] == "incomplete", response
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["total_tokens"] == window
    events = await stream(server, body)
    assert events[-1].event == "response.incomplete"
    assert events[-1].data["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_stream_events_and_the_sync_response_agree(server):
    body = request(max_output_tokens=12)
    events = await stream(server, body)
    streamed = check_stream(events)
    response = (await server.responses(body)).json()  # greedy: the same text
    assert streamed == message_text(response)
    counts = ("input_tokens", "output_tokens", "total_tokens")
    assert [events[-1].data["usage"][k] for k in counts] == [response["usage"][k] for k in counts]
    assert events[-1].event == f"response.{response['status']}"


async def test_a_repeated_prompt_reports_its_cached_tokens(server):
    body = request(max_output_tokens=4)
    first = (await server.responses(body)).json()["usage"]
    second = (await server.responses(body)).json()["usage"]
    assert 0 <= first["input_tokens_details"]["cached_tokens"] < first["input_tokens"]
    assert 0 < second["input_tokens_details"]["cached_tokens"] < second["input_tokens"]


async def test_greedy_is_deterministic_and_ids_are_unique(server):
    first = (await server.responses(request(max_output_tokens=8))).json()
    second = (await server.responses(request(max_output_tokens=8))).json()
    assert message_text(first) == message_text(second)
    assert first["id"] != second["id"] and first["output"][0]["id"] != second["output"][0]["id"]


async def test_seeded_sampling_is_reproducible(server):
    body = request(max_output_tokens=8, temperature=1.0, extensions={"lmsp-min": {"seed": 1234}})
    first = (await server.responses(body)).json()
    second = (await server.responses(body)).json()
    assert message_text(first) == message_text(second)


async def test_stop_sequences_never_leak(server):
    full = message_text((await server.responses(request(max_output_tokens=24))).json())
    assert len(full) >= 8  # the seeded tiny model's greedy answer: long enough to cut
    stop = full[len(full) // 2: len(full) // 2 + 3]
    body = request(max_output_tokens=24, extensions={"lmsp-min": {"stop": [stop]}})
    stopped = message_text((await server.responses(body)).json())
    assert stop not in stopped and full.startswith(stopped)
    assert stopped == full[:full.index(stop)]
    events = await stream(server, body)
    assert check_stream(events) == stopped
    assert events[-1].event == "response.completed"


async def test_plain_string_content_is_accepted(server):
    body = {"model": TINY_ID, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2}
    assert (await server.responses(body)).status == 200


async def test_tool_history_is_rendered(server):
    body = request(max_output_tokens=2, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature_c":17}'},
    ])
    assert (await server.responses(body)).status == 200


async def test_streaming_generation_failure_ends_with_response_failed(server, monkeypatch):
    from engine.api import TextDelta

    model = server.service.registry.get(TINY_ID).model

    async def breaks_midway(prepared):
        yield TextDelta("partial")
        raise RuntimeError("boom")

    monkeypatch.setattr(model, "generate_chat", breaks_midway)
    reply = await server.responses({**request(), "stream": True})
    assert reply.status == 200
    events = parse_sse(reply.body)
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert events[-1].event == "response.failed"
    assert events[-1].data["status"] == "failed" and events[-1].data["error"]["code"] == "generation_failed"


async def test_a_stream_that_cannot_go_on_ends_with_an_error_event(nursery, tiny_path, tmp_path, monkeypatch):
    # 6.3's `error` event: a problem object in `error`, after which the stream is closed
    server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path / "data"))

    async def fails(*args, **kwargs):
        raise OSError(28, "No space left on device", "/secret/path/lmsp.db")

    monkeypatch.setattr(server.service.store, "put_response", fails)
    reply = await server.responses({**request(max_output_tokens=3), "stream": True, "store": True})
    assert reply.status == 200 and reply.headers["content-type"] == "text/event-stream"
    events = parse_sse(reply.body)  # (the whole body: the stream was closed)
    ids = [e.id for e in events]
    assert ids == sorted(set(ids)) and ids[0] == 1
    assert events[-1].event == "error" and set(events[-1].data) == {"error"}
    problem = events[-1].data["error"]
    assert problem["code"] == "internal_error" and problem["status"] == 500
    assert problem["type"] == "urn:lmsp:error:internal_error" and "/secret" not in problem["detail"]
    assert not any(e.event in ("response.completed", "response.incomplete", "response.failed",
                               "response.cancelled") for e in events)
    assert (await server.responses(request(max_output_tokens=1))).status == 200  # the server goes on


async def test_a_stream_whose_store_is_away_ends_with_a_model_unavailable_error_event(nursery, tiny_path,
                                                                                    tmp_path, monkeypatch):
    """The store's own 503 (a database that cannot be reached) is said as itself, not as
    an internal error: a client retries a model_unavailable."""
    from lmsp_min.problems import unavailable

    server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path / "data"))

    async def away(*args, **kwargs):
        raise unavailable()

    monkeypatch.setattr(server.service.store, "put_response", away)
    events = parse_sse((await server.responses({**request(max_output_tokens=3), "stream": True,
                                                 "store": True})).body)
    assert events[-1].event == "error"
    problem = events[-1].data["error"]
    assert problem["code"] == "model_unavailable" and problem["status"] == 503


async def test_a_failed_stream_is_stored_like_a_failed_task(nursery, tiny_path, tmp_path, monkeypatch):
    server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path / "data"))
    model = await server.service.registry.get(TINY_ID).load()
    generate_chat = model.generate_chat

    async def breaks_midway(prepared):
        async with aclosing(generate_chat(prepared)) as events:
            for _ in range(3):
                yield await events.__anext__()
        raise RuntimeError("boom")

    monkeypatch.setattr(model, "generate_chat", breaks_midway)
    events = parse_sse((await server.responses({**request(), "stream": True, "store": True})).body)
    assert events[-1].event == "response.failed" and "usage" not in events[-1].data  # (6.3)
    stored = await server.request("GET", f"/lmsp/v1/responses/{events[0].data['response_id']}")
    assert stored.status == 200 and stored.json()["status"] == "failed"
    # 6.2: usage is what was consumed until the failure (each delta cost at least one token)
    usage = stored.json()["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] >= 3
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


async def test_a_stream_the_service_stops_is_stored_with_what_it_consumed(nursery, tiny_path, tmp_path,
                                                                         monkeypatch):
    service = await make_service([tiny_path], data_dir=tmp_path / "data")
    server = await start_server(nursery, service)
    model = await service.registry.get(TINY_ID).load()
    generate_chat = model.generate_chat

    async def stalls_after_three(prepared):
        async with aclosing(generate_chat(prepared)) as events:
            for _ in range(3):
                yield await events.__anext__()
            await trio.sleep_forever()

    monkeypatch.setattr(model, "generate_chat", stalls_after_three)
    async with server.connection() as client:
        await client.send("POST", "/lmsp/v1/responses", json_body={**request(), "stream": True, "store": True})
        assert (await client.read_head()).status == 200
        body = b""
        with trio.fail_after(10):
            async for chunk in client.read_chunks():
                body += chunk
                if body.count(b"event: response.output_text.delta") == 3:
                    nursery.start_soon(service.drain, 0.1)
    events = parse_sse(body)
    assert events[-1].event == "response.failed" and events[-1].data["error"]["code"] == "model_unavailable"
    stored = await service.store.get_response(events[0].data["response_id"], "local")
    usage = json.loads(stored.body)["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] >= 3


# -- cancellation: counted in engine steps, not timed ------------------------------------------


def _handled(server) -> int:
    return sum("POST /lmsp/v1/responses" in line for line in server.service.log_lines)


def _engine_idle(model):
    """Whether the model's scheduler has stopped stepping: no generation is running."""
    return lambda: not model.scheduler.running


async def test_stream_client_disconnect_stops_generation(server):
    model = server.service.registry.get(TINY_ID).model
    done_before = _handled(server)
    steps_before = model.steps
    async with server.connection() as client:
        await client.send("POST", "/lmsp/v1/responses",
                          json_body=request(max_output_tokens=400, stream=True))
        head = await client.read_head()
        assert head.status == 200
        seen = b""
        async for chunk in client.read_chunks():
            seen += chunk
            if b"response.output_text.delta" in seen:
                break
    await wait_until(lambda: _handled(server) > done_before, "the request logged")  # the handler has been cancelled
    assert "client disconnected" in server.service.log_lines[-1]
    steps_at_cancel = model.steps
    await wait_until(_engine_idle(model), "the engine idle")
    assert model.steps - steps_at_cancel <= 2  # the step in flight, at most one more
    assert model.steps - steps_before < 400


@pytest.mark.parametrize("store", [True, False])
async def test_a_stored_stream_the_client_leaves_is_stored_cancelled(nursery, tiny_path, tmp_path, store):
    """The client has the response's id from response.created: with store: true it can
    fetch what was generated before it left (D4 still stops the generation)."""
    server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path / "data"))
    done_before = _handled(server)
    async with server.connection() as client:
        await client.send("POST", "/lmsp/v1/responses",
                          json_body=request(max_output_tokens=400, stream=True, store=store))
        assert (await client.read_head()).status == 200
        seen = b""
        async for chunk in client.read_chunks():
            seen += chunk
            if seen.count(b"event: response.output_text.delta") >= 2 and seen.endswith(b"\n\n"):
                break
    await wait_until(lambda: _handled(server) > done_before, "the request logged")
    events = parse_sse(seen)
    streamed = "".join(e.data["delta"] for e in events if e.event == "response.output_text.delta")
    stored = await server.request("GET", f"/lmsp/v1/responses/{events[0].data['response_id']}")
    if not store:
        assert stored.status == 404
        return
    assert stored.status == 200
    response = stored.json()
    assert response["status"] == "cancelled" and response["error"] is None
    assert message_text(response).startswith(streamed)
    usage = response["usage"]
    assert usage["input_tokens"] > 0 and 2 <= usage["output_tokens"] < 400


async def test_a_stored_stream_the_client_leaves_while_it_is_stored_is_stored(nursery, tiny_path, tmp_path,
                                                                             monkeypatch):
    """The client left while its finished response waited to be written (the store has one
    writer: a task's events may hold it): the write was cancelled, and the response lost."""
    service = await make_service([tiny_path], data_dir=tmp_path / "data")
    server = await start_server(nursery, service)
    done_before = _handled(server)
    put_response = service.store.put_response
    writing = trio.Event()

    async def waits_for_the_writer_once(*args):
        if not writing.is_set():
            writing.set()
            await trio.sleep_forever()  # (cancelled when the client leaves)
        await put_response(*args)

    monkeypatch.setattr(service.store, "put_response", waits_for_the_writer_once)
    async with server.connection() as client:
        await client.send("POST", "/lmsp/v1/responses", json_body=request(max_output_tokens=5, stream=True, store=True))
        assert (await client.read_head()).status == 200
        created = b""
        async for chunk in client.read_chunks():
            created += chunk
            if created.endswith(b"\n\n"):
                break
        with trio.fail_after(10):
            await writing.wait()
    await wait_until(lambda: _handled(server) > done_before, "the request logged")
    response_id = parse_sse(created)[0].data["response_id"]
    stored = await server.request("GET", f"/lmsp/v1/responses/{response_id}")
    assert stored.status == 200 and stored.json()["status"] in ("completed", "incomplete")  # as it ended
    assert 0 < stored.json()["usage"]["output_tokens"] <= 5


async def test_a_stored_stream_closed_mid_response_stops_generating_before_it_is_stored(tiny_path, tmp_path,
                                                                                       monkeypatch):
    """Closed at an event it yields (the HTTP layer closes the body when its client left while
    a write waited): the generation ends first, then the response is stored (D4: the engine,
    which does not wait for its reader, went on decoding while the store wrote)."""
    import types

    from lmsp_min import generation

    service = await make_service([tiny_path], data_dir=tmp_path / "data")
    model = await service.registry.get(TINY_ID).load()
    generate_chat = model.generate_chat
    ended = trio.Event()

    async def noting_its_end(prepared):
        try:
            async with aclosing(generate_chat(prepared)) as events:
                async for event in events:
                    yield event
        finally:
            ended.set()

    monkeypatch.setattr(model, "generate_chat", noting_its_end)
    put_response = service.store.put_response
    ended_when_stored = []

    async def noting_the_engine(*args):
        ended_when_stored.append(ended.is_set())
        await put_response(*args)

    monkeypatch.setattr(service.store, "put_response", noting_the_engine)
    prepared = await generation.prepare({**request(max_output_tokens=400), "stream": True, "store": True},
                                        "local", service)
    events = generation.response_events(prepared, types.SimpleNamespace(log_note=None), service)
    while (await events.__anext__()).name != "response.output_text.delta":
        pass
    await events.aclose()
    assert ended_when_stored == [True]
    stored = await service.store.get_response(prepared.run.id, "local")
    assert json.loads(stored.body)["status"] == "cancelled"


@pytest.mark.parametrize("pipelined", [0, 8])
async def test_sync_client_disconnect_stops_generation(server, pipelined):
    """Also when the client pipelined pieces of a next request before leaving: the
    reader keeps reading past them and sees the end."""
    model = server.service.registry.get(TINY_ID).model
    done_before = _handled(server)
    steps_before = model.steps
    async with server.connection() as client:
        await client.send("POST", "/lmsp/v1/responses", json_body=request(max_output_tokens=400))
        await wait_until(lambda: model.steps > steps_before + 2, "steps run")  # generating now
        for _ in range(pipelined):  # arriving as separate reads
            await client.stream.send_all(b"GET /lmsp/v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await trio.testing.wait_all_tasks_blocked()  # (the server has read it)
    await wait_until(lambda: _handled(server) > done_before, "the request logged")
    assert "client disconnected" in server.service.log_lines[-1]
    steps_at_cancel = model.steps
    await wait_until(_engine_idle(model), "the engine idle")
    assert model.steps - steps_at_cancel <= 2
    assert model.steps - steps_before < 400


# -- the real model --------------------------------------------------------------------------


@pytest.mark.slow
async def test_smollm2_answers(nursery, smollm2_path):
    server = await start_server(nursery, await make_service([smollm2_path]))
    model_id = (await server.request("GET", "/lmsp/v1/models")).json()["data"][0]["id"]
    assert model_id == "smollm2:135m-instruct-q4_1"
    body = {"model": model_id, "temperature": 0, "max_output_tokens": 24, "input": [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "What is the capital of France?"}]}]}
    response = (await server.responses(body)).json()
    assert "Paris" in message_text(response)
    events = await stream(server, body)
    assert check_stream(events) == message_text(response)


async def test_a_silent_stream_gets_keep_alive_comments(nursery, tiny_path, monkeypatch):
    from engine.api import Finished, TextDelta

    service = await make_service([tiny_path], limits=Limits(stream_keepalive=0.05))
    server = await start_server(nursery, service)
    model = service.registry.get(TINY_ID).model
    kept_alive = trio.Event()

    async def slow_start(prepared):
        await kept_alive.wait()  # a long prompt, a queue: nothing to send until a keep-alive came
        yield TextDelta("late")
        yield Finished("stop", prepared.input_tokens, 1)

    monkeypatch.setattr(model, "generate_chat", slow_start)
    body = b""
    with trio.fail_after(20):
        async with server.connection() as client:
            await client.send("POST", "/lmsp/v1/responses", json_body={**request(), "stream": True})
            assert (await client.read_head()).status == 200
            async for chunk in client.read_chunks():
                body += chunk
                if b"\n\n: keep-alive\n\n" in body:
                    kept_alive.set()
    assert kept_alive.is_set()
    events = parse_sse(body)
    assert check_stream(events) == "late"


async def test_a_client_that_stops_reading_is_dropped_and_its_generation_stopped(nursery, tiny_path,
                                                                                 monkeypatch):
    from engine.api import TextDelta

    service = await make_service([tiny_path], limits=Limits(write_timeout=0.3))
    server = await start_server(nursery, service)
    model = service.registry.get(TINY_ID).model
    closed = trio.Event()

    async def endless(prepared):
        try:
            while True:
                await trio.lowlevel.checkpoint()
                yield TextDelta("x" * 65536)
        finally:
            closed.set()

    monkeypatch.setattr(model, "generate_chat", endless)
    async with server.connection() as client:
        await client.send("POST", "/lmsp/v1/responses", json_body={**request(), "stream": True})
        with trio.fail_after(20):  # the client reads nothing at all
            await closed.wait()
    assert "client gone" in service.log_lines[-1] or "read nothing" in " ".join(service.log_lines)


async def test_concurrent_requests_are_all_answered(server):
    """More requests at once than the engine batches: every one answered, none mixed up."""
    results = []

    async def one(index: int):
        body = request(f"Request number {index}", max_output_tokens=4, stream=index % 2 == 0)
        if body["stream"]:
            events = await stream(server, body)
            check_stream(events)
            results.append(events[0].data["response_id"])
        else:
            reply = await server.responses(body)
            assert reply.status == 200
            results.append(reply.json()["id"])

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for index in range(12):
                nursery.start_soon(one, index)
    assert len(set(results)) == 12


# -- admission: released by whoever owns the response, never left to the garbage collector ---


@pytest.mark.parametrize("how", ["sync", "stream", "stream left at once", "stream left mid-way"])
async def test_every_response_releases_its_admission(server, how):
    """The model's admission count (what 429s past its queue) is back to zero after a
    response however it ended, with the garbage collector off."""
    import gc

    entry = server.service.registry.get(TINY_ID)
    body = request(max_output_tokens=4 if how in ("sync", "stream") else 400, stream=how != "sync")
    gc.disable()
    try:
        with trio.fail_after(20):
            async with server.connection() as client:
                await client.send("POST", "/lmsp/v1/responses", json_body=body)
                if how == "stream left mid-way":
                    assert (await client.read_head()).status == 200
                    async for chunk in client.read_chunks():
                        if b"output_text.delta" in chunk:
                            break
                elif how != "stream left at once":
                    assert (await client.read_reply()).status == 200
            await wait_until(lambda: entry.admitted == 0, "the admission released")
    finally:
        gc.enable()


async def test_lmsp_extensions_report_logprobs_on_the_deltas_and_the_message(server):
    ours = {"logprobs": 2, "frequency_penalty": 0.5, "presence_penalty": 0.1, "logit_bias": {"0": -100}}
    body = request(max_output_tokens=5, extensions={"lmsp-min": ours})
    events = await stream(server, body)
    text = check_stream(events)
    deltas = [e.data["logprobs"] for e in events if e.event == "response.output_text.delta"]
    done = [e.data["item"] for e in events if e.event == "response.output_item.done"][-1]
    entries = done["content"][0]["logprobs"]
    assert [entry for delta in deltas for entry in delta] == entries and len(entries) == 5
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 and entry["top_logprobs"][0]["logprob"]
               >= entry["top_logprobs"][1]["logprob"] for entry in entries)
    assert bytes(b for entry in entries for b in entry["bytes"]).decode("utf-8", "replace") == text
    response = (await server.responses(body)).json()
    again = response["output"][-1]["content"][0]["logprobs"]  # (the prompt from the prefix cache now: float32 apart)
    assert [e["token"] for e in again] == [e["token"] for e in entries]
    assert [e["logprob"] for e in again] == pytest.approx([e["logprob"] for e in entries], abs=1e-4)


@pytest.mark.parametrize("field, value, param", [
    ("logprobs", 21, "extensions.lmsp-min.logprobs"),
    ("logprobs", True, "extensions.lmsp-min.logprobs"),
    ("presence_penalty", -2.5, "extensions.lmsp-min.presence_penalty"),
    ("logit_bias", {"x": 1}, "extensions.lmsp-min.logit_bias.x"),
    ("logit_bias", {"5": 100.5}, "extensions.lmsp-min.logit_bias.5"),
    ("logit_bias", {"99999999": 1}, "extensions.lmsp-min.logit_bias.99999999"),
])
async def test_lmsp_sampling_extensions_out_of_range_are_400s_naming_them(server, field, value, param):
    reply = await server.responses(request(extensions={"lmsp-min": {field: value}}))
    assert reply.status == 400 and reply.json()["param"] == param

"""The OpenAI dialect (/v1) driven by the real openai SDK, sync and async, over sockets.

The SDK is the oracle: what it parses (event classes, `responses.stream()`'s snapshot,
`get_final_response()`, `responses.parse` / `chat.completions.parse`, its exception
classes) is what an OpenAI-compatible server must give it. The server runs in the test's
trio loop; each client runs in a worker thread (the async one in an asyncio loop there:
the SDK's anyio needs a newer trio than the server's), bounded by the SDK's timeout.
"""

import asyncio
import datetime
import json
import uuid
from contextlib import aclosing
from typing import Annotated, Literal, Optional

import jsonschema
import openai
import pydantic
import pytest
import trio

from server_harness import make_service, start_server, tiny_path  # noqa: F401
from test_tasks import gated

TINY_ID = "tiny:chat-q8_0"
ASK = "What is the weather in Hangzhou?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
                          "required": ["city"], "additionalProperties": False}}


class Verdict(pydantic.BaseModel):
    ok: bool


@pytest.fixture
async def server(nursery, tiny_path, tmp_path):
    """The tiny model, storing responses (previous_response_id, background) in tmp_path."""
    return await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path / "data"))


def base_url(server) -> str:
    return f"http://{server.host}:{server.port}/v1"


async def sync_sdk(server, work):
    """work(client) with a sync OpenAI client, in a worker thread."""
    def run():
        with openai.OpenAI(base_url=base_url(server), api_key="sk-anything", max_retries=0, timeout=60) as client:
            return work(client)
    return await trio.to_thread.run_sync(run)


async def async_sdk(server, work):
    """await work(client) with an AsyncOpenAI client, in an asyncio loop in a worker thread."""
    async def run():
        async with openai.AsyncOpenAI(base_url=base_url(server), api_key="sk-anything", max_retries=0,
                                      timeout=60) as client:
            return await work(client)
    return await trio.to_thread.run_sync(asyncio.run, run())


async def polled_until_done(client, response_id: str, seconds: float = 30):
    """The background response once done, retrieved as a client polls it (in the SDK's
    asyncio loop, where no trio wait runs); the test fails after `seconds`."""
    deadline = asyncio.get_running_loop().time() + seconds
    while (response := await client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert asyncio.get_running_loop().time() < deadline, f"{response_id} not done within {seconds} s"
        await asyncio.sleep(0.02)  # (a client's poll, in the SDK's asyncio loop: no trio wait runs there)
    return response


def paced(model, monkeypatch, seconds: float) -> None:
    """Make the model's chat events come at most one per `seconds` (the same events)."""
    generate_chat = model.generate_chat

    async def slower(prepared):
        async with aclosing(generate_chat(prepared)) as events:
            async for event in events:
                await trio.sleep(seconds)  # (a model's pace: the scenario; no assertion waits on it)
                yield event

    monkeypatch.setattr(model, "generate_chat", slower)


# -- models and errors --------------------------------------------------------------------


async def test_models_are_listed_and_found(server):
    def work(client):
        listed = client.models.list()
        found = client.models.retrieve(TINY_ID)
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("nope")
        return listed, found, missing.value

    listed, found, missing = await sync_sdk(server, work)
    assert [model.id for model in listed.data] == [TINY_ID]
    assert found.id == TINY_ID and found.object == "model" and found.owned_by == "local"
    assert isinstance(found.created, int)
    assert missing.status_code == 404 and missing.code == "model_not_found" and "nope" in missing.message
    assert found._request_id.startswith("req_") and missing.request_id.startswith("req_")


async def test_errors_are_the_sdk_exceptions_with_the_param(server):
    async def work(client):
        errors = {}
        for name, kwargs in {
            "model": {"model": "nope", "input": "hi"},
            "top_logprobs": {"model": TINY_ID, "input": "hi", "top_logprobs": 21},  # (0 to 20)
            "input[0].content[1].type": {"model": TINY_ID, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
            "temperature": {"model": TINY_ID, "input": "hi", "temperature": 3},
            "bogus": {"model": TINY_ID, "input": "hi", "extra_body": {"bogus": 1}},
            "previous_response_id": {"model": TINY_ID, "input": "hi", "previous_response_id": "resp_nope"},
        }.items():
            with pytest.raises(openai.APIStatusError) as caught:
                await client.responses.create(**kwargs)
            errors[name] = caught.value
        return errors

    errors = await async_sdk(server, work)
    assert isinstance(errors["model"], openai.NotFoundError) and errors["model"].param == "model"
    assert isinstance(errors["previous_response_id"], openai.NotFoundError)
    for name in ("top_logprobs", "input[0].content[1].type", "temperature", "bogus"):
        assert isinstance(errors[name], openai.BadRequestError), name
        assert errors[name].param == name and errors[name].body["type"] == "invalid_request_error"
    assert "'temperature'" in errors["temperature"].message


async def test_a_wrong_token_is_an_authentication_error(nursery, tiny_path, tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"token": "sk-right", "principal": "alice",
                                   "scopes": ["models:read", "responses:write"]}]))
    server = await start_server(nursery, await make_service([tiny_path], tokens_file=tokens))

    def work(api_key):
        with openai.OpenAI(base_url=base_url(server), api_key=api_key, max_retries=0, timeout=60) as client:
            try:
                return client.models.list().data[0].id
            except openai.APIStatusError as exc:
                return exc

    assert await trio.to_thread.run_sync(work, "sk-right") == TINY_ID
    wrong = await trio.to_thread.run_sync(work, "sk-wrong")
    assert isinstance(wrong, openai.AuthenticationError) and wrong.code == "invalid_api_key"


# -- POST /v1/responses --------------------------------------------------------------------


async def test_a_string_input_gets_a_response_that_repeats_the_request(server):
    def work(client):
        return client.responses.create(model=TINY_ID, input="Tell me a story.", instructions="Be brief.",
                                       max_output_tokens=6, temperature=0, top_p=0.9,
                                       metadata={"case": "string"}, user="u1")

    response = await sync_sdk(server, work)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.output[0].type == "message"
    assert response.output[0].content[0].type == "output_text"
    assert response.usage.output_tokens == 6 and response.usage.total_tokens == (
        response.usage.input_tokens + response.usage.output_tokens)
    assert response.instructions == "Be brief." and response.metadata == {"case": "string"}
    assert response.max_output_tokens == 6 and response.temperature == 0 and response.top_p == 0.9
    assert response.store is True and response.user == "u1"


async def test_instructions_are_a_system_message(server):
    def work(client):
        plain = client.responses.create(model=TINY_ID, input="Hi", max_output_tokens=4, temperature=0)
        told = client.responses.create(model=TINY_ID, input="Hi", instructions="Answer in French.",
                                       max_output_tokens=4, temperature=0)
        as_message = client.responses.create(model=TINY_ID, max_output_tokens=4, temperature=0, input=[
            {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}])
        return plain, told, as_message

    plain, told, as_message = await sync_sdk(server, work)
    # (SmolLM2's template writes a default system message when there is none: both are longer)
    assert told.usage.input_tokens != plain.usage.input_tokens
    assert told.output_text == as_message.output_text  # greedy: the same prompt
    assert told.usage.input_tokens == as_message.usage.input_tokens


async def test_a_conversation_by_previous_response_id_then_retrieve_and_delete(server):
    def work(client):
        first = client.responses.create(model=TINY_ID, input="My name is Ada.", max_output_tokens=4,
                                        temperature=0, instructions="Be brief.")
        second = client.responses.create(model=TINY_ID, input="What is my name?", max_output_tokens=4,
                                         temperature=0, previous_response_id=first.id)
        alone = client.responses.create(model=TINY_ID, input="What is my name?", max_output_tokens=4,
                                        temperature=0, store=False)
        retrieved = client.responses.retrieve(second.id)
        client.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(second.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(alone.id)  # store: false
        return first, second, alone, retrieved

    first, second, alone, retrieved = await sync_sdk(server, work)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > alone.usage.input_tokens  # the first turn is in the prompt
    assert retrieved.to_dict() == second.to_dict()
    assert alone.store is False


async def test_previous_response_id_reaches_a_response_stored_through_lmsp(server):
    reply = await server.responses({"model": TINY_ID, "input": [{"role": "user", "content": "My name is Ada."}],
                                    "max_output_tokens": 4, "temperature": 0, "store": True})
    lmsp = reply.json()

    def work(client):
        return (client.responses.retrieve(lmsp["id"]),
                client.responses.create(model=TINY_ID, input="And?", previous_response_id=lmsp["id"],
                                        max_output_tokens=2))

    retrieved, follow_up = await sync_sdk(server, work)
    assert retrieved.id == lmsp["id"] and retrieved.output_text == lmsp["output"][0]["content"][0]["text"]
    assert retrieved.usage.input_tokens == lmsp["usage"]["input_tokens"]
    assert follow_up.previous_response_id == lmsp["id"]


# -- Responses streaming ----------------------------------------------------------------------


async def test_create_stream_gives_the_sdk_event_classes_in_order(server):
    from openai.types.responses import (ResponseCreatedEvent, ResponseIncompleteEvent,
                                        ResponseTextDeltaEvent)

    def work(client):
        return list(client.responses.create(model=TINY_ID, input="Tell me a story.", max_output_tokens=8,
                                            temperature=0, stream=True))

    events = await sync_sdk(server, work)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert isinstance(events[0], ResponseCreatedEvent) and events[0].response.output == []
    assert events[1].type == "response.in_progress"
    assert isinstance(events[-1], ResponseIncompleteEvent)
    deltas = [event for event in events if isinstance(event, ResponseTextDeltaEvent)]
    assert deltas and all(event.item_id == events[-1].response.output[0].id for event in deltas)
    assert "".join(event.delta for event in deltas) == events[-1].response.output_text
    kinds = [event.type for event in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


async def test_responses_stream_helper_reaches_the_final_parsed_response(server):
    async def work(client):
        texts = []
        async with client.responses.stream(model=TINY_ID, input=ASK, text_format=Verdict, temperature=0,
                                           max_output_tokens=32) as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    texts.append(event.delta)
            final = await stream.get_final_response()
        return texts, final

    texts, final = await async_sdk(server, work)
    assert final.status == "completed"
    assert "".join(texts) == final.output_text
    assert isinstance(final.output_parsed, Verdict)
    assert final.output_parsed == Verdict.model_validate_json(final.output_text)


async def test_responses_parse_gets_a_parsed_object(server):
    def work(client):
        return client.responses.parse(model=TINY_ID, input=ASK, text_format=Verdict, temperature=0,
                                      max_output_tokens=32)

    response = await sync_sdk(server, work)
    assert response.status == "completed" and isinstance(response.output_parsed, Verdict)
    assert response.text.format.type == "json_schema"


async def test_json_object_format_is_a_json_object(server):
    def work(client):
        return client.responses.create(model=TINY_ID, input=ASK, temperature=0, max_output_tokens=24,
                                       text={"format": {"type": "json_object"}})

    response = await sync_sdk(server, work)
    assert response.output_text.startswith("{")
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)


async def test_function_tools_and_their_results(server):
    def work(client):
        called = client.responses.create(model=TINY_ID, input=ASK, tools=[WEATHER], tool_choice="required",
                                         temperature=0, max_output_tokens=64)
        call = next(item for item in called.output if item.type == "function_call")
        answered = client.responses.create(model=TINY_ID, previous_response_id=called.id, tools=[WEATHER],
                                           max_output_tokens=4, temperature=0, input=[
                                               {"type": "function_call_output", "call_id": call.call_id,
                                                "output": json.dumps({"temperature_c": 17})}])
        with client.responses.stream(model=TINY_ID, input=ASK, tools=[WEATHER], temperature=0,
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     max_output_tokens=64) as stream:
            events = list(stream)
        return called, call, answered, events

    called, call, answered, events = await sync_sdk(server, work)
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"} and len(json.loads(call.arguments)["city"]) <= 5
    assert answered.status in ("completed", "incomplete")
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    deltas = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert done and deltas == done[0].arguments and set(json.loads(done[0].arguments)) == {"city"}
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].parsed_arguments is None or events[-1].response.output[0].type


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=5)


def called_or_answered(calls, text) -> str:
    """Valid calls (jsonschema on WEATHER's parameters) and no text, or no call and a text
    that is a Verdict: D5 with tools and a json_schema, never neither."""
    if calls:
        assert not text, text
        for name, arguments in calls:
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
        return "calls"
    jsonschema.validate(json.loads(text), Verdict.model_json_schema())
    return "answer"


async def test_an_agent_with_tools_and_an_output_type_calls_or_answers(server):
    """What the Agents SDK sends for an agent with tools and an `output_type`: strict tools
    and a strict json_schema text format, tool_choice left to the model."""
    output_schema = {**Verdict.model_json_schema(), "additionalProperties": False}
    text_format = {"format": {"type": "json_schema", "name": "final_output", "schema": output_schema, "strict": True}}

    def work(client):
        return [client.responses.create(model=TINY_ID, input=ASK, tools=[{**WEATHER, "strict": True}],
                                        text=text_format, temperature=temperature, max_output_tokens=200,
                                        **({"tool_choice": choice} if choice else {}))
                for temperature in (0, 1.0) for choice in (None, "auto", "required", "none")]

    for response in await sync_sdk(server, work):
        assert response.status == "completed"
        calls = [(item.name, item.arguments) for item in response.output if item.type == "function_call"]
        kind = called_or_answered(calls, response.output_text)
        assert kind == {"required": "calls", "none": "answer"}.get(response.tool_choice, kind)


async def test_chat_completions_parse_with_tools_and_a_response_format(server):
    """`chat.completions.parse(tools=[pydantic_function_tool], response_format=Model)`: the
    SDK parses the calls' arguments or the message, whichever the model chose."""
    async def work(client):
        return [await client.chat.completions.parse(
            model=TINY_ID, messages=[{"role": "user", "content": ASK}], seed=seed, temperature=1.0, max_tokens=200,
            tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")], response_format=Verdict)
            for seed in range(8)]

    kinds = set()
    for completion in await async_sdk(server, work):
        choice = completion.choices[0]
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == ("tool_calls" if calls else "stop")
        kinds.add(called_or_answered([(c.function.name, c.function.arguments) for c in calls], choice.message.content))
        for call in calls:
            assert isinstance(call.function.parsed_arguments, GetWeather)
        if not calls:
            assert isinstance(choice.message.parsed, Verdict)
    assert kinds == {"calls", "answer"}  # (seeded: the same both times)


# -- background responses ----------------------------------------------------------------------


async def test_a_background_response_is_polled_and_its_stream_resumed(server):
    async def work(client):
        created = await client.responses.create(model=TINY_ID, input="Tell me a story.", max_output_tokens=8,
                                                temperature=0, background=True, metadata={"job": "1"})
        response = await polled_until_done(client, created.id)
        replayed = [event async for event in await client.responses.retrieve(created.id, stream=True)]
        resumed = [event async for event in await client.responses.retrieve(created.id, stream=True,
                                                                            starting_after=3)]
        async with client.responses.stream(response_id=created.id, starting_after=5) as stream:
            helped = [event async for event in stream]
            final = await stream.get_final_response() if response.status == "completed" else None
        return created, response, replayed, resumed, helped, final

    created, response, replayed, resumed, helped, final = await async_sdk(server, work)
    assert created.background is True and created.status in ("queued", "in_progress")
    assert response.status == "incomplete" and response.metadata == {"job": "1"} and response.output_text
    assert [event.sequence_number for event in replayed] == list(range(len(replayed)))
    assert replayed[0].type == "response.created" and replayed[-1].type == "response.incomplete"
    assert replayed[-1].response.output_text == response.output_text
    assert [event.sequence_number for event in resumed] == list(range(4, len(replayed)))
    assert [event.to_dict() for event in resumed] == [event.to_dict() for event in replayed[4:]]
    assert [event.sequence_number for event in helped] == list(range(6, len(replayed)))


async def test_a_background_response_is_cancelled(server, monkeypatch):
    gated(server.service.registry.get(TINY_ID).model, monkeypatch).allow(3)  # then it runs until cancelled

    async def work(client):
        created = await client.responses.create(model=TINY_ID, input="Tell me a story.", max_output_tokens=400,
                                                temperature=0, background=True)
        stream = await client.responses.retrieve(created.id, stream=True)
        async for event in stream:
            if event.type == "response.output_text.delta":
                break
        with pytest.raises(openai.ConflictError) as running:
            await client.responses.delete(created.id)
        cancelled = await client.responses.cancel(created.id)
        rest = [event async for event in stream]
        return cancelled, rest, await client.responses.retrieve(created.id), running.value

    cancelled, rest, retrieved, running = await async_sdk(server, work)
    assert cancelled.id in running.message and "task_" not in running.message  # (the id the client knows)
    assert cancelled.status == "cancelled" and 0 < cancelled.usage.output_tokens < 400
    # (the SDK names no class for response.cancelled: its response stays a dict)
    assert rest[-1].type == "response.cancelled" and rest[-1].response["status"] == "cancelled"
    assert retrieved.status == "cancelled" and retrieved.output_text == cancelled.output_text


async def test_only_a_background_response_is_cancelled(server):
    def work(client):
        stored = client.responses.create(model=TINY_ID, input="Hi", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError):
            client.responses.cancel(stored.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel("resp_nope")

    await sync_sdk(server, work)


# -- POST /v1/chat/completions ---------------------------------------------------------------------


async def test_chat_completion(server):
    def work(client):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
        first = client.chat.completions.create(model=TINY_ID, messages=messages, max_tokens=6, temperature=0)
        newer = client.chat.completions.create(model=TINY_ID, messages=messages, max_completion_tokens=6,
                                               temperature=0)
        seeded = [client.chat.completions.create(model=TINY_ID, messages=messages, max_tokens=8, temperature=1,
                                                 seed=seed).choices[0].message.content for seed in (7, 7, 8)]
        return first, newer, seeded

    first, newer, seeded = await sync_sdk(server, work)
    assert first.object == "chat.completion" and first.id.startswith("chatcmpl-")
    (choice,) = first.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert first.usage.completion_tokens == 6
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert newer.choices[0].message.content == choice.message.content
    assert seeded[0] == seeded[1] != seeded[2]


async def test_chat_stop_sequences_end_the_completion(server):
    def work(client):
        messages = [{"role": "user", "content": "Tell me a story."}]
        free = client.chat.completions.create(model=TINY_ID, messages=messages, max_tokens=12, temperature=0)
        text = free.choices[0].message.content
        stop = text[len(text) // 2:len(text) // 2 + 2]
        stopped = client.chat.completions.create(model=TINY_ID, messages=messages, max_tokens=12, temperature=0,
                                                 stop=[stop])
        return text, stop, stopped

    text, stop, stopped = await sync_sdk(server, work)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == text[:text.index(stop)]


async def test_chat_stream_with_usage(server):
    async def work(client):
        stream = await client.chat.completions.create(
            model=TINY_ID, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6,
            temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        synchronous = await client.chat.completions.create(
            model=TINY_ID, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6, temperature=0)
        return chunks, synchronous

    chunks, synchronous = await async_sdk(server, work)
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(chunk.usage is None for chunk in chunks[:-1])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks[:-1])
    assert text == synchronous.choices[0].message.content


async def test_chat_tools_sync_and_streamed(server):
    tool = {"type": "function", "function": {key: WEATHER[key] for key in ("name", "description", "parameters")}}

    def work(client):
        messages = [{"role": "user", "content": ASK}]
        called = client.chat.completions.create(model=TINY_ID, messages=messages, tools=[tool],
                                                tool_choice="required", temperature=0, max_tokens=64)
        (call, *_) = called.choices[0].message.tool_calls
        answered = client.chat.completions.create(model=TINY_ID, tools=[tool], temperature=0, max_tokens=4, messages=[
            *messages, called.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 17})}])
        with client.chat.completions.stream(model=TINY_ID, messages=messages, tools=[tool], temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            max_tokens=64) as stream:
            for _ in stream:
                pass
            streamed = stream.get_final_completion()
        return called, call, answered, streamed

    called, call, answered, streamed = await sync_sdk(server, work)
    assert called.choices[0].finish_reason in ("tool_calls", "length")
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert answered.choices[0].message.role == "assistant"
    (streamed_call,) = streamed.choices[0].message.tool_calls
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(streamed_call.function.arguments)) == {"city"}


async def test_chat_completions_parse_gets_a_parsed_object(server):
    async def work(client):
        return await client.chat.completions.parse(model=TINY_ID, messages=[{"role": "user", "content": ASK}],
                                                   response_format=Verdict, temperature=0, max_tokens=32)

    completion = await async_sdk(server, work)
    message = completion.choices[0].message
    assert isinstance(message.parsed, Verdict) and message.parsed == Verdict.model_validate_json(message.content)


async def test_chat_parameters_we_cannot_honour_or_out_of_range_are_named(server):
    def work(client):
        errors = {}
        messages = [{"role": "user", "content": "hi"}]
        for name, kwargs in {
            "n": {"n": 9}, "top_logprobs": {"logprobs": True, "top_logprobs": 21},
            "presence_penalty": {"presence_penalty": 2.5}, "logit_bias.100000": {"logit_bias": {"100000": 1}},
            "modalities": {"modalities": ["audio"]},
            "messages[0].content[1].type": {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
            "max_tokens": {"max_tokens": 0},
            "stop[0]": {"stop": [""]},
            "tools[0].function.name": {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "messages[2].tool_call_id": {"messages": [*messages, {"role": "assistant", "content": "ok"},
                                                      {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
        }.items():
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(**{"model": TINY_ID, "messages": messages, **kwargs})
            errors[name] = caught.value
        return errors

    errors = await sync_sdk(server, work)
    for name, error in errors.items():
        assert error.param == name, (name, error.message)


async def test_a_full_queue_is_a_rate_limit_error(server, monkeypatch):
    monkeypatch.setattr(server.service.registry.get(TINY_ID), "queue_depth", 0)  # every slot taken

    def work(client):
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=TINY_ID, messages=[{"role": "user", "content": "hi"}])
        return caught.value

    error = await sync_sdk(server, work)
    assert error.code == "rate_limit_exceeded" and error.response.headers["retry-after"] == "1"


async def test_a_chat_stream_that_fails_raises_in_the_sdk(server):
    defs = {"L0": {"type": "integer"}}
    for k in range(1, 11):
        one = {"type": "array", "items": {"$ref": f"#/$defs/L{k - 1}"}, "minItems": 1, "maxItems": 1}
        defs[f"L{k}"] = {"anyOf": [one, {**one, "maxItems": 2}]}
    response_format = {"type": "json_schema", "json_schema": {"name": "nested",
                                                              "schema": {"$ref": "#/$defs/L10", "$defs": defs}}}

    async def work(client):
        stream = await client.chat.completions.create(model=TINY_ID, messages=[{"role": "user", "content": ASK}],
                                                      max_tokens=32, stream=True, response_format=response_format)
        with pytest.raises(openai.APIError) as caught:
            async for _ in stream:
                pass
        return caught.value

    error = await async_sdk(server, work)
    assert "256" in error.message and error.param == "response_format.json_schema.schema"


async def test_the_input_items_of_a_response_are_listed_and_paged(server):
    def work(client):
        first = client.responses.create(model=TINY_ID, input="My name is Ada.", max_output_tokens=2,
                                        instructions="Be brief.")
        second = client.responses.create(model=TINY_ID, previous_response_id=first.id, max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}])
        listed = list(client.responses.input_items.list(second.id, order="asc"))
        paged = list(client.responses.input_items.list(second.id, limit=1))  # desc; the SDK follows the pages
        return first, listed, paged

    first, listed, paged = await sync_sdk(server, work)
    assert [item.type for item in listed] == ["message", "message", "message"]
    assert [item.role for item in listed] == ["user", "assistant", "user"]  # (not the instructions)
    assert listed[0].content[0].text == "My name is Ada." and listed[1].id == first.output[0].id
    assert listed[2].content[0].text == "What is my name?"
    assert [item.id for item in paged] == [item.id for item in reversed(listed)]


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=5)


async def test_pydantic_tools_and_formats_through_the_parse_helpers(server):
    """openai.pydantic_function_tool's strict schema, parsed back into the model; and
    chat.completions.stream with a pydantic response_format, parsed at its end."""
    def work(client):
        messages = [{"role": "user", "content": ASK}]
        called = client.chat.completions.parse(model=TINY_ID, messages=messages, temperature=0, max_tokens=64,
                                               tools=[openai.pydantic_function_tool(GetWeather)],
                                               tool_choice={"type": "function", "function": {"name": "GetWeather"}})
        with client.chat.completions.stream(model=TINY_ID, messages=messages, response_format=GetWeather,
                                            temperature=0, max_tokens=64) as stream:
            for _ in stream:
                pass
            streamed = stream.get_final_completion()
        return called, streamed

    called, streamed = await sync_sdk(server, work)
    (call,) = called.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather) and len(call.function.parsed_arguments.city) <= 5
    assert isinstance(streamed.choices[0].message.parsed, GetWeather)


# -- what the SDK's own types declare -------------------------------------------------------------


def sdk_valid(model_type, data) -> None:
    """`data` (an object as the server sent it, or an SDK object's to_dict()) validated by
    the SDK's pydantic type: every field it requires is there, with its type (the SDK
    itself builds its objects without validating them)."""
    pydantic.TypeAdapter(model_type).validate_python(data.to_dict() if isinstance(data, pydantic.BaseModel) else data)


async def test_response_objects_and_events_are_what_the_sdk_types_declare(server):
    from openai.types.responses import Response, ResponseStreamEvent

    def work(client):
        made = client.responses.create(model=TINY_ID, input=ASK, text={"format": {
            "type": "json_schema", "name": "verdict", "strict": True, "schema": Verdict.model_json_schema()}},
            temperature=0, max_output_tokens=32, prompt_cache_key="weather", safety_identifier="user-1")
        cut = client.responses.create(model=TINY_ID, input=ASK, max_output_tokens=3)
        events = list(client.responses.create(model=TINY_ID, input=ASK, max_output_tokens=3, stream=True))
        return made, client.responses.retrieve(made.id), cut, events

    made, retrieved, cut, events = await sync_sdk(server, work)
    for response in (made, retrieved, cut):
        sdk_valid(Response, response)
        assert Response.model_validate(response.to_dict()) == response  # (a dump round-trips)
    for event in events:
        sdk_valid(ResponseStreamEvent, event)
    assert made.status == "completed" and made.completed_at >= made.created_at
    assert retrieved.completed_at == made.completed_at
    assert cut.status == "incomplete" and cut.completed_at is None
    assert made.usage.input_tokens_details.cache_write_tokens == 0
    assert made.prompt_cache_key == "weather" and made.safety_identifier == "user-1"


async def test_a_background_response_has_one_completed_at(server, monkeypatch):
    """Followed while it runs, then replayed: the moment it ended is the task's, the same."""
    paced(server.service.registry.get(TINY_ID).model, monkeypatch, 0.01)

    async def work(client):
        created = await client.responses.create(model=TINY_ID, input=ASK, background=True, temperature=0,
                                                max_output_tokens=32, text={"format": {"type": "json_object"}})
        followed = [event async for event in await client.responses.retrieve(created.id, stream=True)]
        replayed = [event async for event in await client.responses.retrieve(created.id, stream=True)]
        return followed, replayed, await client.responses.retrieve(created.id)

    followed, replayed, retrieved = await async_sdk(server, work)
    assert retrieved.status == "completed" and retrieved.completed_at >= retrieved.created_at
    assert followed[-1].response.completed_at == replayed[-1].response.completed_at == retrieved.completed_at
    assert [event.to_dict() for event in followed] == [event.to_dict() for event in replayed]


async def test_listed_input_items_are_what_the_sdk_types_declare(server):
    from openai.types.responses.response_item import ResponseItem

    tool = {**WEATHER, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

    def work(client):
        first = client.responses.create(model=TINY_ID, input="My name is Ada.", max_output_tokens=3)
        second = client.responses.create(model=TINY_ID, previous_response_id=first.id, tools=[tool],
                                         tool_choice="none", max_output_tokens=3, input=[
                                             {"role": "user", "content": ASK},
                                             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                              "arguments": '{"city": "Hangzhou"}'},
                                             {"type": "function_call_output", "call_id": "call_1", "output": "17"}])
        return list(client.responses.input_items.list(second.id, order="asc"))

    items = await sync_sdk(server, work)
    assert [item.type for item in items] == ["message", "message", "message", "function_call",
                                             "function_call_output"]
    for item in items:
        sdk_valid(ResponseItem, item)
    assert items[1].role == "assistant" and items[1].content[0].annotations == []
    assert {item.status for item in items} == {"completed", "incomplete"}  # (the first reply was cut)


async def test_only_a_background_response_is_streamed_again(server):
    def work(client):
        stored = client.responses.create(model=TINY_ID, input="Hi", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.retrieve(stored.id, stream=True)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve("resp_nope", stream=True)
        return caught.value

    error = await sync_sdk(server, work)
    assert error.param == "stream" and "background" in error.message


async def test_parallel_tool_calls_false_is_at_most_one_call(server):
    """As Codex-style agents send it, with 'auto' or 'required': honoured, never a 400."""
    tool = {"type": "function", "function": {key: WEATHER[key] for key in ("name", "description", "parameters")}}

    def work(client):
        responses = [client.responses.create(model=TINY_ID, input=ASK, tools=[WEATHER], tool_choice=choice,
                                             parallel_tool_calls=False, temperature=0, max_output_tokens=64)
                     for choice in ("auto", "required")]
        chats = [client.chat.completions.create(model=TINY_ID, messages=[{"role": "user", "content": ASK}],
                                                tools=[tool], tool_choice=choice, parallel_tool_calls=False,
                                                temperature=0, max_tokens=64)
                 for choice in ("auto", "required")]
        return responses, chats

    responses, chats = await sync_sdk(server, work)
    for response in responses:
        assert response.parallel_tool_calls is False
        assert len([item for item in response.output if item.type == "function_call"]) <= 1
    assert [item.type for item in responses[1].output] == ["function_call"]
    for completion in chats:
        assert len(completion.choices[0].message.tool_calls or []) <= 1
    assert len(chats[1].choices[0].message.tool_calls) == 1


async def test_allowed_tools_narrow_the_calls_and_a_bad_one_names_its_param(server):
    """tool_choice allowed_tools, both dialects: every tool is shown, only the allowed are called."""
    clock = {"type": "function", "name": "get_time", "description": "The time now.",
             "parameters": {"type": "object", "properties": {}}}
    chat_tools = [{"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")}}
                  for tool in (WEATHER, clock)]

    def work(client):
        allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
        response = client.responses.create(model=TINY_ID, input=ASK, tools=[WEATHER, clock], tool_choice=allowed,
                                           temperature=0, max_output_tokens=64)
        chat = client.chat.completions.create(
            model=TINY_ID, messages=[{"role": "user", "content": ASK}], tools=chat_tools, max_tokens=64, temperature=0,
            tool_choice={"type": "allowed_tools", "allowed_tools": {
                "mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}})
        errors = []
        for entries in ([{"type": "function", "name": "nope"}], [{"type": "mcp", "server_label": "x"}]):
            with pytest.raises(openai.BadRequestError) as caught:
                client.responses.create(model=TINY_ID, input=ASK, tools=[WEATHER, clock],
                                        tool_choice={"type": "allowed_tools", "mode": "auto", "tools": entries})
            errors.append(caught.value)
        return response, chat, errors

    response, chat, errors = await sync_sdk(server, work)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and {call.name for call in calls} == {"get_time"}
    assert response.tool_choice.type == "allowed_tools" and len(response.tools) == 2
    assert {call.function.name for call in chat.choices[0].message.tool_calls} == {"get_time"}
    assert [error.param for error in errors] == ["tool_choice.tools[0]"] * 2
    assert "'nope'" in errors[0].message


async def test_a_failed_response_is_what_the_sdk_types_declare(server):
    from openai.types.responses import Response, ResponseStreamEvent

    defs = {"L0": {"type": "integer"}}  # (a schema whose bound only the output reaches: test_server_tools)
    for k in range(1, 11):
        one = {"type": "array", "items": {"$ref": f"#/$defs/L{k - 1}"}, "minItems": 1, "maxItems": 1}
        defs[f"L{k}"] = {"anyOf": [one, {**one, "maxItems": 2}]}
    nested = {"type": "json_schema", "name": "nested", "schema": {"$ref": "#/$defs/L10", "$defs": defs}}

    def work(client):
        events = list(client.responses.create(model=TINY_ID, input=ASK, max_output_tokens=32, stream=True,
                                              text={"format": nested}))
        return events, client.responses.retrieve(events[0].response.id)

    events, retrieved = await sync_sdk(server, work)
    for event in events:
        sdk_valid(ResponseStreamEvent, event)
    sdk_valid(Response, retrieved)
    assert events[-1].type == "response.failed" and retrieved.status == "failed"
    assert retrieved.error.code == "invalid_prompt" and "256" in retrieved.error.message


async def test_top_p_0_and_top_k_and_min_p_are_honoured(server):
    """OpenAI's top_p is in [0, 1] (LMSP's in (0, 1]): 0 keeps the most likely token alone;
    top_k and min_p, as llama-server's and vLLM's users send them (extra_body), are LMSP's."""
    def work(client):
        messages = [{"role": "user", "content": "Tell me a story."}]
        greedy = client.chat.completions.create(model=TINY_ID, messages=messages, max_tokens=8, temperature=0)
        nucleus = client.chat.completions.create(model=TINY_ID, messages=messages, max_tokens=8, temperature=1.5,
                                                 top_p=0, seed=3)
        top_k = client.chat.completions.create(model=TINY_ID, messages=messages, max_tokens=8, temperature=1.5,
                                               seed=3, extra_body={"top_k": 1, "min_p": 0.05})
        response = client.responses.create(model=TINY_ID, input="Tell me a story.", max_output_tokens=8, top_p=0)
        responses_top_k = client.responses.create(model=TINY_ID, input="Tell me a story.", max_output_tokens=8,
                                                  extra_body={"top_k": 1})
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=TINY_ID, messages=messages, extra_body={"min_p": 2})
        return greedy, nucleus, top_k, response, responses_top_k, caught.value

    greedy, nucleus, top_k, response, responses_top_k, error = await sync_sdk(server, work)
    text = greedy.choices[0].message.content
    assert nucleus.choices[0].message.content == text and top_k.choices[0].message.content == text
    assert response.top_p == 0 and response.output_text == text and responses_top_k.output_text == text
    assert error.param == "min_p" and "'min_p'" in error.message


async def test_input_tokens_are_counted_as_a_response_would_count_them(server):
    def work(client):
        first = client.responses.create(model=TINY_ID, input="My name is Ada.", max_output_tokens=3,
                                        instructions="Be brief.")
        asked = {"model": TINY_ID, "input": ASK, "previous_response_id": first.id, "tools": [WEATHER]}
        counted = client.responses.input_tokens.count(**asked)
        made = client.responses.create(**asked, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.responses.input_tokens.count(model="nope", input=ASK)
        return counted, made

    counted, made = await sync_sdk(server, work)
    assert counted.object == "response.input_tokens" and counted.input_tokens == made.usage.input_tokens


async def test_expired_events_are_named_by_the_response(nursery, tiny_path, tmp_path):
    server = await start_server(nursery, await make_service([tiny_path], data_dir=tmp_path / "data",
                                                            event_retention=0))

    async def work(client):
        created = await client.responses.create(model=TINY_ID, input="Hi", max_output_tokens=2, background=True)
        await polled_until_done(client, created.id)
        with pytest.raises(openai.APIStatusError) as caught:
            await client.responses.retrieve(created.id, stream=True)
        return created, caught.value

    created, error = await async_sdk(server, work)
    assert error.status_code == 410 and error.code == "event_history_expired"
    assert created.id in error.message and "task_" not in error.message


# -- pydantic models of the types clients use, on the real SmolLM2 (slow) ------------------------

Tag = Annotated[str, pydantic.Field(max_length=8)]


class LineItem(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    quantity: int = pydantic.Field(ge=1, le=9)
    tags: list[Tag] = pydantic.Field(max_length=2)


class Order(pydantic.BaseModel):
    """Formats, a pattern, Literal, Optional and a nested list, as pydantic writes them (the
    strings bounded: a 135M model has no reason to end one). `contact` has EmailStr's schema
    (EmailStr itself needs the email-validator package, not installed here)."""
    id: uuid.UUID
    placed: datetime.datetime
    ship_by: datetime.date
    contact: Annotated[str, pydantic.Field(max_length=40, json_schema_extra={"format": "email"})]
    status: Literal["new", "paid", "shipped"]
    note: Optional[str] = pydantic.Field(default=None, max_length=20)
    items: list[LineItem] = pydantic.Field(max_length=2)
    code: str = pydantic.Field(pattern=r"^[A-Z]{2}-\d{4}$")


async def test_parse_with_pydantic_models_of_formats_literals_and_nested_lists(server):
    async def work(client):
        return await client.chat.completions.parse(model=TINY_ID, messages=[{"role": "user", "content": ASK}],
                                                   response_format=Order, seed=1, temperature=1.0, max_tokens=470)

    message = (await async_sdk(server, work)).choices[0].message
    assert isinstance(message.parsed, Order)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.Draft202012Validator(Order.model_json_schema(), format_checker=checker).validate(json.loads(message.content))


@pytest.mark.slow
async def test_parse_with_pydantic_models_of_formats_literals_and_nested_lists_on_smollm2(nursery, smollm2_path):
    server = await start_server(nursery, await make_service([smollm2_path]))
    model_id = "smollm2:135m-instruct-q4_1"
    ask = "Write an order of two line items, paid, for ada@example.com."

    def work(client):
        chat = client.chat.completions.parse(model=model_id, messages=[{"role": "user", "content": ask}],
                                             response_format=Order, temperature=0, max_tokens=500)
        response = client.responses.parse(model=model_id, input=ask, text_format=Order, temperature=0.7,
                                          max_output_tokens=500)
        return chat, response

    chat, response = await sync_sdk(server, work)
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "stop" and isinstance(message.parsed, Order)
    assert response.status == "completed" and isinstance(response.output_parsed, Order)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for text in (message.content, response.output_text):
        jsonschema.Draft202012Validator(Order.model_json_schema(), format_checker=checker).validate(json.loads(text))

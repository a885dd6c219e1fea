"""events.ResponseRun: engine chat events -> LMSP events and the response object (6.2, 6.3, D4, D5).

These feed scripted engine events (the classes of engine/api.py) so that
every shape a model can produce (reasoning, text, tool calls, failures) is
covered whatever the tiny model happens to say.
"""

import json

import pytest
import trio

from engine.api import Finished, ReasoningDelta, TextDelta, ToolCall
from lmsp_min import routes
from lmsp_min.events import Event, ResponseRun, new_id
from lmsp_min.problems import Problem
from lmsp_min.validate import items_to_messages, validate_responses_request


async def script(*events, fail: Exception | None = None):
    for event in events:
        await trio.lowlevel.checkpoint()
        yield event
    if fail is not None:
        raise fail


async def run(*events, fail=None) -> tuple[ResponseRun, list[Event]]:
    response = ResponseRun("m:1")
    out = [event async for event in response.events(script(*events, fail=fail))]
    return response, out


def check_sequence(events: list[Event]) -> None:
    """6.3/6.4: ids 1, 2, 3...; created first; exactly one final event, last."""
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert events[0].name == "response.created" and events[0].data["status"] == "in_progress"
    assert [e.is_final for e in events].count(True) == 1 and events[-1].is_final
    response_ids = {e.data["response_id"] for e in events if "response_id" in e.data}
    assert len(response_ids) == 1


async def test_text_message():
    response, events = await run(TextDelta("Hel"), TextDelta(""), TextDelta("lo ✓"), Finished("stop", 5, 3, 0))
    check_sequence(events)
    assert [e.name for e in events] == [
        "response.created", "response.output_item.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_item.done", "response.completed"]
    added, done = events[1].data, events[4].data
    assert added["item"]["content"] == [] and added["output_index"] == 0
    assert added["item"]["id"].startswith("msg_") and added["item"]["role"] == "assistant"
    assert done["item"]["content"] == [{"type": "output_text", "text": "Hello ✓"}]
    assert "".join(e.data["delta"] for e in events if e.name.endswith("text.delta")) == "Hello ✓"
    assert all(e.data["item_id"] == added["item"]["id"] for e in events if e.name.endswith("text.delta"))
    assert events[-1].data == {"response_id": response.id, "status": "completed",
                               "usage": {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8,
                                         "input_tokens_details": {"cached_tokens": 0}}}
    obj = response.response_object()
    assert set(obj) == {"id", "object", "created_at", "status", "model", "output", "usage", "error",
                        "incomplete_details"}
    assert obj["id"].startswith("resp_") and obj["object"] == "response" and obj["status"] == "completed"
    assert obj["output"] == [done["item"]] and obj["error"] is None and obj["incomplete_details"] is None


async def test_length_limit_is_incomplete():
    response, events = await run(TextDelta("a"), Finished("length", 5, 1, 0))
    check_sequence(events)
    assert events[-1].name == "response.incomplete"
    assert events[-1].data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1].data["usage"]["output_tokens"] == 1
    assert response.response_object()["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_reasoning_comes_before_the_message():
    response, events = await run(ReasoningDelta("think "), ReasoningDelta("hard"), TextDelta("42"),
                                 Finished("stop", 5, 4, 0))
    check_sequence(events)
    names = [e.name for e in events]
    assert names == ["response.created", "response.output_item.added",
                     "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
                     "response.output_item.done", "response.output_item.added",
                     "response.output_text.delta", "response.output_item.done", "response.completed"]
    reasoning, message = response.output
    assert reasoning["id"].startswith("rs_") and reasoning["type"] == "reasoning"
    assert reasoning["summary"] == [{"type": "summary_text", "text": "think hard"}]
    assert message["content"][0]["text"] == "42"
    assert events[5].data["output_index"] == 1


async def test_tool_calls_added_then_done():
    response, events = await run(
        ToolCall(0, "get_weather", '{"city":"Hangzhou"}'),
        ToolCall(1, "get_time", "{}"),
        Finished("stop", 5, 9, 0))
    check_sequence(events)
    names = [e.name for e in events]
    assert names == ["response.created",
                     "response.output_item.added", "response.output_item.done",
                     "response.output_item.added", "response.output_item.done", "response.completed"]
    first, second = response.output
    assert first == {"id": first["id"], "type": "function_call", "call_id": first["call_id"],
                     "name": "get_weather", "arguments": '{"city":"Hangzhou"}'}
    assert first["id"].startswith("fc_") and first["call_id"].startswith("call_")
    assert first["call_id"] != second["call_id"]
    assert events[1].data["item"]["arguments"] == ""
    assert events[2].data["item"] == first and json.loads(events[4].data["item"]["arguments"]) == {}


async def test_text_then_a_tool_call():
    response, events = await run(TextDelta("Let me check."), ToolCall(0, "f", '{"a":1}'),
                                 Finished("stop", 5, 9, 0))
    check_sequence(events)
    assert [item["type"] for item in response.output] == ["message", "function_call"]
    done = [e for e in events if e.name == "response.output_item.done"]
    assert [e.data["output_index"] for e in done] == [0, 1]


async def test_nothing_generated_is_an_empty_message():
    response, events = await run(Finished("stop", 5, 0, 0))
    check_sequence(events)
    assert [e.name for e in events] == ["response.created", "response.output_item.added",
                                        "response.output_item.done", "response.completed"]
    assert response.output[0]["content"] == [{"type": "output_text", "text": ""}]


async def test_engine_failure_ends_failed_without_details():
    lines = []
    response = ResponseRun("m:1", log=lines.append)
    events = [e async for e in response.events(script(TextDelta("a"), fail=ValueError("/home/secret/x broke")))]
    check_sequence(events)
    final = events[-1]
    assert final.name == "response.failed" and final.data["status"] == "failed"
    assert final.data["error"]["code"] == "generation_failed" and "/tmp" not in final.data["error"]["detail"]
    assert response.response_object()["error"] == final.data["error"]
    assert any("/home/secret/x broke" in line for line in lines)  # the log has the reason


@pytest.mark.parametrize("reason, code", [("problem", "invalid_request"), ("stopping", "model_unavailable")])
async def test_two_engine_ends_say_what_happened(reason, code):
    """A Problem (app._engine_events' reading of a schema the output takes past its bound)
    is the error as it is, param included; a stopping service is model_unavailable."""
    from lmsp_min.events import ServiceStopping

    problem = Problem("invalid_request", "the schema cannot be enforced", param="tools")
    _, events = await run(TextDelta("["), fail=problem if reason == "problem" else ServiceStopping())
    check_sequence(events)
    assert events[-1].name == "response.failed" and events[-1].data["error"]["code"] == code
    if reason == "problem":
        assert events[-1].data["error"] == problem.to_dict()


async def test_an_engine_that_stops_without_finished_has_failed():
    _, events = await run(TextDelta("a"))
    assert events[-1].name == "response.failed"


async def test_cancellation_propagates_and_cancelled_event_follows_the_sequence():
    response = ResponseRun("m:1")

    async def endless():
        while True:
            await trio.lowlevel.checkpoint()
            yield TextDelta("x")

    seen = []
    with trio.move_on_after(0.05):
        async for event in response.events(endless()):
            seen.append(event)
    final = response.cancelled()
    assert final.id == seen[-1].id + 1 and final.name == "response.cancelled"
    assert final.data == {"response_id": response.id, "status": "cancelled"}


async def test_a_response_ended_early_reports_the_tokens_counted_until_then():
    """6.2: `usage` says what was consumed, for a failed or cancelled response too (the
    engine's counts as they stand); their final events keep the data 6.3 lists."""
    from engine.api import TokenCounts

    counts = TokenCounts(7, output_tokens=2, cached_tokens=2)
    expected = {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9, "input_tokens_details": {"cached_tokens": 2}}
    failed = ResponseRun("m:1", counts=counts)
    final = failed.failed(Problem("model_unavailable", "the service is shutting down"))
    assert set(final.data) == {"response_id", "status", "error"} and failed.response_object()["usage"] == expected
    cancelled = ResponseRun("m:1", counts=counts)
    final = cancelled.cancelled()
    assert set(final.data) == {"response_id", "status"} and cancelled.response_object()["usage"] == expected
    # a run the engine never counted for: unknown, not zero
    uncounted = ResponseRun("m:1")
    uncounted.cancelled()
    assert uncounted.response_object()["usage"] is None


async def test_an_engine_failure_reports_the_tokens_counted_until_then():
    from engine.api import TokenCounts

    counts = TokenCounts(5)

    async def one_token_then_fails():
        counts.output_tokens += 1
        yield TextDelta("a")
        raise RuntimeError("boom")

    response = ResponseRun("m:1", counts=counts)
    events = [e async for e in response.events(one_token_then_fails())]
    assert events[-1].name == "response.failed" and "usage" not in events[-1].data
    assert response.response_object()["usage"]["output_tokens"] == 1
    assert response.response_object()["usage"]["input_tokens"] == 5


# 6.3's table: the data fields of each event (the final ones' `usage` and `error` as in 6.2)
EVENT_DATA_FIELDS = {
    "response.created": {"response_id", "status"},
    "response.output_item.added": {"response_id", "output_index", "item"},
    "response.output_text.delta": {"response_id", "item_id", "delta"},
    "response.output_item.done": {"response_id", "output_index", "item"},
    "response.completed": {"response_id", "status", "usage"},
    "response.incomplete": {"response_id", "status", "incomplete_details", "usage"},
    "response.failed": {"response_id", "status", "error"},
    "response.cancelled": {"response_id", "status"},
    "error": {"error"},
}


async def test_each_event_carries_the_data_fields_of_its_row():
    """6.3: every event of the table carries its row's data fields, with the status its
    name says (`in_progress` for response.created)."""
    from engine.api import TokenCounts

    seen = []
    for reason in ("stop", "length"):
        _, events = await run(TextDelta("Hi"), Finished(reason, 5, 1, 0))
        seen += events
    _, events = await run(TextDelta("Hi"), fail=RuntimeError("boom"))
    seen += events
    ended_early = ResponseRun("m:1", counts=TokenCounts(5))
    seen += [ended_early.cancelled(), ended_early.error_event(Problem("internal_error", "a bug"))]
    assert {e.name for e in seen} == set(EVENT_DATA_FIELDS)
    for event in seen:
        assert set(event.data) == EVENT_DATA_FIELDS[event.name], event
        if event.name.startswith("response.") and "status" in event.data:
            expected = "in_progress" if event.name == "response.created" else event.name.split(".")[1]
            assert event.data["status"] == expected
        if "error" in event.data:
            assert {"type", "title", "status", "detail", "code"} <= set(event.data["error"])


def test_an_lmsp_event_is_one_sse_message_with_its_id_name_and_json_data():
    event = Event(3, "response.output_text.delta", {"response_id": "resp_1", "delta": "a\nb \u2028é"})
    text = routes.message(event).decode("utf-8")
    lines = text.split("\n")
    assert lines[0] == "id: 3" and lines[1] == "event: response.output_text.delta"
    assert lines[2].startswith("data: ") and json.loads(lines[2][6:])["delta"] == "a\nb \u2028é"
    assert text.endswith("\n\n") and text.count("\n") == 4


def test_ids_are_unique_and_prefixed():
    ids = {new_id("resp") for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("resp_") and len(i) == 31 for i in ids)


def test_input_items_become_chat_messages():
    request = validate_responses_request({"model": "m", "input": [
        {"type": "message", "role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                       {"type": "input_text", "text": "in Hangzhou?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1",
         "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city":"Hangzhou"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"c":17}'},
        {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]})
    assert items_to_messages(request.input) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Hangzhou?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Hangzhou"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": '{"c":17}', "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "tool", "content": "noon", "tool_call_id": "call_2", "name": "get_time"},
    ]


@pytest.mark.parametrize("fields", [
    {"temperature": 0}, {"temperature": 2}, {"max_output_tokens": 1}, {"stream": False},
    {"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"store": False},
    {"extensions": {}}, {"previous_response_id": "resp_1", "input": []},
])
def test_valid_requests(fields):
    validate_responses_request({"model": "m", "input": [{"role": "user", "content": "x"}], **fields})

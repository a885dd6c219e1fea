"""Responses as OpenAI's Responses API writes them: response objects and stream events.

An LMSP response (events.ResponseRun) and an OpenAI one hold the same things; OpenAI's
repeats the request (instructions, tools, metadata...: the `echo`), gives every item a
`status`, and streams more, finer events. `response_object` is the one place that turns
an LMSP response object into an OpenAI one; `ResponseEvents` turns LMSP events into
OpenAI events, and builds its response objects with `response_object` from the LMSP
response its events describe, so a stream, a synchronous reply and a stored response
always agree.

The stream is what the openai SDK's `responses.stream()` expects (its
lib/streaming/responses reads it): every event's data has its `type` and a
`sequence_number` from 0; `response.created` and `response.in_progress` carry the
whole response (output empty), a final event the final one; an item is announced by
`response.output_item.added`, its text part by `response.content_part.added`, before
any `response.output_text.delta` (with `item_id`, `output_index`, `content_index`), and
each is closed by its `.done` event; a call's arguments come as one
`response.function_call_arguments.delta` then `.done` (LMSP gives a call whole).
The events depend only on the LMSP events, the echo and the moment the response ended
(a task's `ended_at`, written with its final event), so replaying a background response's
log from its start gives the same events, sequence numbers included.
"""

from typing import Callable

from lmsp_min.events import add_text, compact_json
from lmsp_min import sse
from lmsp_min.openai_dialect.errors import response_error

ECHO_DEFAULTS = {
    "background": False, "instructions": None, "max_output_tokens": None, "max_tool_calls": None,
    "metadata": {}, "parallel_tool_calls": True, "previous_response_id": None,
    "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "store": False,
    "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
    "top_p": 1.0, "truncation": "disabled", "user": None, "prompt_cache_key": None, "safety_identifier": None,
}


def echo_of(body: dict, *, store: bool, background: bool = False) -> dict:
    """What a response object repeats of the request that made it (`body` was validated;
    a task created through /lmsp/v1 has an LMSP body, read the same way where it can be)."""
    echo = dict(ECHO_DEFAULTS, store=store, background=background)
    for name in ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "previous_response_id",
                 "temperature", "tool_choice", "tools", "top_p", "user", "prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None:
            echo[name] = body[name]
    if isinstance(body.get("reasoning"), dict):  # (its effort is refused: only its summary can be asked)
        echo["reasoning"] = {"effort": None, "summary": body["reasoning"].get("summary")}
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        echo["text"] = {"format": fmt}
    return echo


def usage(lmsp: dict | None) -> dict | None:
    """LMSP usage with OpenAI's details, each of which the SDK requires. The engine counts
    neither reasoning tokens apart nor cache writes (its prefix cache keeps whole finished
    sequences, nothing a client pays to write): both are 0."""
    if lmsp is None:
        return None
    cached = lmsp.get("input_tokens_details", {}).get("cached_tokens", 0)
    return {**lmsp, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def text_part(text: str, logprobs: list[dict] = ()) -> dict:
    """An output_text part; `logprobs`: its tokens', when the request included them (events.py)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs)}


def output_item(item: dict, status: str) -> dict:
    """An LMSP output item as OpenAI's (the same ids and text, with a `status`)."""
    kind = item["type"]
    if kind == "message":
        return {"id": item["id"], "type": "message", "status": status, "role": "assistant",
                "content": [text_part(part["text"], part.get("logprobs", ())) for part in item["content"]]}
    if kind == "function_call":
        return {"id": item["id"], "type": "function_call", "status": status, "call_id": item["call_id"],
                "name": item["name"], "arguments": item["arguments"]}
    if kind == "reasoning":
        return {"id": item["id"], "type": "reasoning", "status": status,
                "summary": [{"type": "summary_text", "text": part["text"]} for part in item["summary"]]}
    return item


def response_object(lmsp: dict, echo: dict, ended_at: float | None = None) -> dict:
    """An LMSP response object (6.2) as OpenAI's. Items before the last are complete; the
    last is complete once the response is, and `incomplete` when the response is (LMSP
    gives out only whole calls: a function_call is always complete). `completed_at` is
    `ended_at` (LMSP has no such field), given only to a completed response, as OpenAI does."""
    status = lmsp["status"]
    last = {"completed": "completed", "incomplete": "incomplete", "failed": "incomplete",
            "cancelled": "incomplete"}.get(status, "in_progress")
    items = lmsp["output"]
    output = [output_item(item, "completed" if index < len(items) - 1 or item["type"] == "function_call" else last)
              for index, item in enumerate(items)]
    return {
        "id": lmsp["id"], "object": "response", "created_at": lmsp["created_at"], "status": status,
        "completed_at": int(ended_at) if status == "completed" and ended_at is not None else None,
        "background": echo["background"], "error": response_error(lmsp.get("error")),
        "incomplete_details": lmsp.get("incomplete_details"), "instructions": echo["instructions"],
        "max_output_tokens": echo["max_output_tokens"], "max_tool_calls": echo["max_tool_calls"],
        "metadata": echo["metadata"], "model": lmsp["model"], "output": output,
        "parallel_tool_calls": echo["parallel_tool_calls"], "previous_response_id": echo["previous_response_id"],
        "reasoning": echo["reasoning"], "service_tier": echo["service_tier"], "store": echo["store"],
        "temperature": echo["temperature"], "text": echo["text"], "tool_choice": echo["tool_choice"],
        "tools": echo["tools"], "top_p": echo["top_p"], "truncation": echo["truncation"],
        "usage": usage(lmsp.get("usage")), "user": echo["user"], "prompt_cache_key": echo["prompt_cache_key"],
        "safety_identifier": echo["safety_identifier"],
    }


def input_items(items: list[dict], response_id: str) -> list[dict]:
    """Stored input items as OpenAI lists them: each with an id (its own, or one made from
    its place, the same every time) and a `status`, a message's content as parts (an
    assistant's text parts with their `annotations`), as the SDK's item types require."""
    listed = []
    for index, item in enumerate(items):
        item = {"id": f"item_{response_id.removeprefix('resp_')}_{index}", "status": "completed", **item}
        if item.get("type", "message") == "message":
            content = item["content"]
            if item["role"] == "assistant":
                parts = [{"type": "output_text", "text": content}] if isinstance(content, str) else content
                content = [{"annotations": [], **part} if part.get("type") == "output_text" else part
                           for part in parts]
            elif isinstance(content, str):
                content = [{"type": "input_text", "text": content}]
            item = {**item, "type": "message", "content": content}
        listed.append(item)
    return listed


def is_openai_object(body: dict) -> bool:
    """Whether a stored response was stored by this dialect (it repeats its request)."""
    return "tool_choice" in body


def event_message(event: dict) -> bytes:
    """An OpenAI event as its SSE message: named by its type, no id (sequence_number is its place)."""
    return sse.message(compact_json(event), event=event["type"])


class ResponseEvents:
    """The OpenAI events of one response, from its LMSP events (`translate`, in order)."""

    def __init__(self, response_id: str, created_at: int, model: str, echo: dict, ended_at: Callable[[], float]):
        self.echo = echo
        self._ended_at = ended_at  # when the response ended, read at its final event
        self.completed_at: float | None = None
        # the LMSP response object as the events so far describe it
        self.lmsp = {"id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
                     "model": model, "output": [], "usage": None, "error": None, "incomplete_details": None}
        self._by_id: dict[str, tuple[int, dict]] = {}  # item id -> (output index, the LMSP item)
        self._held: tuple[int, dict] | None = None  # a text item whose .done events wait (_output_item_done)
        self._next = 0

    def response(self) -> dict:
        return response_object(self.lmsp, self.echo, self.completed_at)

    def _event(self, kind: str, **data) -> dict:
        event = {"type": kind, "sequence_number": self._next, **data}
        self._next += 1
        return event

    def translate(self, name: str, data: dict) -> list[dict]:
        """The OpenAI events for one LMSP event (its name and data)."""
        handler = _HANDLERS.get(name)
        if handler is None:
            raise ValueError(f"unexpected LMSP event {name!r}")
        events = []
        if self._held is not None:
            (index, item), self._held = self._held, None
            events = self._item_done(index, item, "incomplete" if name == "response.incomplete" else "completed")
        return events + handler(self, data)

    def _created(self, data: dict) -> list[dict]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def _output_item_added(self, data: dict) -> list[dict]:
        index, item = data["output_index"], _fresh(data["item"])
        self.lmsp["output"][len(self.lmsp["output"]):index + 1] = [item]
        self._by_id[item["id"]] = (index, item)
        events = [self._event("response.output_item.added", output_index=index,
                              item=output_item(item, "in_progress"))]
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            item["content"].append({"type": "output_text", "text": ""})
            events.append(self._event("response.content_part.added", **where, content_index=0, part=text_part("")))
        elif item["type"] == "reasoning":
            item["summary"].append({"type": "summary_text", "text": ""})
            events.append(self._event("response.reasoning_summary_part.added", **where, summary_index=0,
                                      part={"type": "summary_text", "text": ""}))
        return events

    def _output_text_delta(self, data: dict) -> list[dict]:
        index, item = self._by_id[data["item_id"]]
        add_text(item, data["delta"])
        return [self._event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                            delta=data["delta"], logprobs=data.get("logprobs", []))]

    def _reasoning_summary_text_delta(self, data: dict) -> list[dict]:
        index, item = self._by_id[data["item_id"]]
        add_text(item, data["delta"])
        return [self._event("response.reasoning_summary_text.delta", item_id=item["id"], output_index=index,
                            summary_index=0, delta=data["delta"])]

    def _output_item_done(self, data: dict) -> list[dict]:
        """A text item's `.done` events wait for the next LMSP event, which says whether the
        token budget cut it (`response.incomplete` follows at once): their item's status."""
        index, item = data["output_index"], data["item"]
        self.lmsp["output"][index] = item
        self._by_id[item["id"]] = (index, item)
        if item["type"] in ("message", "reasoning"):
            self._held = (index, item)
            return []
        return self._item_done(index, item, "completed")

    def _item_done(self, index: int, item: dict, status: str) -> list[dict]:
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            logprobs = [entry for part in item["content"] for entry in part.get("logprobs", ())]
            events += [self._event("response.output_text.done", **where, content_index=0, text=text,
                                   logprobs=logprobs),
                       self._event("response.content_part.done", **where, content_index=0,
                                   part=text_part(text, logprobs))]
        elif item["type"] == "reasoning":
            text = "".join(part["text"] for part in item["summary"])
            part = {"type": "summary_text", "text": text}
            events += [self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                       self._event("response.reasoning_summary_part.done", **where, summary_index=0, part=part)]
        elif item["type"] == "function_call":
            events += [self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                       self._event("response.function_call_arguments.done", **where, name=item["name"],
                                   arguments=item["arguments"])]
        events.append(self._event("response.output_item.done", output_index=index, item=output_item(item, status)))
        return events

    def _final(self, kind: str, data: dict) -> list[dict]:
        self.lmsp["status"] = data["status"]
        self.completed_at = self._ended_at()
        for name in ("usage", "error", "incomplete_details"):
            if name in data:
                self.lmsp[name] = data[name]
        return [self._event(kind, response=self.response())]

    def _completed(self, data: dict) -> list[dict]:
        return self._final("response.completed", data)

    def _incomplete(self, data: dict) -> list[dict]:
        return self._final("response.incomplete", data)

    def _failed(self, data: dict) -> list[dict]:
        return self._final("response.failed", data)

    def _cancelled(self, data: dict) -> list[dict]:
        # (OpenAI's API names no event for it; its response's status is `cancelled`)
        return self._final("response.cancelled", data)

    def _error(self, data: dict) -> list[dict]:
        """The stream cannot go on (not the response's own failure): OpenAI's error event."""
        error = data["error"]
        return [self._event("error", code=error.get("code"), message=error.get("detail", ""),
                            param=error.get("param"))]


# LMSP event name -> what it becomes
_HANDLERS = {
    "response.created": ResponseEvents._created,
    "response.output_item.added": ResponseEvents._output_item_added,
    "response.output_text.delta": ResponseEvents._output_text_delta,
    "response.reasoning_summary_text.delta": ResponseEvents._reasoning_summary_text_delta,
    "response.output_item.done": ResponseEvents._output_item_done,
    "response.completed": ResponseEvents._completed,
    "response.incomplete": ResponseEvents._incomplete,
    "response.failed": ResponseEvents._failed,
    "response.cancelled": ResponseEvents._cancelled,
    "error": ResponseEvents._error,
}


def _fresh(item: dict) -> dict:
    """An added item with lists of its own, which the deltas then fill (the event's data stays as it was)."""
    return {key: [dict(part) for part in value] if isinstance(value, list) else value for key, value in item.items()}

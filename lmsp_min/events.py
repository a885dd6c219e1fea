"""Response objects and their events (docs/protocol.md §6.2, §6.3, §6.5).

`ResponseRun.events()` is the one place LMSP events come from: it turns the
engine's chat events (TextDelta, ReasoningDelta, ToolCall, Finished) into
numbered LMSP events while building the response object. A synchronous request
drains it and returns `response_object()`; a stream writes each event as SSE the
moment it is yielded; a task appends each one to its log.

The event sequence it produces, for a reasoning model answering in text:

    1 response.created
    2 response.output_item.added      reasoning item
    3 response.reasoning_summary_text.delta ...
    4 response.output_item.done       reasoning item
    5 response.output_item.added      message item (content [])
    6 response.output_text.delta ...
    7 response.output_item.done       message item, the full text
    8 response.completed | response.incomplete | response.failed

and for a tool call (the engine gives out whole calls): output_item.added
(arguments ""), then output_item.done (the complete call). Ids count from 1
and only grow.

A response that asked for log probabilities (`logprobs`: extensions.lmsp-min.logprobs)
has a `logprobs` array on each `response.output_text.delta`, the tokens whose text
that delta first gives out, and on the message's output_text part, all of them; each
entry is OpenAI's {token, logprob, bytes, top_logprobs} (docs/protocol.md). A token
whose text never reaches the message text (reasoning, a tool call, a stop sequence)
is not reported.

Reading the request path: lmsp_min/generation.py hands `events()` the engine's
chat events (engine/api.py's types, from engine/chat.py `generate_chat`); what it
yields goes back to generation.py's pump, then to a face, which frames it as SSE
(lmsp_min/sse.py), or to lmsp_min/tasks.py's log.
"""

import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from engine.api import Finished, ReasoningDelta, TextDelta, TokenLogprob, ToolCall
from lmsp_min.problems import Problem, shutting_down

FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed",
                "response.cancelled", "error")

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


class ServiceStopping(Exception):
    """The service stopped before this response ended (see generation.GenerationsInProgress)."""


def new_id(prefix: str) -> str:
    """`prefix_` + a ULID: 48 bits of milliseconds then 80 random bits, Crockford base32.

    Unique without coordination, and ids made later sort later.
    """
    value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return f"{prefix}_{''.join(reversed(chars))}"


def compact_json(data: dict) -> str:
    """An event's data as the streams send it and the task logs keep it."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class Event:
    """One LMSP event: its sequence number, name and data object."""

    id: int
    name: str
    data: dict

    @property
    def is_final(self) -> bool:
        return self.name in FINAL_EVENTS


class ResponseRun:
    """One response being generated: its state, and the events that build it."""

    def __init__(self, model_id: str, *, response_id: str | None = None, log=None, counts=None,
                 logprobs: bool = False, created_at: int | None = None, item_ids=new_id):
        self.id = response_id or new_id("resp")
        self.model_id = model_id
        self.created_at = int(time.time()) if created_at is None else created_at
        # makes the ids of output items and calls from a prefix ("msg"): a continuation's (a task
        # taken over) gives again those its log holds
        self._new_id = item_ids
        self.status = "in_progress"
        self.output: list[dict] = []
        self.usage: dict | None = None
        self.error: dict | None = None
        self.incomplete_details: dict | None = None
        self._log = log
        # the engine's token counts of this response (engine.chat.TokenCounts), which grow
        # as it is generated: the usage of a response that ends before the engine's Finished
        self._counts = counts
        self._last_id = 0
        self._open: dict | None = None  # the reasoning or message item receiving deltas
        self._call_ids: set[str] = set()
        self.logprobs = logprobs  # the request asked for them
        self._pending: list[dict] = []  # logprob entries of tokens whose text has not come yet

    def response_object(self) -> dict:
        """The response object of 6.2, as it stands now."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": self.model_id,
            "output": self.output,
            "usage": self.usage,
            "error": self.error,
            "incomplete_details": self.incomplete_details,
        }

    # -- building events ------------------------------------------------------

    def _event(self, name: str, **data) -> Event:
        self._last_id += 1
        return Event(self._last_id, name, {"response_id": self.id, **data})

    def _add_item(self, item: dict) -> Event:
        self.output.append(item)
        return self._event("response.output_item.added", output_index=len(self.output) - 1,
                           item=_snapshot(item))

    def _done_item(self, item: dict) -> Event:
        return self._event("response.output_item.done", output_index=self.output.index(item),
                           item=_snapshot(item))

    def _close_open(self) -> list[Event]:
        if self._open is None:
            return []
        item, self._open = self._open, None
        return [self._done_item(item)]

    def _text_item(self, kind: str) -> list[Event]:
        """Make sure a `kind` item ("message" or "reasoning") is open; events that opens it."""
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close_open()
        if kind == "message":
            item = {"id": self._new_id("msg"), "type": "message", "role": "assistant", "content": []}
        else:
            item = {"id": self._new_id("rs"), "type": "reasoning", "summary": []}
        events.append(self._add_item(item))
        self._open = item
        return events

    def _text_delta(self, kind: str, text: str) -> list[Event]:
        events = self._text_item(kind)
        item = self._open
        add_text(item, text)
        entries, self._pending = self._pending, []  # (a reasoning delta's tokens are not reported)
        if kind == "message" and self.logprobs:
            item["content"][0].setdefault("logprobs", []).extend(entries)
            events.append(self._event("response.output_text.delta", item_id=item["id"], delta=text,
                                      logprobs=entries))
            return events
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_summary_text.delta"
        events.append(self._event(name, item_id=item["id"], delta=text))
        return events

    def _call(self, name: str, arguments: str) -> list[Event]:
        """A whole function_call item: added (arguments ""), then done."""
        events = self._close_open()
        call_id = self._new_id("call")
        while call_id in self._call_ids:  # unique within the response, whatever the clock
            call_id = self._new_id("call")
        self._call_ids.add(call_id)
        item = {"id": self._new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
                "arguments": ""}
        events.append(self._add_item(item))
        item["arguments"] = arguments
        events.append(self._done_item(item))
        return events

    def _finish(self, reason: str, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> list[Event]:
        events = self._close_open()
        if not self.output:
            # Nothing was generated (an immediate end of turn): the answer is an
            # empty message, so that clients always find one.
            item = {"id": self._new_id("msg"), "type": "message", "role": "assistant", "content": []}
            events.append(self._add_item(item))
            item["content"].append({"type": "output_text", "text": "", **({"logprobs": []} if self.logprobs else {})})
            events.append(self._done_item(item))
        self.usage = usage(input_tokens, output_tokens, cached_tokens)
        if reason == "length":
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
            events.append(self._event("response.incomplete", status=self.status,
                                      incomplete_details=self.incomplete_details, usage=self.usage))
        else:
            self.status = "completed"
            events.append(self._event("response.completed", status=self.status, usage=self.usage))
        return events

    # -- the generator ----------------------------------------------------------

    async def events(self, chat_events: AsyncIterator) -> AsyncIterator[Event]:
        """Every LMSP event of this response, from `response.created` to a final event.

        An exception out of the engine ends the response `failed` (with a
        `generation_failed` problem; the traceback goes to the log, never to
        the client), except two that say what happened: a Problem (the caller's
        reading of an engine error, such as a schema whose bound only the output
        reaches) is the response's error as it is, and a stopping service is
        `model_unavailable`. Cancellation is not caught: the caller decides what it
        means (a stream whose client left; a task cancelled, see `cancelled`).
        """
        yield self._event("response.created", status="in_progress")
        try:
            async with aclosing(chat_events) as chat:
                async for chat_event in chat:
                    kind = type(chat_event)
                    if kind is TextDelta:
                        batch = self._text_delta("message", chat_event.text) if chat_event.text else []
                    elif kind is ReasoningDelta:
                        batch = self._text_delta("reasoning", chat_event.text) if chat_event.text else []
                    elif kind is TokenLogprob:
                        self._pending.append(logprob_entry(chat_event))
                        batch = []
                    elif kind is ToolCall:
                        self._pending = []  # (a call's tokens are not reported)
                        batch = self._call(chat_event.name, chat_event.arguments)
                    elif kind is Finished:
                        batch = self._finish(chat_event.reason, chat_event.input_tokens,
                                             chat_event.output_tokens, chat_event.cached_tokens)
                    else:
                        raise TypeError(f"unexpected engine event {chat_event!r}")
                    for event in batch:
                        yield event
                    if kind is Finished:
                        return
            raise RuntimeError("the engine's generation ended without a Finished event")
        except ServiceStopping:
            yield self.failed(shutting_down())
        except Problem as problem:
            yield self.failed(problem)
        except Exception as exc:
            if self._log is not None:
                self._log(f"error: generation of {self.id} failed: {type(exc).__name__}: {exc}")
            yield self.failed(Problem("generation_failed", "the model failed while generating the response"))

    def failed(self, problem: Problem) -> Event:
        """End the response `failed` with `problem`; the final event. Its usage is what
        the engine had counted (the event's data, 6.3, has none)."""
        self.status = "failed"
        self.error = problem.to_dict()
        self.usage = self.usage_so_far()
        return self._event("response.failed", status=self.status, error=self.error)

    def cancelled(self) -> Event:
        """End the response `cancelled` (a task stopped by its client, a stored stream whose
        client left); the final event. Its usage is what the engine had counted (the event's
        data, 6.3, has none)."""
        self.status = "cancelled"
        self.usage = self.usage_so_far()
        return self._event("response.cancelled", status=self.status)

    def usage_so_far(self) -> dict | None:
        """The usage of this response from the engine's counts as they stand: the whole
        input, and the output tokens generated until now. None without counts (a run
        the engine never prepared)."""
        if self._counts is None:
            return None
        return usage(self._counts.input_tokens, self._counts.output_tokens, self._counts.cached_tokens)

    def error_event(self, problem: Problem) -> Event:
        """An `error` event: the stream cannot go on for a reason not tied to the response."""
        self._last_id += 1
        return Event(self._last_id, "error", {"error": problem.to_dict()})


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """A response object's `usage` (6.2). input_tokens_details.cached_tokens: how much of
    the input the prefix cache supplied (its KV was reused, not recomputed)."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens}}


def logprob_entry(logprob: TokenLogprob) -> dict:
    """A token's log probability as OpenAI writes it: {token, logprob, bytes, top_logprobs}."""
    def token(piece: bytes, value: float) -> dict:
        return {"token": piece.decode("utf-8", "replace"), "logprob": value, "bytes": list(piece)}
    return {**token(logprob.piece, logprob.logprob),
            "top_logprobs": [token(piece, value) for _, piece, value in logprob.top]}


def add_text(item: dict, text: str) -> None:
    """Append a delta's text to a message item (its output_text) or a reasoning item (its summary_text)."""
    if item["type"] == "message":
        parts, empty = item["content"], {"type": "output_text", "text": ""}
    else:
        parts, empty = item["summary"], {"type": "summary_text", "text": ""}
    if not parts:
        parts.append(empty)
    parts[0]["text"] += text


def _snapshot(item: dict) -> dict:
    """A deep copy of an output item as it is now (events must not change afterwards)."""
    return json.loads(json.dumps(item))

"""Chat: from a list of messages to a stream of events, what the server uses.

`model.prepare_chat(request)` does everything that can fail before a token is
generated, synchronously: it renders the chat template, tokenizes the result
(special tokens in the template text are parsed as such, never in the messages'
text) and checks that the
input and the requested output fit the context window (decision D4). Then
`model.generate_chat(prepared)` is an async generator of events: TextDelta,
ReasoningDelta, ToolCall (see below), Finished always last. These values, the request
and the prepared chat are plain types of engine/api.py, what the server exchanges with
this module.

The tokens are counted as they go, in `prepared.counts` (TokenCounts): the input
when prepared, the output after each generated token. A consumer that stops the
generation early (a cancel, a failure) reads there what was consumed until then.

Tools and structured output are enforced while decoding (engine/tools.py,
engine/constrain/): prepare_chat renders the tools into the prompt and compiles
the constraint (a schema it cannot enforce raises SchemaError there), and
generate_chat splits the output into TextDelta and ToolCall events (and the text
around the calls into ReasoningDelta and TextDelta, for a model that reasons). The
output budget closes a call (or a document) before max_tokens cuts it (Finished
"length", the call whole); one that only repeats a call before it is dropped instead,
and the response finished ("stop"). A call is never given out half-made.
With `json_schema` the message text is one JSON document valid for the schema (and
no reasoning: a thought the template opens is closed empty in the prompt).
Stop sequences apply to what is not constrained: without tools they end the raw
output; with tools, the message text only (`MessageStop`: a call is never cut);
with `json_schema` they are not applied (they could cut the document; the server
refuses the combination). With tools and `json_schema` both, the output is calls or
the document, as the grammar decides at its first byte (engine/tools.py).

With `sampling.logprobs`, each generated token's `TokenLogprob` comes before the events
of its text. `prepare_text` prepares a raw prompt (text or token ids) without the chat
template, for a plain completion: `generate_chat` generates it as any other.

Reading the request path: lmsp_min/generation.py calls both; `generate_chat` reads the
tokens of engine/generate.py's `Generation`, and its events go to
lmsp_min/events.py (`ResponseRun.events`).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import replace

from .api import ChatRequest, Finished, PreparedChat, ReasoningDelta, TextDelta, ToolCall
from .errors import ContextLengthExceeded, PromptError, SchemaError
from .generate import StopFilter
from .sampling import token_logprob
from .tools import ToolCallParser, output_field, plan_output

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Literals:
    """Marks the special-token text in a client's strings, so that once the template has
    rendered them it can be found again and tokenized as text.

    Each occurrence is wrapped in a pair of marks made of a random nonce (ASCII, which
    a template's `tojson` leaves as it is): a client cannot write, forge or cancel a
    mark, and a template that cuts a message (`content.split(...)`) keeps or drops
    both marks of an occurrence together. Only occurrences are marked, so every other
    string renders exactly as before.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        nonce = secrets.token_hex(8)
        self.open, self.close = f"[[lmsp-{nonce}[[", f"]]lmsp-{nonce}]]"

    def mark(self, value):
        """`value` (a string, or lists and dicts of them, keys included) with special-token
        text marked; a call's `arguments` given as a JSON string is marked inside, as an object."""
        if isinstance(value, str):
            return self._mark_text(value)
        if isinstance(value, list):
            return [self.mark(item) for item in value]
        if isinstance(value, dict):
            return {self.mark(key): self._mark_arguments(item) if key == "arguments" else self.mark(item)
                    for key, item in value.items()}
        return value

    def _mark_arguments(self, arguments):
        """A call's arguments, marked: a JSON string that holds special-token text is marked
        as the object it encodes (a mark inside a JSON string would be escaped away)."""
        if not isinstance(arguments, str):
            return self.mark(arguments)
        if not any(special for _, special in self.tokenizer.special_text_parts(arguments)):
            return arguments  # (as _mark_text would, having looked for them again)
        return self.mark(json.loads(arguments))

    def _mark_text(self, text: str) -> str:
        parts = self.tokenizer.special_text_parts(text)
        if not any(special for _, special in parts):
            return text
        return "".join(f"{self.open}{part}{self.close}" if special else part for part, special in parts)

    def find(self, rendered: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered prompt without the marks, and the (start, end) spans they enclosed.
        A mark opened and never closed (a template that cut inside one) reads to the end."""
        text: list[str] = []
        spans: list[tuple[int, int]] = []
        at, start = 0, None
        for piece in re.split(f"({re.escape(self.open)}|{re.escape(self.close)})", rendered):
            if piece == self.open:
                start = at if start is None else start
            elif piece == self.close:
                if start is not None:
                    spans.append((start, at))
                start = None
            else:
                text.append(piece)
                at += len(piece)
        if start is not None:
            spans.append((start, at))
        return "".join(text), spans


def prepare_chat(model, request: ChatRequest) -> PreparedChat:
    """Render, tokenize and check a chat request; raises before any generation starts."""
    # what a client wrote that spells a control token ("<|im_end|>") is text, not that
    # token: it could otherwise close its turn and forge another (prompt injection)
    literals = Literals(model.tokenizer)
    plan = plan_output(model, replace(request, messages=literals.mark(request.messages)), literals.mark)
    marked = model.apply_chat_template(plan.messages, add_generation_prompt=True, tools=plan.template_tools)
    prompt, spans = literals.find(marked)
    opens_thought = prompt.rstrip().endswith(THINK_OPEN)
    reasoning = "reasoning" in model.info.capabilities and request.json_schema is None
    if request.json_schema is not None and opens_thought:
        # the schema leaves no room for a thought (the whole output is the document): the
        # opened one is closed empty, as a template's no-thinking mode does (Qwen3)
        prompt += "\n" + THINK_CLOSE + "\n\n"
    prompt_ids = model.tokenizer.encode(prompt, add_special=True, parse_special=True, literal_spans=spans)
    max_tokens = _max_tokens(model, request, prompt_ids)
    if plan.constraint is not None:  # (refused here, before any token: OutputBudgetTooSmall)
        plan.constraint.limit(max_tokens)
    starts_in_reasoning = reasoning and opens_thought
    return PreparedChat(request, prompt, prompt_ids, max_tokens, reasoning, starts_in_reasoning,
                        plan.constraint, plan.tool_calls)


def prepare_text(model, prompt: str | list[int], request: ChatRequest) -> PreparedChat:
    """A raw prompt prepared as `prepare_chat` prepares messages (`request.messages` is not
    read), without a template: text tokenized as llama-server's /completion does (the
    model's BOS first, special-token text parsed: the client writes the whole prompt), or
    token ids as they are. No tools, no reasoning split: the output is text."""
    if isinstance(prompt, str):
        prompt_ids = model.tokenizer.encode(prompt, add_special=True, parse_special=True)
    else:
        prompt_ids, n_vocab = [int(i) for i in prompt], model.tokenizer.n_vocab
        if any(not 0 <= i < n_vocab for i in prompt_ids):
            raise PromptError(f"a token id of the prompt is outside the vocabulary (0 to {n_vocab - 1})")
        prompt = model.tokenizer.decode(prompt_ids)
    if not prompt_ids:
        raise PromptError("the prompt has no token (the model adds no BOS to an empty text)")
    return PreparedChat(request, prompt, prompt_ids, _max_tokens(model, request, prompt_ids), False, False)


def _max_tokens(model, request: ChatRequest, prompt_ids: list[int]) -> int:
    """The request's output budget, resolved: the context window checked (D4), the rest
    of it when the request sets none."""
    n_ctx = model.n_ctx
    if request.max_tokens is not None and request.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if len(prompt_ids) >= n_ctx or len(prompt_ids) + (request.max_tokens or 0) > n_ctx:
        raise ContextLengthExceeded(len(prompt_ids), request.max_tokens or 0, n_ctx)
    return request.max_tokens if request.max_tokens is not None else n_ctx - len(prompt_ids)


async def generate_chat(model, prepared: PreparedChat):
    """The events of one chat completion (see the module docstring)."""
    request = prepared.request
    constraint = prepared.constraint
    generation = model.generate(prepared.prompt_ids, max_tokens=prepared.max_tokens, sampling=request.sampling,
                                stop=() if constraint is not None else request.stop, constraint=constraint,
                                continuation=prepared.continuation)
    splitter = ReasoningSplitter(prepared.starts_in_reasoning) if prepared.reasoning else None
    calls = ToolCallParser(leading=request.json_schema is not None) if prepared.tool_calls else None
    output = OutputSplitter(calls, splitter)
    message_stop = MessageStop(request.stop) if prepared.tool_calls and request.stop else None
    counts = prepared.counts

    budget = BudgetWatch(constraint, calls)

    def stopped() -> bool:  # by a stop sequence of the message text, or a call the model repeated
        return message_stop is not None and message_stop.stopped or output.repeated_call or budget.closed_repeat

    try:
        async for token in generation:
            counts.update(generation)
            if budget.check(token.id):
                break
            if token.logprob is not None:
                yield token_logprob(model.tokenizer, token.id, token.logprob)
            events = output.feed(token.text)
            for event in message_stop.apply(events) if message_stop else events:
                yield event
            if stopped():
                break
        else:
            budget.check()
            events = output.finish(complete=generation.finish_reason == "stop")
            if message_stop:
                events = message_stop.apply(events) + message_stop.flush()
            for event in events:
                yield event
    except SchemaError as e:  # a bound only the output reached: in the schema it is writing
        e.field = e.field or output_field(request, bytes(constraint.text))
        raise
    finally:
        counts.update(generation)  # (an end-of-turn token is never yielded; as the first, it brings cached_tokens)
        await generation.aclose()
    # (stopped perhaps in the last token allowed: "stop" all the same)
    yield Finished("stop" if stopped() else generation.finish_reason or "stop", counts.input_tokens,
                   counts.output_tokens, cached_tokens=counts.cached_tokens)


class BudgetWatch:
    """Whether the output budget closed only a repeat of a call: then the response ends
    before it, finished (engine/tools.py `ToolCallParser.repeating`). Judged once, on the
    text before the first token the budget refused the model (so before the token at
    that point, or at the end: the budget may have left the model only its end token)."""

    def __init__(self, constraint, calls: ToolCallParser | None):
        self.constraint = constraint
        self.calls = calls
        self.written = 0  # bytes of the tokens the parser has read
        self.judged: bool | None = None  # None: not yet

    @property
    def closed_repeat(self) -> bool:
        return bool(self.judged)

    def check(self, token_id: int | None = None) -> bool:
        """Has the budget closed only a repeat, judged before `token_id` (None: at the end)?"""
        if self.calls is None:
            return False
        at = self.constraint.squeezed_at
        if self.judged is None and at is not None and (token_id is None or self.written >= at):
            self.judged = self.calls.repeating
        if token_id is not None:
            self.written += len(self.constraint.grammar.index.token_bytes[token_id])
        return self.closed_repeat


class ReasoningSplitter:
    """Routes text inside <think>...</think> to ReasoningDelta, the rest to TextDelta.

    A tag may arrive split across tokens, so text that could be the start of the
    next tag is held back (a StopFilter on that tag) until it is known.
    """

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self.tag = StopFilter((THINK_CLOSE,) if in_reasoning else (THINK_OPEN,))

    def feed(self, text: str) -> list[TextDelta | ReasoningDelta]:
        events = []
        while text:
            out = self.tag.feed(text)
            text = ""
            if self.tag.stopped:  # the tag appeared: what follows it belongs to the other side
                rest = self.tag.rest
                self._emit(out, events)
                self.in_reasoning = not self.in_reasoning
                self.tag = StopFilter((THINK_CLOSE,) if self.in_reasoning else (THINK_OPEN,))
                text = rest
            else:
                self._emit(out, events)
        return events

    def flush(self) -> list[TextDelta | ReasoningDelta]:
        events = []
        self._emit(self.tag.flush(), events)
        return events

    def _emit(self, text: str, events: list) -> None:
        if text:
            events.append(ReasoningDelta(text) if self.in_reasoning else TextDelta(text))


class MessageStop:
    """Stop sequences over the message text of a response with tools: a stop ends the
    response where it begins in the text, and a call is never cut (calls pass through,
    after whatever text was held back as a possible stop: it was not one)."""

    def __init__(self, stop: tuple[str, ...]):
        self.filter = StopFilter(stop)

    @property
    def stopped(self) -> bool:
        return self.filter.stopped

    def apply(self, events: list) -> list:
        out = []
        for event in events:
            if self.filter.stopped:
                break  # nothing after a stop sequence is given out
            is_text = isinstance(event, TextDelta)
            out += self._text(self.filter.feed(event.text) if is_text else self.filter.flush())
            if not is_text:
                out.append(event)
        return out

    def flush(self) -> list:
        return self._text(self.filter.flush())

    @staticmethod
    def _text(text: str) -> list:
        return [TextDelta(text)] if text else []


class OutputSplitter:
    """Generated text -> chat events: tool calls are parsed out first (when the request has
    tools), then the text around them is split into reasoning and message text (for models
    that reason), so that a thought is never message text, with tools or without (D4)."""

    def __init__(self, calls: ToolCallParser | None, reasoning: ReasoningSplitter | None):
        self.calls = calls
        self.reasoning = reasoning

    def feed(self, text: str) -> list[TextDelta | ReasoningDelta | ToolCall]:
        return self._events(self.calls.feed(text) if self.calls is not None else [text])

    @property
    def repeated_call(self) -> bool:
        """The model wrote a call it had already made: it is looping, the response ends."""
        return self.calls is not None and self.calls.repeated

    def finish(self, complete: bool) -> list[TextDelta | ReasoningDelta | ToolCall]:
        """The text held back at the end (`complete` False: a call cut off by max_tokens is dropped)."""
        events = self._events(self.calls.finish(complete=complete)) if self.calls is not None else []
        if self.reasoning is not None:
            events += self.reasoning.flush()
        return events

    def _events(self, parts: list) -> list[TextDelta | ReasoningDelta | ToolCall]:
        events = []
        for part in parts:
            if isinstance(part, str):
                if part:
                    events += self.reasoning.feed(part) if self.reasoning is not None else [TextDelta(part)]
            else:  # a call: the text held back before it comes first (no text follows a call)
                if self.reasoning is not None:
                    events += self.reasoning.flush()
                events.append(part)
        return events

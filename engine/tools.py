"""Tool calling: tools into the prompt, calls out of the generated text, valid by construction.

One call format is used for every model, the Hermes / Qwen 2.5 one::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- A chat template that takes `tools` (ChatTemplate.supports_tools) and writes this format
  (it mentions `<tool_call>`), including engine/chat_template.py's fallbacks, renders the
  tools, the assistant's `tool_calls` and the `tool` results itself: the model sees its own
  format.
- Any other template (SmolLM2's ChatML template has no tools; a Llama-3 style template
  expects another format) gets the generic rendering below: the tool list and the
  instruction in the system message, past calls written into the assistant text in the
  same format, and tool results as a user turn in plain words, "The tool result is
  {output}. Answer the question." (a 135M model echoes a `<tool_response>` block back
  instead of answering from it; with the plain sentence it answers).

While decoding, `tool_call_grammar` makes the calls valid: after `<tool_call>` the model can
only write `{"name": <a listed tool>, "arguments": <JSON valid for its parameters>}` and the
closing tag; several calls may follow each other (up to MAX_CALLS; one only when the
request says `parallel_tool_calls: false`), and nothing but calls after the first one.
`tool_choice`:

- "required": constrained from the first token, one call or more;
- {"name": N}: constrained from the first token, exactly one call, of N;
- "auto": free text until the model writes `<tool_call>`, then constrained;
- "none": the tools are not shown and `<tool_call>` can never be completed.

`allowed` (a request's `allowed_tools`) narrows the tools a call may name to those, under
any choice; all of them are still shown, so the prompt, and what the prefix cache holds
of it, does not change with the subset.

With a `json_schema` too (an agent with tools and a structured answer, D5), the message
text is one document valid for the schema: under "auto" the output is calls from its
first byte, or that document (`either_constraint`: no JSON document begins with the
opener's "<", so the first byte decides); under "required" or a named function calls
only, the schema never applies; under "none" the document only.

`ToolCallParser` turns the generated text into message text and complete calls; a call that
max_tokens cut off is not given out, and one that repeats an earlier one of the response
ends it (a small model repeats its call until the token limit). The output budget
(engine/constrain/matcher.py) closes a call before the limit; when it would close a repeat,
still word for word one of the calls before it (`repeating`), the response ends there as
finished (engine/chat.py): every call of it is the model's own and whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .api import ToolCall
from .constrain import (AnyOf, Budget, FreeText, Grammar, GrammarConstraint, Literal, Object, Repeat, Seq,
                        TokenIndex, compile_schema, json_constraint, schema_key, writes_objects)
from .errors import EngineError, SchemaError

OPENER = "<tool_call>"
CLOSER = "</tool_call>"
_JSON = json.JSONDecoder()
MAX_CALLS = 4  # calls in one response: a small model must not loop on calls forever

GENERIC_INSTRUCTIONS = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def uses_native_format(chat_template) -> bool:
    """Does this template render tools and tool calls in the `<tool_call>` format itself?"""
    return bool(getattr(chat_template, "supports_tools", False)) and OPENER in chat_template.source


def _arguments(call: dict) -> dict:
    args = call["function"].get("arguments", {})
    return json.loads(args) if isinstance(args, str) else args


def render_generic(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that knows nothing of tools (see the module docstring).

    `tools` None means none are shown (tool_choice "none"); history calls and results are
    still written out, so the model sees the conversation as it was.
    """
    out: list[dict] = []
    if tools:
        listing = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
        instructions = GENERIC_INSTRUCTIONS.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{instructions}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": instructions})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                f'{OPENER}\n{json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}, ensure_ascii=False)}\n{CLOSER}'
                for c in m["tool_calls"])
            text = m.get("content") or ""
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m["role"] == "tool":
            result = f"The tool result is {m.get('content', '')}."
            if out and out[-1].get("_tool_results"):  # several results: one user turn
                out[-1]["results"].append(result)
            else:
                out.append({"role": "user", "_tool_results": True, "results": [result]})
        else:
            out.append(m)
    return [{"role": "user", "content": " ".join(m["results"]) + " Answer the question."}
            if m.get("_tool_results") else m for m in out]


def check_tools(tools: list[dict], tool_choice, allowed=None) -> list[dict]:
    """The tools a call may use under `tool_choice`, among the `allowed` names (None: all);
    SchemaError for a bad tool or choice.

    SchemaError paths are relative to the `tools` list ("/0/parameters/...")."""
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names):
        raise SchemaError("tool names must be unique", "", "name")
    if allowed is not None:
        if not allowed:
            raise SchemaError("allowed_tools names no tool")
        for name in allowed:
            if name not in names:
                raise SchemaError(f"allowed_tools names {name!r}, which is not a listed tool")
        tools = [t for t in tools if t["name"] in allowed]
    if isinstance(tool_choice, dict):
        chosen = [t for t in tools if t["name"] == tool_choice.get("name")]
        if not chosen:
            raise SchemaError(f"tool_choice names {tool_choice.get('name')!r}, which is not "
                              f"{'an allowed' if allowed is not None else 'a listed'} tool")
        return chosen
    if tool_choice not in ("auto", "none", "required"):
        raise SchemaError(f"unknown tool_choice {tool_choice!r}")
    return tools


def _call_object(tools: list[dict], chosen: list[dict]):
    """`{"name": N, "arguments": {...}}` for each chosen tool, as alternatives. Every tool's
    parameters are compiled: one that cannot be enforced is refused whichever is chosen,
    named by its index in `tools`. They are one grammar, so they share one Budget (what
    128 tools cost is bounded as one schema's is)."""
    calls, budget = {}, Budget()
    for i, tool in enumerate(tools):
        params = tool.get("parameters")
        if params is None or params == {}:  # no parameters: an empty object
            params = {"type": "object", "properties": {}}
        try:
            args = compile_schema(params, budget)
        except SchemaError as e:
            raise SchemaError(f"tool {tool['name']!r}: {e}", f"/{i}/parameters{e.path}", e.keyword) from e
        if not writes_objects(args):
            raise SchemaError(f"tool {tool['name']!r}: its parameters allow arguments that are not a JSON object "
                              "(a function call's arguments are one)", f"/{i}/parameters")
        name = Literal([_compact(tool["name"]).encode()])
        calls[tool["name"]] = Object(["name", "arguments"], [name, args], ["name", "arguments"])
    return AnyOf([calls[tool["name"]] for tool in chosen])


def tool_call_grammar(tools: list[dict], tool_choice, parallel: bool = True, allowed=None):
    """The grammar of a whole response under `tool_choice` (see the module docstring);
    not `parallel`: one call at most; calls name only `allowed` tools (None: any)."""
    chosen = check_tools(tools, tool_choice, allowed)
    newline = Literal([b"", b"\n"])
    body = [newline, _call_object(tools, chosen), newline, Literal([CLOSER.encode()])]
    one = Seq([Literal([OPENER.encode()]), *body])
    more = [Repeat(Seq([newline, one]), 0, MAX_CALLS - 1)] if parallel else []
    if tool_choice == "none":
        return FreeText(OPENER.encode(), None)
    if tool_choice == "auto":
        return FreeText(OPENER.encode(), Seq([*body, *more]))
    if tool_choice == "required":
        return Seq([one, *more])
    return one  # a named function: called once


@dataclass
class OutputPlan:
    """How a chat request's output is shaped: what the template gets, what constrains decoding."""

    messages: list[dict]                   # for the chat template
    template_tools: list[dict] | None      # `tools` for the chat template (native format only)
    constraint: GrammarConstraint | None
    tool_calls: bool                       # parse the output into text and tool calls


def plan_output(model, request, literal=lambda tools: tools) -> OutputPlan:
    """Tools / json_schema of a ChatRequest -> prompt messages and constraint; SchemaError early,
    its `field` saying which of the two the schema is in.

    `literal` marks the tools as they are shown in the prompt (chat.Literals.mark), not
    as the constraint reads them."""
    tools, schema, choice = request.tools, request.json_schema, request.tool_choice
    index = TokenIndex.of(model.tokenizer)
    # each is compiled as it would be alone, so that what cannot be enforced is refused by
    # name even where the choice leaves it unused
    parallel, allowed = request.parallel_tool_calls, request.allowed_tools
    calls = _in_field("tools", tool_constraint, tools, choice, index, parallel, allowed) if tools else None
    document = _in_field("json_schema", json_constraint, schema, index) if schema is not None else None
    if calls is not None and document is not None and choice == "auto":
        constraint = _in_field("json_schema", either_constraint, tools, schema, index, parallel, allowed)
    elif calls is not None and (document is None or choice != "none"):
        constraint = calls
    else:
        constraint = document
    # under "none" with a schema the output is the document: a `<tool_call>` in one of its
    # strings is text
    parse_calls = bool(tools) and constraint is not document
    shown = literal(tools) if tools and choice != "none" else None
    if uses_native_format(model.chat_template):
        return OutputPlan(request.messages, shown, constraint, parse_calls)
    # (with no tools offered too: the history may hold calls and results all the same)
    return OutputPlan(render_generic(request.messages, shown), None, constraint, parse_calls)


def _in_field(field: str, make, *args):
    """make(*args), a SchemaError it raises marked as one of the request's `field`."""
    try:
        return make(*args)
    except SchemaError as e:
        e.field = e.field or field
        raise


def output_field(request, output: bytes) -> str:
    """The request's field ("tools" or "json_schema") whose schemas constrain `output`, the
    bytes written so far (for a SchemaError only the output reaches, while decoding)."""
    if not request.tools:
        return "json_schema"
    if request.json_schema is None or request.tool_choice not in ("auto", "none"):
        return "tools"
    if request.tool_choice == "none":
        return "json_schema"
    return "tools" if output.startswith(OPENER.encode()[:1]) else "json_schema"


def tool_constraint(tools: list[dict], tool_choice, index: TokenIndex, parallel: bool = True,
                    allowed=None) -> GrammarConstraint:
    """The constraint for a response with tools (grammars cached per tools + choice + parallel
    + allowed)."""
    key = ("tools", schema_key([tools, tool_choice, parallel, allowed]))
    return GrammarConstraint(Grammar.of(index, key, lambda: tool_call_grammar(tools, tool_choice, parallel, allowed)))


def either_constraint(tools: list[dict], schema, index: TokenIndex, parallel: bool = True,
                      allowed=None) -> GrammarConstraint:
    """tool_choice "auto" with a json_schema: calls from the first byte, as "required" makes
    them, or one document valid for `schema` (see the module docstring)."""
    key = ("tools|json", schema_key([tools, schema, parallel, allowed]))
    return GrammarConstraint(Grammar.of(
        index, key, lambda: AnyOf([tool_call_grammar(tools, "required", parallel, allowed), compile_schema(schema)])))


class ToolCallParser:
    """Splits streamed text into message text and tool calls.

    Text that might be the beginning of `<tool_call>` is held back until it is known not to
    be; once the first call has started, everything else is calls (the grammar allows only
    whitespace between them). A call identical to an earlier one of the same response is
    dropped, and `repeated` says the response should end there: small models tend to
    repeat their call until the token limit, and running it twice tells nothing new.

    `leading`: calls can only begin the output (with a json_schema, see the module
    docstring); an output that begins otherwise is all text, a `<tool_call>` in one of the
    document's strings included.
    """

    def __init__(self, leading: bool = False):
        self.leading = leading
        self.all_text = False  # (leading) the output began as text: it is text to the end
        self.pending = ""     # text not yet given out
        self.in_call = False
        self.seen_call = False
        self.n_calls = 0
        self.calls: set[tuple[str, str]] = set()  # (name, arguments) given out so far
        self.texts: list[str] = []  # their text after the opener, as written
        self.repeated = False  # a call came again: the model is looping

    def feed(self, text: str) -> list:
        """-> a list of str (message text) and ToolCall, in order."""
        if self.all_text:
            return [text] if text else []
        self.pending += text
        if self.leading and not self.seen_call and not OPENER.startswith(self.pending[:len(OPENER)]):
            self.all_text = True
            text, self.pending = self.pending, ""
            return [text]
        out = []
        while True:
            if self.in_call:
                found = self._whole_call()
                if found is None:
                    return out
                call, end = found
                if (call.name, call.arguments) in self.calls:
                    self.repeated = True
                else:
                    self.calls.add((call.name, call.arguments))
                    self.texts.append(self.pending[:end].lstrip())
                    out.append(call)
                    self.n_calls += 1
                self.pending = self.pending[end:]
                self.in_call = False
                continue
            start = self.pending.find(OPENER)
            if start >= 0:
                if not self.seen_call and self.pending[:start]:
                    out.append(self.pending[:start])
                self.pending = self.pending[start + len(OPENER):]
                self.in_call = self.seen_call = True
                continue
            keep = self._partial_opener()
            if not self.seen_call and len(self.pending) > keep:
                out.append(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:] if keep else ""
            return out

    @property
    def repeating(self) -> bool:
        """Calls were given out, and what follows them is so far one of them again (or the
        beginning of any call): a repeat, which the response may end before."""
        if not self.n_calls:
            return False
        written = self.pending.lstrip()
        return not self.in_call or any(text.startswith(written) for text in self.texts)

    def _partial_opener(self) -> int:
        """Length of the longest end of `pending` that begins the opener."""
        for k in range(min(len(OPENER) - 1, len(self.pending)), 0, -1):
            if self.pending.endswith(OPENER[:k]):
                return k
        return 0

    def finish(self, complete: bool = True) -> list:
        """Whatever text is left at the end of generation.

        A call cut off by the token limit (`complete` False) is dropped: only whole, valid
        calls are ever given out. One unfinished in a complete output is a bug: an error.
        """
        if self.in_call and complete:
            raise EngineError("generation ended inside a tool call")
        # held back as the start of an opener: text if the output ended there, a call
        # cut off by the limit if it did not
        out = [self.pending] if self.pending and not self.seen_call and complete else []
        self.pending = ""
        return out

    def _whole_call(self) -> tuple[ToolCall, int] | None:
        """(the call, where its closer ends) once `pending` holds a whole call, else None.

        The call is the JSON object after the opener, and it ends at the first closer
        after that object: a closer inside one of its strings ({"tag": "</tool_call>"})
        is text, not the end.
        """
        if CLOSER not in self.pending:  # (no need to decode: a whole call ends with one)
            return None
        start = len(self.pending) - len(self.pending.lstrip())
        try:
            call, end = _JSON.raw_decode(self.pending, start)
        except ValueError:  # not whole yet (the grammar makes it valid JSON once it is)
            return None
        close = self.pending.find(CLOSER, end)
        if close < 0:
            return None
        try:
            return ToolCall(self.n_calls, call["name"], _compact(call["arguments"])), close + len(CLOSER)
        except (KeyError, TypeError) as e:
            raise EngineError(f"malformed tool call {self.pending[:end]!r}") from e

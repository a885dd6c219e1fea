"""OpenAI requests (Responses, Chat Completions) as the LMSP request they ask for.

Nothing here generates or validates what LMSP validation already checks: each request
becomes an LMSP request body (lmsp_min/validate.py reads it, exactly as for
`/lmsp/v1/responses`), and a problem that validation finds is renamed back to the
parameter the client sent (`rename`): `input[2]` of the LMSP body may be `messages[1]`
of a chat request, `extensions.lmsp-min.seed` is `seed`.

What this module checks itself is what LMSP has no field for: the OpenAI parameters we
accept, and those we cannot honour. `n` is the dialect's own (openai_dialect/choices.py:
n generations); `logprobs` / `top_logprobs`, the penalties and `logit_bias` are LMSP's
extensions. A parameter that would change the output and that we cannot honour (image or
audio parts, a completion's `suffix`...) is a 400 naming it, never silently ignored;
parameters that change nothing we produce (`user`, `metadata`, `service_tier`,
`prompt_cache_key`, `safety_identifier`) are accepted, and so
are `top_k` and `min_p`, which llama-server's and vLLM's users send. Any other unknown
parameter is a 400, as OpenAI's API answers it. An `allowed_tools` tool choice (either
API's form) becomes its mode and our `allowed_tools` extension (docs/protocol.md, D1).
"""

import re
from dataclasses import dataclass, field

from lmsp_min.problems import Problem, clipped, quoted
from lmsp_min.validate import EXTENSION, invalid

_EXTENSION = f"extensions.{EXTENSION}."
MAX_METADATA = 16  # OpenAI's bounds on `metadata`: 16 pairs, keys of 64 characters, values of 512
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio", "image_url", "file", "audio")


def unknown(name: str) -> Problem:
    return invalid(clipped(name), f"Unknown parameter: {quoted(name)}.")


def cannot(name: str, why: str) -> Problem:
    return invalid(name, f"'{name}' cannot be honoured by this server: {why}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Translated:
    """An OpenAI request read: the LMSP body it asks for, and what only the dialect uses."""

    body: dict  # the LMSP request body but its `input` (routes puts it together)
    input: list[dict]  # this request's own input items (LMSP items)
    stream: bool = False
    background: bool = False
    include_usage: bool = False  # chat: stream_options.include_usage
    instructions: str | None = None
    previous_response_id: str | None = None
    string_input: bool = False  # Responses: `input` was a string
    # chat: where each LMSP input item comes from: (the message's param, LMSP field -> its param)
    sources: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    renames: dict[str, str] = field(default_factory=dict)  # LMSP param prefix -> OpenAI param prefix
    skipped: int = 0  # Responses: LMSP input items of ours before the request's (its instructions)
    previous: int = 0  # Responses: then those of the previous response's conversation
    n: int = 1  # chat, completions: the choices to generate
    logprobs: bool = False  # chat, completions: their logprobs asked for

    def rename(self, problem: Problem) -> Problem:
        """`problem` as the client's request names things."""
        if problem.param is None:
            return problem
        doc = self.rename_document(problem.to_dict())
        return Problem(problem.code, doc["detail"], param=doc["param"], status=problem.status,
                       headers=problem.headers)

    def rename_document(self, doc: dict) -> dict:
        """A problem document (a failed response's error) as the client's request names things."""
        if doc.get("param") is None:
            return doc
        param = self._param(doc["param"])
        return {**doc, "param": param, "detail": doc["detail"].replace(f"'{doc['param']}'", f"'{param}'")}

    def _param(self, param: str) -> str:
        found = re.fullmatch(r"input\[(\d+)\](.*)", param)
        if found:
            index, rest = int(found.group(1)), found.group(2)
            if index < self.skipped:
                return "instructions"
            if index < self.skipped + self.previous:
                return "previous_response_id"
            index -= self.skipped + self.previous
            if self.sources:
                base, fields = self.sources[index]
                name = re.match(r"\.(\w+)", rest)
                return fields[name.group(1)] + rest[name.end():] if name and name.group(1) in fields else base + rest
            return "input" if self.string_input else f"input[{index}]{rest}"
        for prefix, renamed in sorted(self.renames.items(), key=lambda pair: -len(pair[0])):
            if param == prefix or param.startswith((prefix + ".", prefix + "[")):
                return renamed + param[len(prefix):]
        return param


# -- shared readers ---------------------------------------------------------------


# LMSP extensions that the dialects name as top-level parameters
EXTENSION_RENAMES = {_EXTENSION + name: name for name in ("top_p", "top_k", "min_p", "parallel_tool_calls",
                                                          "presence_penalty", "frequency_penalty", "logit_bias")}
MAX_CHOICES = 8  # n: the choices are generated one after the other, each a whole generation's time


def extension_of(lmsp: dict) -> dict:
    """The LMSP body's `extensions["lmsp-min"]`, made if it is not there yet."""
    return lmsp.setdefault("extensions", {}).setdefault(EXTENSION, {})


def choice_count(body: dict) -> int:
    """`n`: how many choices (1 to MAX_CHOICES)."""
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"'n' must be an integer from 1 to {MAX_CHOICES}")
    return n


def penalties(body: dict, lmsp: dict) -> None:
    """presence_penalty, frequency_penalty and logit_bias, as LMSP's extensions (whose
    validation checks them; logit_bias's token ids once the model is known)."""
    for name in ("presence_penalty", "frequency_penalty", "logit_bias"):
        if body.get(name) is not None:
            extension_of(lmsp)[name] = body[name]


def logprobs_asked(lmsp: dict, top: int) -> None:
    """Each token's log probability reported, with `top` alternatives (LMSP validation bounds it)."""
    extension_of(lmsp)["logprobs"] = top


def sampling(body: dict, lmsp: dict) -> None:
    """temperature, top_p and the `top_k` / `min_p` that llama-server's and vLLM's users send
    (in the SDK's extra_body; LMSP's extensions): LMSP validation checks their ranges.
    OpenAI's top_p may be 0, LMSP's may not: the smallest nucleus is the most likely token
    alone, top_k 1."""
    if body.get("temperature") is not None:
        lmsp["temperature"] = body["temperature"]
    for name in ("top_k", "min_p"):
        if body.get(name) is not None:
            lmsp.setdefault("extensions", {}).setdefault(EXTENSION, {})[name] = body[name]
    top_p = body.get("top_p")
    if top_p is not None:
        ours = lmsp.setdefault("extensions", {}).setdefault(EXTENSION, {})
        if top_p == 0 and not isinstance(top_p, bool):
            ours["top_k"] = 1
        else:
            ours["top_p"] = top_p


def _metadata(value) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > MAX_METADATA:
        raise invalid("metadata", f"'metadata' must be an object of at most {MAX_METADATA} pairs")
    for key, text in value.items():
        if len(key) > 64 or not isinstance(text, str) or len(text) > 512:
            raise invalid(f"metadata.{key[:64]}", "'metadata' values must be strings of at most 512 "
                          "characters, under keys of at most 64")


def _string_or_none(body: dict, name: str) -> None:
    if body.get(name) is not None and not isinstance(body[name], str):
        raise invalid(name, f"'{name}' must be a string")


def bool_or_none(body: dict, name: str) -> None:
    if body.get(name) is not None and not isinstance(body[name], bool):
        raise invalid(name, f"'{name}' must be a boolean")


def _parallel_tool_calls(body: dict, lmsp: dict) -> None:
    """false (agents such as Codex send it) is LMSP's extension: at most one call is made."""
    bool_or_none(body, "parallel_tool_calls")
    if body.get("parallel_tool_calls") is False:
        lmsp.setdefault("extensions", {}).setdefault(EXTENSION, {})["parallel_tool_calls"] = False


def _allowed_tools(choice: dict, param: str, lmsp: dict, name_of) -> str:
    """An `allowed_tools` choice ({"mode": ..., "tools": [function tools by name]}) as
    LMSP's: the names go to our `allowed_tools` extension (validated there against
    `tools`), the mode is the tool_choice returned."""
    mode = choice.get("mode")
    if mode not in ("auto", "required"):
        raise invalid(f"{param}.mode", f"'{param}.mode' must be 'auto' or 'required'")
    entries = choice.get("tools")
    if not isinstance(entries, list):
        raise invalid(f"{param}.tools", f"'{param}.tools' must be an array")
    names = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise cannot(f"{param}.tools[{index}]", "the tools here are functions only")
        names.append(name_of(entry))
    lmsp.setdefault("extensions", {}).setdefault(EXTENSION, {})["allowed_tools"] = names
    return mode


def _schema_format(spec: dict, param: str) -> dict | None:
    """A json_schema / json_object / text format as LMSP's response_format (None for text)."""
    if not isinstance(spec, dict):
        raise invalid(param, f"'{param}' must be an object")
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":  # any JSON object: the schema that says only that
        return {"type": "json_schema", "json_schema": {"name": "json_object", "schema": {"type": "object"}}}
    if kind == "json_schema":
        return spec
    raise invalid(f"{param}.type", f"'{param}.type' must be 'text', 'json_object' or 'json_schema'")


# -- POST /v1/responses -----------------------------------------------------------

RESPONSES_FIELDS = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "store", "previous_response_id", "metadata", "user", "stream",
    "stream_options", "background", "include", "reasoning", "truncation", "service_tier", "prompt_cache_key",
    "safety_identifier", "top_logprobs", "max_tool_calls", "top_k", "min_p",
}


def responses_request(body: dict, stores_responses: bool) -> Translated:
    """Read a POST /v1/responses body (a parsed JSON object)."""
    for name in body:
        if name not in RESPONSES_FIELDS:
            raise unknown(name)
    include_logprobs = False
    if body.get("include"):
        if not isinstance(body["include"], list):
            raise invalid("include", "'include' must be an array")
        for index, value in enumerate(body["include"]):
            include_logprobs |= value == "message.output_text.logprobs"
            if value not in ("reasoning.encrypted_content", "message.output_text.logprobs"):
                # (we have no encrypted reasoning to include: accepted, nothing comes of it)
                raise cannot(f"include[{index}]", f"{quoted(value)} is not produced here")
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or reasoning.get("effort") is not None):
        raise cannot("reasoning.effort", "a model reasons or not as its chat template says")
    if body.get("truncation") not in (None, "disabled"):
        raise cannot("truncation", "the input is never truncated (a too long input is a 400)")
    if body.get("max_tool_calls") is not None:
        raise cannot("max_tool_calls", "the model may make up to four calls in one response")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise invalid("text", "'text' must be an object")
        if text.get("verbosity") not in (None, "medium"):
            raise cannot("text.verbosity", "the model writes as it writes")
    for name in ("instructions", "user", "previous_response_id"):
        _string_or_none(body, name)
    for name in ("stream", "background", "store"):
        bool_or_none(body, name)
    _metadata(body.get("metadata"))

    lmsp = {name: body[name] for name in ("model", "max_output_tokens", "tools", "tool_choice") if name in body}
    sampling(body, lmsp)
    _parallel_tool_calls(body, lmsp)
    if include_logprobs or body.get("top_logprobs"):  # (top_logprobs alone asks for them too)
        logprobs_asked(lmsp, 0 if body.get("top_logprobs") is None else body["top_logprobs"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        lmsp["tool_choice"] = _allowed_tools(choice, "tool_choice", lmsp, lambda entry: entry.get("name"))
    if text is not None and text.get("format") is not None:
        fmt = _schema_format(text["format"], "text.format")
        if fmt is not None and fmt["type"] == "json_schema" and "json_schema" not in fmt:
            fmt = {"type": "json_schema", "json_schema": {key: fmt[key] for key in ("name", "schema", "strict")
                                                          if key in fmt}}
        if fmt is not None:
            lmsp["response_format"] = fmt
    lmsp["store"] = body.get("store") is not False and stores_responses  # OpenAI stores by default
    lmsp["stream"] = bool(body.get("stream"))  # (a failed stream is stored, a failed synchronous reply is not)
    translated = Translated(lmsp, [], stream=bool(body.get("stream")), background=bool(body.get("background")),
                            instructions=body.get("instructions"),
                            previous_response_id=body.get("previous_response_id"),
                            renames={"response_format.json_schema": "text.format", "response_format": "text.format",
                                     _EXTENSION + "allowed_tools": "tool_choice.tools",
                                     _EXTENSION + "logprobs": "top_logprobs", **EXTENSION_RENAMES})
    if "input" not in body:
        raise invalid("input", "'input' is required")
    if isinstance(body["input"], str):
        translated.string_input = True
        translated.input = [{"type": "message", "role": "user", "content": body["input"]}]
    elif isinstance(body["input"], list):
        translated.input = [_responses_item(item, f"input[{index}]") for index, item in enumerate(body["input"])]
    else:
        raise invalid("input", "'input' must be a string or an array of input items")
    return translated


def _responses_item(item, param: str):
    """An OpenAI input item as an LMSP one: `developer` is a system message, a call's output
    given as parts is their text; anything else LMSP validation reads as it is."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        item = dict(item)
        if item.get("role") == "developer":
            item["role"] = "system"
        content = item.get("content")
        if isinstance(content, list):
            for index, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in UNSUPPORTED_PARTS:
                    raise cannot(f"{param}.content[{index}].type", f"the models served here read text only, "
                                  f"not {part['type']!r} parts")
            if item["role"] == "assistant":  # refusals given back are the assistant's text too
                item["content"] = [{"type": "output_text", "text": part.get("refusal", "")}
                                   if isinstance(part, dict) and part.get("type") == "refusal" else part
                                   for part in content]
    elif kind == "function_call_output" and isinstance(item.get("output"), list):
        item = {**item, "output": _text_of_parts(item["output"], f"{param}.output")}
    return item


def _text_of_parts(parts: list, param: str) -> str:
    texts = []
    for index, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise cannot(f"{param}[{index}]", "the models served here read text only")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{param}[{index}].text", f"'{param}[{index}].text' must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


# -- POST /v1/chat/completions ---------------------------------------------------------

CHAT_FIELDS = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "seed", "tools", "tool_choice", "parallel_tool_calls", "response_format", "user",
    "metadata", "store", "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "logit_bias",
    "service_tier", "modalities", "reasoning_effort", "prediction", "audio", "web_search_options",
    "safety_identifier", "prompt_cache_key", "functions", "function_call", "verbosity", "top_k", "min_p",
}
# name -> (what it may be and still be honoured, why not otherwise)
_CHAT_HONOURED_ONLY_AS = {
    "modalities": (lambda v: v is None or v == ["text"], "the models served here write text only"),
    "audio": (lambda v: v is None, "the models served here write text only"),
    "prediction": (lambda v: v is None, "predicted outputs are not used"),
    "reasoning_effort": (lambda v: v is None, "a model reasons or not as its chat template says"),
    "web_search_options": (lambda v: v is None, "this server does not search the web"),
    "verbosity": (lambda v: v in (None, "medium"), "the model writes as it writes"),
    "store": (lambda v: not v, "chat completions are not stored (use /v1/responses with store)"),
    "functions": (lambda v: v is None, "use 'tools'"),
    "function_call": (lambda v: v is None, "use 'tool_choice'"),
}


def chat_request(body: dict) -> Translated:
    """Read a POST /v1/chat/completions body (a parsed JSON object)."""
    for name in body:
        if name not in CHAT_FIELDS:
            raise unknown(name)
    for name, (honoured, why) in _CHAT_HONOURED_ONLY_AS.items():
        if not honoured(body.get(name)):
            raise cannot(name, why)
    bool_or_none(body, "stream")
    _string_or_none(body, "user")
    _metadata(body.get("metadata"))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    tool_choice = body.get("tool_choice")

    lmsp = {"store": False, "stream": bool(body.get("stream"))}
    renames = {**EXTENSION_RENAMES, _EXTENSION + "seed": "seed", _EXTENSION + "stop": "stop",
               _EXTENSION + "logprobs": "top_logprobs"}
    if "model" in body:
        lmsp["model"] = body["model"]
    sampling(body, lmsp)
    _parallel_tool_calls(body, lmsp)
    penalties(body, lmsp)
    bool_or_none(body, "logprobs")
    if body.get("top_logprobs") and not body.get("logprobs"):
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    if body.get("logprobs"):
        logprobs_asked(lmsp, 0 if body.get("top_logprobs") is None else body["top_logprobs"])
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(limit) is not None:
        lmsp["max_output_tokens"] = body[limit]
        renames["max_output_tokens"] = limit
    ours = {}
    if body.get("seed") is not None:
        if not _is_int(body["seed"]):
            raise invalid("seed", "'seed' must be an integer")
        ours["seed"] = body["seed"] % 2**64  # (OpenAI's seeds may be negative: the same 64 bits)
    if body.get("stop") is not None:
        ours["stop"] = body["stop"]
    if ours:
        lmsp.setdefault("extensions", {}).setdefault(EXTENSION, {}).update(ours)
    if body.get("response_format") is not None:
        fmt = _schema_format(body["response_format"], "response_format")
        if fmt is not None:
            lmsp["response_format"] = fmt
    if body.get("tools") is not None:
        lmsp["tools"] = _chat_tools(body["tools"])
        renames.update({f"tools[{index}]": f"tools[{index}].function" for index in range(len(lmsp["tools"]))})
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        allowed = tool_choice.get("allowed_tools")
        if not isinstance(allowed, dict):
            raise invalid("tool_choice.allowed_tools", "'tool_choice.allowed_tools' must be an object")
        lmsp["tool_choice"] = _allowed_tools(allowed, "tool_choice.allowed_tools", lmsp,
                                             lambda entry: entry["function"].get("name")
                                             if isinstance(entry.get("function"), dict) else None)
        renames[_EXTENSION + "allowed_tools"] = "tool_choice.allowed_tools.tools"
    elif tool_choice is not None:
        lmsp["tool_choice"] = _chat_tool_choice(tool_choice)
        renames["tool_choice.name"] = "tool_choice.function.name"
    translated = Translated(lmsp, [], stream=bool(body.get("stream")),
                            include_usage=bool((options or {}).get("include_usage")), renames=renames,
                            n=choice_count(body), logprobs=bool(body.get("logprobs")))
    if "messages" not in body:
        raise invalid("messages", "'messages' is required")
    if not isinstance(body["messages"], list) or not body["messages"]:
        raise invalid("messages", "'messages' must be a non-empty array")
    for index, message in enumerate(body["messages"]):
        for item, source in _chat_message(message, f"messages[{index}]"):
            translated.input.append(item)
            translated.sources.append(source)
    return translated


def _chat_tools(tools) -> list:
    """Chat's `{"type": "function", "function": {...}}` as the flat tools of Responses and LMSP."""
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be an array")
    flat = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid(f"tools[{index}]", f"'tools[{index}]' must be a function tool: "
                          '{"type": "function", "function": {"name": ..., "parameters": ...}}')
        flat.append({"type": "function", **tool["function"]})
    return flat


def _chat_tool_choice(value):
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        return {"type": "function", "name": value["function"].get("name")}
    return value


def _chat_text(content, param: str, allowed: tuple[str, ...] = ("text",)) -> str:
    """A chat message's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, f"'{param}' must be a string or an array of content parts")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            if kind in UNSUPPORTED_PARTS or kind == "input_audio":
                raise cannot(f"{param}[{index}].type", f"the models served here read text only, not {kind!r} parts")
            raise invalid(f"{param}[{index}].type", f"'{param}[{index}].type' must be {' or '.join(allowed)}")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise invalid(f"{param}[{index}].{kind}", f"'{param}[{index}].{kind}' must be a string")
        texts.append(text)
    return "\n".join(texts)


def _chat_message(message, param: str) -> list[tuple[dict, tuple[str, dict[str, str]]]]:
    """One chat message as LMSP input items, each with the param it comes from."""
    if not isinstance(message, dict):
        raise invalid(param, f"'{param}' must be an object")
    role = message.get("role")
    if role in ("system", "developer", "user"):
        text = _chat_text(message.get("content"), f"{param}.content")
        return [({"type": "message", "role": "user" if role == "user" else "system", "content": text}, (param, {}))]
    if role == "assistant":
        content = message.get("content")
        text = "" if content is None else _chat_text(content, f"{param}.content", ("text", "refusal"))
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise invalid(f"{param}.tool_calls", f"'{param}.tool_calls' must be an array")
        items = []
        if text or not calls:
            items.append(({"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": text}]}, (param, {})))
        for index, call in enumerate(calls):
            where = f"{param}.tool_calls[{index}]"
            if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                raise invalid(where, f"'{where}' must be a function call")
            items.append(({"type": "function_call", "call_id": call.get("id"), "name": call["function"].get("name"),
                           "arguments": call["function"].get("arguments")},
                          (where, {"call_id": f"{where}.id", "name": f"{where}.function.name",
                                   "arguments": f"{where}.function.arguments"})))
        return items
    if role == "tool":
        output = _chat_text(message.get("content"), f"{param}.content")
        return [({"type": "function_call_output", "call_id": message.get("tool_call_id"), "output": output},
                 (param, {"call_id": f"{param}.tool_call_id", "output": f"{param}.content"}))]
    if role == "function":
        raise cannot(f"{param}.role", "'function' messages are deprecated: use 'tool' messages")
    raise invalid(f"{param}.role", f"'{param}.role' must be system, developer, user, assistant or tool")


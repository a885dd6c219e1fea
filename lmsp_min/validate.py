"""Validation of `POST /lmsp/v1/responses` bodies (docs/protocol.md §6.1, D1, D5).

Every field is checked for type and value before anything else happens; the
first problem found is reported as `400 invalid_request` with `param`, a path
to the offending field such as `input[0].content[1].type`. Unknown top-level
fields are rejected (a typo like `max_tokens` must not be silently ignored);
unknown keys inside nested objects are ignored, so that output items echoed
back as input (with their `id`, `status`...) are accepted as they are.

Choices this module makes where section 6 leaves room:
- A message's `content` may be a plain string as well as an array of parts.
- A message item may omit `"type": "message"` (a `role` identifies it).
- `reasoning` input items (echoed back from an earlier output) are accepted
  and left out of the prompt; what a stored response keeps of its input is what
  the prompt reads of it (`kept_items`).
- Several text parts of one message are joined with a newline.
- `temperature` is in [0, 2]; `extensions["lmsp-min"]` sampling keys follow
  llama.cpp's ranges (top_p in (0, 1], top_k >= 0, min_p in [0, 1]), and OpenAI's
  for its penalties ([-2, 2]), logit_bias (values in [-100, 100]) and logprobs (0 to 20).
  That logit_bias names tokens of the model's vocabulary is checked once the model is
  loaded (lmsp_min/generation.py).

Capabilities (does the model have `tools`?) are checked later, by the route,
once the model is known.
"""

import json
import math
import re
import sys
from dataclasses import dataclass, field

from engine.api import MAX_TOP_LOGPROBS
from lmsp_min.problems import Problem, clipped, quoted

MAX_JSON_DEPTH = 64  # arrays and objects in a request nest at most this deep (D9)

TOP_LEVEL_FIELDS = (
    "model", "input", "stream", "max_output_tokens", "temperature", "response_format",
    "tools", "tool_choice", "store", "previous_response_id", "extensions",
)
ROLES = ("system", "user", "assistant")
RESERVED_CONTENT_TYPES = (
    "input_image", "input_audio", "input_file", "output_image", "output_audio",
    "image", "image_url", "audio", "file",
)
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_INPUT_ITEMS = 4096
MAX_TOOLS = 128
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
MAX_LOGIT_BIAS = 1024  # entries: each pick adds them all (OpenAI allows 300; a grammar-free ban list may be longer)
TOKEN_ID = re.compile(r"[0-9]{1,9}")
EXTENSION = "lmsp-min"


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass
class ResponsesRequest:
    """A validated request: every value has its type and range."""

    model: str
    input: list[dict]  # the input items, as sent (validated)
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    json_schema: dict | None = None  # the schema of response_format json_schema
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str | dict = "auto"  # "auto" | "none" | "required" | {"name": N}
    store: bool = False
    previous_response_id: str | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    parallel_tool_calls: bool = True  # extensions.lmsp-min.parallel_tool_calls: false, one call at most
    allowed_tools: tuple[str, ...] | None = None  # extensions.lmsp-min.allowed_tools: calls name only these
    presence_penalty: float | None = None  # extensions.lmsp-min.presence_penalty ...
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # extensions.lmsp-min.logit_bias, by token id
    logprobs: int | None = None  # extensions.lmsp-min.logprobs: report them, with this many alternatives


def invalid(param: str, detail: str) -> Problem:
    return Problem("invalid_request", detail, param=param)


def parse_json_body(body: bytes) -> dict:
    """The request body as a JSON object, or 400 invalid_request."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise Problem("invalid_request", "the request body is not valid UTF-8") from None
    text = text.removeprefix("\ufeff")  # a byte order mark, which RFC 8259 lets parsers ignore
    try:
        value = _loads(text)
    except (ValueError, RecursionError) as exc:
        # (a ValueError: the parser's message, or NaN, Infinity or a number past a double's range)
        detail = f"the request body is not valid JSON ({exc})" if isinstance(exc, ValueError) \
            else "the request body is not valid JSON"
        raise Problem("invalid_request", detail) from None
    except _TooDeep:
        raise Problem("invalid_request", f"the request body nests arrays and objects deeper "
                      f"than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(value, dict):
        raise Problem("invalid_request", "the request body must be a JSON object")
    if "\\u" in text:  # only a \u escape can smuggle in a lone surrogate, which is not text
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise Problem("invalid_request", "the request body holds a lone UTF-16 surrogate "
                          "(a \\uD800-\\uDFFF escape that is not half of a pair)") from None
    return value


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or an exponent, refused when it overflows a double:
    1e400 would read as inf, and be written back (a schema's enum, const or bound)
    as `Infinity`, which is not JSON."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is too large for a 64-bit float")
    return value


def _double_sized_int(text: str) -> int:
    """A JSON integer, refused past a double's range as 1e400 is (readers hold numbers as
    doubles; a schema's checks compare values as floats)."""
    value = int(text)
    if abs(value) > sys.float_info.max:
        raise ValueError(f"the number {text[:40]}... is too large for a 64-bit float")
    return value


class _TooDeep(Exception):
    pass


def _loads(text: str):
    """json.loads, refusing NaN, Infinity, numbers past a double's range and anything
    nested deeper than MAX_JSON_DEPTH.

    A value nested nearly as deep as the parser can read would make every later
    recursive walk of it (json.dumps when it is stored, a schema compiler) fail with
    RecursionError: the bound is checked here, once, without recursing.
    """
    value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float,
                       parse_int=_double_sized_int)
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(MAX_JSON_DEPTH):
        level = [child for container in level
                 for child in (container.values() if isinstance(container, dict) else container)
                 if isinstance(child, (dict, list))]
    if level:
        raise _TooDeep()
    return value


# -- small typed readers --------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _string(value, param: str, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str):
        raise invalid(param, f"'{param}' must be a string")
    if not allow_empty and not value:
        raise invalid(param, f"'{param}' must not be empty")
    return value


def _bool(value, param: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(param, f"'{param}' must be true or false")
    return value


def _object(value, param: str) -> dict:
    if not isinstance(value, dict):
        raise invalid(param, f"'{param}' must be an object")
    return value


def _number_in(value, param: str, low: float, high: float, *, low_open: bool = False) -> float:
    if not _is_number(value):
        raise invalid(param, f"'{param}' must be a number")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(param, f"'{param}' must be in {bracket}{low}, {high}]")
    return float(value)


# -- the request ----------------------------------------------------------------


def validate_responses_request(body: dict) -> ResponsesRequest:
    """Check every field of a responses request (a parsed JSON object)."""
    for name in body:
        if name not in TOP_LEVEL_FIELDS:
            raise invalid(clipped(name), f"unknown field {quoted(name)}")
    if "model" not in body:
        raise invalid("model", "'model' is required")
    model = _string(body["model"], "model", allow_empty=False)
    previous = body.get("previous_response_id")
    if previous is not None:
        previous = _string(previous, "previous_response_id", allow_empty=False)
    if "input" not in body:
        raise invalid("input", "'input' is required")
    items = body["input"]
    if not isinstance(items, list):
        raise invalid("input", "'input' must be an array of input items")
    if not items and previous is None:
        raise invalid("input", "'input' must hold at least one item")
    if len(items) > MAX_INPUT_ITEMS:
        raise invalid("input", f"'input' holds more than {MAX_INPUT_ITEMS} items")
    for index, item in enumerate(items):
        _validate_item(item, f"input[{index}]")

    request = ResponsesRequest(model=model, input=items, previous_response_id=previous)
    if body.get("stream") is not None:
        request.stream = _bool(body["stream"], "stream")
    if body.get("store") is not None:
        request.store = _bool(body["store"], "store")
    if body.get("max_output_tokens") is not None:
        value = body["max_output_tokens"]
        if not _is_int(value) or value < 1:
            raise invalid("max_output_tokens", "'max_output_tokens' must be a positive integer")
        request.max_output_tokens = value
    if body.get("temperature") is not None:
        request.temperature = _number_in(body["temperature"], "temperature", 0, 2)
    if body.get("response_format") is not None:
        request.json_schema = _response_format(body["response_format"])
    if body.get("tools") is not None:
        request.tools = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        request.tool_choice = _tool_choice(body["tool_choice"], request.tools)
    if body.get("extensions") is not None:
        _extensions(_object(body["extensions"], "extensions"), request)
    if request.stop and request.json_schema is not None:
        raise invalid(f"extensions.{EXTENSION}.stop", "stop sequences cannot be combined with a json_schema "
                      "response format: cutting the output would break the document the schema describes")
    return request


def _validate_item(item, param: str) -> None:
    if not isinstance(item, dict):
        raise invalid(param, f"'{param}' must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        _validate_message(item, param)
    elif kind == "function_call":
        _string(item.get("call_id"), f"{param}.call_id", allow_empty=False)
        _string(item.get("name"), f"{param}.name", allow_empty=False)
        _arguments(_string(item.get("arguments"), f"{param}.arguments"), f"{param}.arguments")
    elif kind == "function_call_output":
        _string(item.get("call_id"), f"{param}.call_id", allow_empty=False)
        _string(item.get("output"), f"{param}.output")
    elif kind == "reasoning":
        pass  # an earlier output item sent back: accepted, not rendered
    elif kind is None:
        raise invalid(f"{param}.type", f"'{param}.type' is required")
    else:
        raise invalid(f"{param}.type", f"unknown input item type {quoted(kind)}"
                      " (expected message, function_call or function_call_output)")


def _validate_message(item: dict, param: str) -> None:
    role = item.get("role")
    if role not in ROLES:
        raise invalid(f"{param}.role", f"'{param}.role' must be one of {', '.join(ROLES)}")
    content = item.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid(f"{param}.content", f"'{param}.content' must be a string or an array of content parts")
    allowed = ("input_text", "output_text") if role == "assistant" else ("input_text",)
    for index, part in enumerate(content):
        part_param = f"{param}.content[{index}]"
        if not isinstance(part, dict):
            raise invalid(part_param, f"'{part_param}' must be an object")
        kind = part.get("type")
        if kind in RESERVED_CONTENT_TYPES:
            raise invalid(f"{part_param}.type", f"content type {quoted(kind)} is reserved for a future LMSP "
                          "version: LMSP 1.0 carries text only")
        if kind not in allowed:
            raise invalid(f"{part_param}.type", f"content type {quoted(kind)} is not allowed in a {role} "
                          f"message (expected {' or '.join(allowed)})")
        _string(part.get("text"), f"{part_param}.text")


def _arguments(text: str, param: str) -> dict:
    try:
        value = _loads(text)
    except (ValueError, RecursionError, _TooDeep):  # RecursionError: nested too deeply to read
        raise invalid(param, f"'{param}' must be a JSON-encoded object") from None
    if not isinstance(value, dict):
        raise invalid(param, f"'{param}' must be a JSON-encoded object")
    return value


def _response_format(value) -> dict | None:
    value = _object(value, "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind != "json_schema":
        raise invalid("response_format.type", "'response_format.type' must be 'text' or 'json_schema'")
    spec = _object(value.get("json_schema"), "response_format.json_schema")
    if spec.get("name") is not None:
        name = _string(spec["name"], "response_format.json_schema.name")
        if not NAME_PATTERN.fullmatch(name):
            raise invalid("response_format.json_schema.name",
                          "'response_format.json_schema.name' must match [A-Za-z0-9_-]{1,64}")
    if "schema" not in spec:
        raise invalid("response_format.json_schema.schema", "'response_format.json_schema.schema' is required")
    schema = _object(spec["schema"], "response_format.json_schema.schema")
    if spec.get("strict") is not None:
        _bool(spec["strict"], "response_format.json_schema.strict")
    return schema


def _tools(value) -> list[Tool]:
    if not isinstance(value, list):
        raise invalid("tools", "'tools' must be an array")
    if len(value) > MAX_TOOLS:
        raise invalid("tools", f"'tools' holds more than {MAX_TOOLS} tools")
    tools: list[Tool] = []
    for index, entry in enumerate(value):
        param = f"tools[{index}]"
        entry = _object(entry, param)
        if entry.get("type") != "function":
            raise invalid(f"{param}.type", f"'{param}.type' must be 'function'")
        name = _string(entry.get("name"), f"{param}.name")
        if not NAME_PATTERN.fullmatch(name):
            raise invalid(f"{param}.name", f"'{param}.name' must match [A-Za-z0-9_-]{{1,64}}")
        if any(tool.name == name for tool in tools):
            raise invalid(f"{param}.name", f"tool name {name!r} is used twice")
        description = entry.get("description")
        description = "" if description is None else _string(description, f"{param}.description")
        if entry.get("strict") is not None:
            _bool(entry["strict"], f"{param}.strict")
        tools.append(Tool(name, description, _tool_parameters(entry.get("parameters"), param)))
    return tools


def _tool_parameters(parameters, param: str) -> dict:
    """A tool's `parameters`: a JSON Schema object; absent or `{}` means no parameters. That
    it allows nothing but an object (a call's `arguments` is a JSON object, 6.5) is the schema
    compiler's to tell, through `$ref` and `anyOf` (engine/tools.py: a 400 naming this param)."""
    if parameters is None or parameters == {}:
        return {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid(f"{param}.parameters", f"'{param}.parameters' must be a JSON Schema object")
    return parameters


def _tool_choice(value, tools: list[Tool]) -> str | dict:
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise invalid("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or a function")
        if value == "required" and not tools:
            raise invalid("tool_choice", "'tool_choice' is 'required' but no tools are given")
        return value
    value = _object(value, "tool_choice")
    if value.get("type") != "function":
        raise invalid("tool_choice.type", "'tool_choice.type' must be 'function'")
    name = _string(value.get("name"), "tool_choice.name")
    if not any(tool.name == name for tool in tools):
        raise invalid("tool_choice.name", f"'tool_choice' names {quoted(name)}, which is not in 'tools'")
    return {"name": name}


def _extensions(extensions: dict, request: ResponsesRequest) -> None:
    """Validate our own `extensions["lmsp-min"]`; other namespaces and unknown keys are ignored."""
    if EXTENSION not in extensions:
        return
    ours = _object(extensions[EXTENSION], f"extensions.{EXTENSION}")
    prefix = f"extensions.{EXTENSION}"
    if ours.get("top_p") is not None:
        request.top_p = _number_in(ours["top_p"], f"{prefix}.top_p", 0, 1, low_open=True)
    if ours.get("top_k") is not None:
        if not _is_int(ours["top_k"]) or ours["top_k"] < 0:
            raise invalid(f"{prefix}.top_k", f"'{prefix}.top_k' must be a non-negative integer")
        request.top_k = ours["top_k"]
    if ours.get("min_p") is not None:
        request.min_p = _number_in(ours["min_p"], f"{prefix}.min_p", 0, 1)
    if ours.get("seed") is not None:
        if not _is_int(ours["seed"]) or not 0 <= ours["seed"] < 2**64:
            raise invalid(f"{prefix}.seed", f"'{prefix}.seed' must be an integer in [0, 2^64)")
        request.seed = ours["seed"]
    if ours.get("stop") is not None:
        stop = ours["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES:
            raise invalid(f"{prefix}.stop", f"'{prefix}.stop' must be a string or an array of at most "
                          f"{MAX_STOP_SEQUENCES} strings")
        for index, sequence in enumerate(stop):
            _string(sequence, f"{prefix}.stop[{index}]", allow_empty=False)
            if len(sequence) > MAX_STOP_LENGTH:  # each generated token is checked against every prefix
                raise invalid(f"{prefix}.stop[{index}]", f"a stop sequence is at most {MAX_STOP_LENGTH} characters")
        request.stop = tuple(stop)
    if ours.get("parallel_tool_calls") is not None:
        if not isinstance(ours["parallel_tool_calls"], bool):
            raise invalid(f"{prefix}.parallel_tool_calls", f"'{prefix}.parallel_tool_calls' must be a boolean")
        request.parallel_tool_calls = ours["parallel_tool_calls"]
    if ours.get("allowed_tools") is not None:
        request.allowed_tools = _allowed_tools(ours["allowed_tools"], request, f"{prefix}.allowed_tools")
    for name in ("presence_penalty", "frequency_penalty"):
        if ours.get(name) is not None:
            setattr(request, name, _number_in(ours[name], f"{prefix}.{name}", -2, 2))
    if ours.get("logit_bias") is not None:
        request.logit_bias = _logit_bias(ours["logit_bias"], f"{prefix}.logit_bias")
    if ours.get("logprobs") is not None:
        if not _is_int(ours["logprobs"]) or not 0 <= ours["logprobs"] <= MAX_TOP_LOGPROBS:
            raise invalid(f"{prefix}.logprobs", f"'{prefix}.logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        request.logprobs = ours["logprobs"]


def _logit_bias(value, param: str) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} as (id, bias) pairs, by id."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid(param, f"'{param}' must be an object of at most {MAX_LOGIT_BIAS} token ids and values")
    for key in value:
        if not TOKEN_ID.fullmatch(key):
            raise invalid(f"{param}.{clipped(key)}", f"'{param}' keys must be token ids (decimal integers)")
    biases = {int(key): _number_in(bias, f"{param}.{key}", -100, 100) for key, bias in value.items()}
    return tuple(sorted(biases.items()))  # ("01" and "1" are one token: the last value given)


def _allowed_tools(value, request: ResponsesRequest, param: str) -> tuple[str, ...]:
    """Names of listed tools, at least one, each once; a named tool_choice among them."""
    if not isinstance(value, list) or not value:
        raise invalid(param, f"'{param}' must be a non-empty array of tool names")
    listed = {tool.name for tool in request.tools}
    for index, name in enumerate(value):
        _string(name, f"{param}[{index}]")
        if name not in listed:
            raise invalid(f"{param}[{index}]", f"'{param}[{index}]' names {quoted(name)}, which is not in 'tools'")
        if name in value[:index]:
            raise invalid(f"{param}[{index}]", f"'{param}[{index}]' names {quoted(name)} twice")
    choice = request.tool_choice
    if isinstance(choice, dict) and choice["name"] not in value:
        raise invalid("tool_choice.name", f"'tool_choice' names {quoted(choice['name'])}, which is not in '{param}'")
    return tuple(value)


# -- input items -> chat messages -------------------------------------------------


def items_to_messages(items: list[dict], input_start: int = 0) -> list[dict]:
    """Turn validated LMSP input items into chat-template messages (engine ChatRequest).

    Consecutive `function_call` items become the `tool_calls` of one assistant
    message (joined to the assistant message just before them, if any); a
    `function_call_output` becomes a `tool` message, and must answer a call made
    earlier in the input. `param` paths in errors index the request's own
    `input`, which starts at `input_start` in `items` (after the items of a
    previous response).
    """
    messages: list[dict] = []
    calls: dict[str, str] = {}  # call_id -> tool name
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            text = content if isinstance(content, str) else "\n".join(part["text"] for part in content)
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": json.loads(item["arguments"])},
            }
            calls[item["call_id"]] = item["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (
                    "tool_calls" in last or items[index - 1].get("type", "message") == "message"):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item["call_id"]
            if call_id not in calls:
                raise invalid(f"input[{index - input_start}].call_id",
                              f"no earlier function_call item has call_id {quoted(call_id)}")
            messages.append({"role": "tool", "content": item["output"], "tool_call_id": call_id,
                             "name": calls[call_id]})
    return messages


# An item's `id` is kept with it up to this length: ours are 30 characters, OpenAI's about 52.
MAX_KEPT_ID = 64
_KEPT_KEYS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
              "function_call_output": ("call_id", "output"), "reasoning": ()}
_ITEM_STATUSES = ("in_progress", "completed", "incomplete")


def kept_items(items: list[dict]) -> list[dict]:
    """Validated input items as a stored response keeps them (docs/protocol.md D6): what
    the prompt reads of each, and its `id` and `status` when they are short. Keys no
    template reads, a reasoning item's summary and text parts' other keys (annotations)
    never reach the prompt, so they are not stored: a 4 MB reasoning item costs a few
    bytes. A reasoning item stays, empty, where it was: it separates the items around it
    as it did (items_to_messages joins a call to the message just before it)."""
    kept = []
    for item in items:
        kind = item.get("type", "message")
        entry = {"type": kind} if "type" in item else {}  # (a message may leave it out)
        if isinstance(item.get("id"), str) and len(item["id"]) <= MAX_KEPT_ID:
            entry["id"] = item["id"]
        if item.get("status") in _ITEM_STATUSES:
            entry["status"] = item["status"]
        for key in _KEPT_KEYS[kind]:
            entry[key] = item[key]
        if kind == "message" and not isinstance(item["content"], str):
            entry["content"] = [{"type": part["type"], "text": part["text"]} for part in item["content"]]
        if kind == "reasoning":
            entry["summary"] = []
        kept.append(entry)
    return kept

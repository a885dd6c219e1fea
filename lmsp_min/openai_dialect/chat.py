"""Responses as Chat Completions: `chat.completion` objects and `chat.completion.chunk`s.

A chat completion is one assistant message: the text of the response's message items,
its function calls as `tool_calls`, and a `finish_reason` (`length` when the token
budget cut it, `tool_calls` when it called, else `stop`). A reasoning model's thought
goes in `reasoning_content`, as llama-server and vLLM write it (OpenAI's API has no
field for it; its SDK keeps unknown fields).

The stream is what the openai SDK's chat streaming reads (lib/streaming/chat): the role
in the first chunk's delta, text as `content` deltas, each call as one indexed
`tool_calls` delta (LMSP gives a call whole), a last chunk with the finish_reason; with
`stream_options.include_usage` every chunk has `"usage": null` and one more chunk, with
no choices, carries the usage; then `data: [DONE]`. A response that fails mid-stream
sends `{"error": {...}}`, which the SDK raises as an APIError.
"""

from lmsp_min.events import compact_json
from lmsp_min.openai_dialect.errors import error_type
from lmsp_min import sse

DONE = sse.message("[DONE]")


def completion_id(response_id: str) -> str:
    return "chatcmpl-" + response_id.removeprefix("resp_")


def chat_usage(lmsp: dict | None) -> dict | None:
    if lmsp is None:
        return None
    return {"prompt_tokens": lmsp["input_tokens"], "completion_tokens": lmsp["output_tokens"],
            "total_tokens": lmsp["total_tokens"],
            "prompt_tokens_details": {"cached_tokens": lmsp.get("input_tokens_details", {}).get("cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": 0}}


def finish_reason(status: str, calls: int) -> str:
    return "length" if status == "incomplete" else "tool_calls" if calls else "stop"


def tool_call(item: dict) -> dict:
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def completion_object(lmsp: dict) -> dict:
    """A final LMSP response object as a `chat.completion`."""
    texts = {"message": [], "reasoning": []}
    calls = []
    for item in lmsp["output"]:
        if item["type"] == "function_call":
            calls.append(tool_call(item))
        else:
            texts[item["type"]] += [part["text"] for part in item.get("content", item.get("summary", []))]
    text = "".join(texts["message"])
    message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
    if texts["reasoning"]:
        message["reasoning_content"] = "".join(texts["reasoning"])
    if calls:
        message["tool_calls"] = calls
    return {"id": completion_id(lmsp["id"]), "object": "chat.completion", "created": lmsp["created_at"],
            "model": lmsp["model"], "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason(lmsp["status"], len(calls))}],
            "usage": chat_usage(lmsp["usage"])}


def stream_error(problem: dict) -> dict:
    """A problem document (the `error` of a failed response or an error event) as a stream's error."""
    return {"error": {"message": problem.get("detail", ""), "type": error_type(problem.get("status", 500)),
                      "param": problem.get("param"), "code": problem.get("code")}}


class ChatChunks:
    """The SSE body of a streamed chat completion, from the LMSP events of its response."""

    def __init__(self, response_id: str, created_at: int, model: str, include_usage: bool):
        self._head = {"id": completion_id(response_id), "object": "chat.completion.chunk", "created": created_at,
                      "model": model, "system_fingerprint": None}
        self._include_usage = include_usage
        self._calls = 0

    def _chunk(self, delta: dict, finish: str | None = None) -> bytes:
        chunk = {**self._head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if self._include_usage:
            chunk["usage"] = None
        return _data(chunk)

    def translate(self, name: str, data: dict) -> bytes:
        """The bytes to send for one LMSP event (b"" when it has no chat counterpart)."""
        if name == "response.created":
            return self._chunk({"role": "assistant", "content": ""})
        if name == "response.output_text.delta":
            return self._chunk({"content": data["delta"]})
        if name == "response.reasoning_summary_text.delta":
            return self._chunk({"reasoning_content": data["delta"]})
        if name == "response.output_item.done" and data["item"]["type"] == "function_call":
            call = {"index": self._calls, **tool_call(data["item"])}
            self._calls += 1
            return self._chunk({"tool_calls": [call]})
        if name in ("response.completed", "response.incomplete"):
            body = self._chunk({}, finish_reason(data["status"], self._calls))
            if self._include_usage:
                body += _data({**self._head, "choices": [], "usage": chat_usage(data["usage"])})
            return body + DONE
        if name in ("response.failed", "error"):
            return _data(stream_error(data["error"])) + DONE
        if name == "response.cancelled":
            return DONE
        return b""


def _data(obj: dict) -> bytes:
    return sse.message(compact_json(obj))

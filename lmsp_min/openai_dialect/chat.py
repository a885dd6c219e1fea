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

With `n`, each choice is one LMSP response (openai_dialect/choices.py), its `index` its
place; a stream gives them one after the other, each chunk with its choice's `index`,
then the usage of all (the prompt counted once, as OpenAI counts it) and one `[DONE]`.
With `logprobs`, a choice's `logprobs.content` lists its tokens' (lmsp_min/events.py
writes each entry as OpenAI does); a content chunk carries those of its text.
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


def message_of(lmsp: dict) -> tuple[dict, list[dict], list[dict]]:
    """A final LMSP response's assistant message, its calls, and its message text's logprob entries."""
    texts = {"message": [], "reasoning": []}
    calls, logprobs = [], []
    for item in lmsp["output"]:
        if item["type"] == "function_call":
            calls.append(tool_call(item))
        else:
            parts = item.get("content", item.get("summary", []))
            texts[item["type"]] += [part["text"] for part in parts]
            logprobs += [entry for part in parts for entry in part.get("logprobs", ())]
    text = "".join(texts["message"])
    message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
    if texts["reasoning"]:
        message["reasoning_content"] = "".join(texts["reasoning"])
    if calls:
        message["tool_calls"] = calls
    return message, calls, logprobs


def total_usage(lmsps: list[dict]) -> dict | None:
    """The LMSP usage of n choices of one prompt: the prompt once (the first choice's), every output."""
    if any(lmsp["usage"] is None for lmsp in lmsps):
        return None
    first, output = lmsps[0]["usage"], sum(lmsp["usage"]["output_tokens"] for lmsp in lmsps)
    return {**first, "output_tokens": output, "total_tokens": first["input_tokens"] + output}


def completion_object(lmsps: list[dict], logprobs: bool = False) -> dict:
    """The final LMSP response objects of a request's choices as one `chat.completion`."""
    choices = []
    for index, lmsp in enumerate(lmsps):
        message, calls, entries = message_of(lmsp)
        choices.append({"index": index, "message": message,
                        "logprobs": {"content": entries, "refusal": None} if logprobs else None,
                        "finish_reason": finish_reason(lmsp["status"], len(calls))})
    first = lmsps[0]
    return {"id": completion_id(first["id"]), "object": "chat.completion", "created": first["created_at"],
            "model": first["model"], "system_fingerprint": None, "choices": choices,
            "usage": chat_usage(total_usage(lmsps))}


def stream_error(problem: dict) -> dict:
    """A problem document (the `error` of a failed response or an error event) as a stream's error."""
    return {"error": {"message": problem.get("detail", ""), "type": error_type(problem.get("status", 500)),
                      "param": problem.get("param"), "code": problem.get("code")}}


class ChatChunks:
    """The SSE body of a streamed chat completion, from the LMSP events of its n choices'
    responses, one choice after the other."""

    def __init__(self, response_id: str, created_at: int, model: str, include_usage: bool, n: int = 1,
                 logprobs: bool = False):
        self._head = {"id": completion_id(response_id), "object": "chat.completion.chunk", "created": created_at,
                      "model": model, "system_fingerprint": None}
        self._include_usage = include_usage
        self._logprobs = logprobs
        self._calls = [0] * n  # each choice's calls so far
        self._usages: list[dict] = []  # each ended choice's (LMSP) usage

    def _chunk(self, index: int, delta: dict, finish: str | None = None, logprobs: list | None = None) -> bytes:
        choice = {"index": index, "delta": delta,
                  "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                  "finish_reason": finish}
        chunk = {**self._head, "choices": [choice]}
        if self._include_usage:
            chunk["usage"] = None
        return _data(chunk)

    def translate(self, index: int, name: str, data: dict) -> bytes:
        """The bytes to send for one LMSP event of choice `index` (b"" when it has no chat counterpart)."""
        if name == "response.created":
            return self._chunk(index, {"role": "assistant", "content": ""})
        if name == "response.output_text.delta":
            return self._chunk(index, {"content": data["delta"]},
                               logprobs=data.get("logprobs", []) if self._logprobs else None)
        if name == "response.reasoning_summary_text.delta":
            return self._chunk(index, {"reasoning_content": data["delta"]})
        if name == "response.output_item.done" and data["item"]["type"] == "function_call":
            call = {"index": self._calls[index], **tool_call(data["item"])}
            self._calls[index] += 1
            return self._chunk(index, {"tool_calls": [call]})
        if name in ("response.completed", "response.incomplete"):
            return self._ended(index, data)
        if name in ("response.failed", "error"):
            return _data(stream_error(data["error"])) + DONE
        if name == "response.cancelled":
            return DONE
        return b""

    def _ended(self, index: int, data: dict) -> bytes:
        """A choice's last chunk; after the last choice's, the usage of all, and [DONE]."""
        body = self._chunk(index, {}, finish_reason(data["status"], self._calls[index]))
        self._usages.append(data["usage"])
        if len(self._usages) < len(self._calls):
            return body
        if self._include_usage:
            usage = total_usage([{"usage": usage} for usage in self._usages])
            body += _data({**self._head, "choices": [], "usage": chat_usage(usage)})
        return body + DONE


def _data(obj: dict) -> bytes:
    return sse.message(compact_json(obj))

"""Server-sent events: how every stream of the service is framed, and kept alive.

Three kinds of stream leave the service, and all are written here:

    LMSP (/lmsp/v1 responses and task events)   id: 7\\nevent: response.output_text.delta\\ndata: {...}\\n\\n
    OpenAI Responses (/v1/responses)            event: response.output_text.delta\\ndata: {...}\\n\\n
    OpenAI Chat Completions                     data: {...}\\n\\n ... data: [DONE]\\n\\n

`message` is the one function that frames a message. `stream` makes the HTTP
response that carries them: while nothing is sent for `Limits.stream_keepalive`
seconds, the HTTP layer writes the `KEEPALIVE` comment (D3: at least every 15
seconds), so that clients and proxies do not take a long prompt or a queue for a
dead connection. No other module writes an SSE line.

Reading the request path: the faces (lmsp_min/routes.py, lmsp_min/openai_dialect/)
hand `stream` the bytes of their events; lmsp_min/http.py writes them as they come.
"""

from collections.abc import AsyncIterable

from lmsp_min.http import Limits, StreamingResponse

KEEPALIVE = b": keep-alive\n\n"  # a comment line: every SSE parser skips it


def message(data: str, *, event: str | None = None, event_id: int | None = None) -> bytes:
    """One SSE message. `data` is one line (compact JSON, or `[DONE]`): JSON never holds
    a raw newline, so a message needs a single `data:` field."""
    head = "" if event_id is None else f"id: {event_id}\n"
    if event is not None:
        head += f"event: {event}\n"
    return f"{head}data: {data}\n\n".encode("utf-8")


def stream(chunks: AsyncIterable[bytes], limits: Limits) -> StreamingResponse:
    """A `text/event-stream` response of `chunks`, kept alive while they are slow to come."""
    return StreamingResponse(chunks, idle_chunk=KEEPALIVE, idle_interval=limits.stream_keepalive)

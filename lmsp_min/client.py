"""A small LMSP 1.0 client on the standard library only (http.client, json).

    from lmsp_min.client import Client, output_text
    client = Client("http://127.0.0.1:8080")
    response = client.create_response("smollm2:135m-instruct-q4_1", "Say hello.")
    print(output_text(response))
    for event in client.stream_response("smollm2:135m-instruct-q4_1", "Say hello."):
        if event.event == "response.output_text.delta":
            print(event.data["delta"], end="", flush=True)

Every failed request raises an LMSPError. When the server answered with an
error, `status` is its HTTP status and `problem` its problem document (`code` is
what to match on). A TransportError (a subclass) got no usable answer: the
server could not be reached, the connection dropped or timed out, or the answer
was not HTTP or not JSON; its `__cause__` is the underlying error. A stream that
ends before its final event raises StreamInterrupted, a TransportError.

Task streams survive dropped connections: `follow_task` remembers the id of the
last event it yielded and reconnects with `Last-Event-ID`, so the caller sees
every event exactly once. When the server no longer keeps those events
(410 event_history_expired), it fetches the finished task instead and yields one
final event rebuilt from it (`id` None, `data["response"]` the full response).

Each request opens its own connection: simple, and nothing to go stale between
calls of a long-lived program.
"""

import http.client
import json
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

FINAL_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled", "error"}
)
FINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})


class LMSPError(Exception):
    """A request failed: the one exception type a caller needs to catch.

    When the server answered with an error, `status` is the HTTP status and
    `problem` the problem document (RFC 9457), one made of the status line when
    the answer had none; a TransportError had no answer, and both are None.
    """

    def __init__(self, message: str, status: int | None = None, problem: dict | None = None):
        super().__init__(message)
        self.status = status
        self.problem = problem

    @property
    def code(self) -> str | None:
        return self.problem.get("code") if self.problem else None


class TransportError(LMSPError):
    """No usable answer: the server could not be reached, the connection dropped
    or timed out, or the answer was not HTTP or not JSON (`__cause__` says which)."""


class StreamInterrupted(TransportError):
    """A stream ended before its final event."""


class _EndedEarly(StreamInterrupted):
    """The server ended a stream cleanly, but before any final event."""


@dataclass(frozen=True)
class Event:
    """One server-sent event: `id` is its sequence number, `data` its JSON object."""

    id: int | None
    event: str
    data: Any


def user_message(text: str) -> dict:
    """An LMSP `message` input item from the user."""
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def function_call_output(call_id: str, output: Any) -> dict:
    """The input item that returns a tool's result; non-strings are JSON-encoded."""
    if not isinstance(output, str):
        output = json.dumps(output)
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def function_calls(response: dict) -> list[dict]:
    """The `function_call` output items of a response, in order."""
    return [item for item in response.get("output", []) if item.get("type") == "function_call"]


def output_text(response: dict) -> str:
    """The text of a response's message items, joined."""
    return "".join(
        part.get("text", "")
        for item in response.get("output", [])
        if item.get("type") == "message"
        for part in item.get("content", [])
        if part.get("type") == "output_text"
    )


def as_input(input: str | list[dict]) -> list[dict]:
    """A string is shorthand for one user message."""
    return [user_message(input)] if isinstance(input, str) else list(input)


def parse_sse(lines: Iterator[bytes]) -> Iterator[Event]:
    """Server-sent events from an iterator of raw lines (the WHATWG event stream rules).

    Comment lines (`: keep-alive`) are skipped; an event without data is not
    dispatched; `data` is parsed as JSON when it is JSON, else kept as text.
    """
    event_id: int | None = None
    name, data = "", []
    for raw in lines:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")  # (the standard decodes with replacement)
        if not line:
            if data:
                text = "\n".join(data)
                try:
                    value = json.loads(text)
                except ValueError:
                    value = text
                yield Event(event_id, name or "message", value)
            name, data = "", []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
        elif field == "id" and value.isascii() and value.isdigit():  # ("²" is a digit, not a number)
            event_id = int(value)


# what a connection raises when it fails: OSError (refused, reset, timed out, TLS)
# and http.client's own errors (a cut body, a status line that is not HTTP)
_TRANSPORT_FAILURES = (OSError, http.client.HTTPException)


class Client:
    """Calls an LMSP service; `token` is sent as a bearer token when given.

    `timeout` bounds each wait on the network (connecting, each read), not a
    whole request: a stream may run as long as events keep coming.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8080", token: str | None = None, timeout: float = 600.0):
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url must be http://HOST or https://HOST, not {base_url!r}")
        self.scheme, self.host = url.scheme, url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.prefix = url.path.rstrip("/")
        self.token = token
        self.timeout = timeout

    # -- models ---------------------------------------------------------------

    def list_models(self) -> list[dict]:
        return self._json("GET", "/lmsp/v1/models")["data"]

    def get_model(self, model_id: str) -> dict:
        return self._json("GET", f"/lmsp/v1/models/{_segment(model_id)}")

    # -- responses ------------------------------------------------------------

    def create_response(self, model: str, input: str | list[dict], **fields) -> dict:
        """A synchronous response; `fields` are the other request fields (`tools`, ...)."""
        headers = self._idempotency(fields)
        body = {"model": model, "input": as_input(input), **fields, "stream": False}
        return self._json("POST", "/lmsp/v1/responses", body, headers)

    def stream_response(self, model: str, input: str | list[dict], **fields) -> Iterator[Event]:
        """The events of a streamed response; raises StreamInterrupted if the
        connection drops before the final event (direct streams cannot resume)."""
        headers = self._idempotency(fields)
        body = {"model": model, "input": as_input(input), **fields, "stream": True}
        conn, resp = self._open("POST", "/lmsp/v1/responses", body, headers)
        try:
            yield from self._events(resp, "POST", "/lmsp/v1/responses")
        finally:
            conn.close()

    def get_response(self, response_id: str) -> dict:
        return self._json("GET", f"/lmsp/v1/responses/{_segment(response_id)}")

    def delete_response(self, response_id: str) -> None:
        self._json("DELETE", f"/lmsp/v1/responses/{_segment(response_id)}")

    def run_tools(
        self,
        model: str,
        input: str | list[dict],
        functions: dict[str, Callable[..., Any]],
        *,
        max_rounds: int = 8,
        **fields,
    ) -> dict:
        """Answer the model's function calls with `functions` until it stops calling.

        Each round sends the full context again (6.5): the earlier input, the
        response's output items exactly as received (its `function_call` items
        among them), then one `function_call_output` per call, with what
        `functions[name](**arguments)` returned. A `tool_choice` that forces a
        call ("required" or a named function) holds for the first round only;
        the next rounds are "auto", so the model can answer with the results.
        An `idempotency_key` K is sent as "K/1", "K/2"... one per round: each
        round is another request.
        """
        items = as_input(input)
        key = fields.pop("idempotency_key", None)
        for round_number in range(1, max_rounds + 1):
            if key is not None:
                fields["idempotency_key"] = f"{key}/{round_number}"
            response = self.create_response(model, items, **fields)
            calls = function_calls(response)
            if not calls:
                return response
            if fields.get("tool_choice") not in (None, "auto", "none"):
                fields = {**fields, "tool_choice": "auto"}
            items += response["output"]
            for call in calls:
                if call["name"] not in functions:
                    raise KeyError(f"the model called {call['name']!r}, which is not in functions")
                result = functions[call["name"]](**json.loads(call["arguments"]))
                items.append(function_call_output(call["call_id"], result))
        raise RuntimeError(f"the model was still calling tools after {max_rounds} rounds")

    # -- tasks ----------------------------------------------------------------

    def create_task(self, model: str, input: str | list[dict], **fields) -> dict:
        headers = self._idempotency(fields)
        body = {"model": model, "input": as_input(input), **fields}
        return self._json("POST", "/lmsp/v1/tasks", body, headers)

    def get_task(self, task_id: str) -> dict:
        return self._json("GET", f"/lmsp/v1/tasks/{_segment(task_id)}")

    def cancel_task(self, task_id: str) -> dict:
        return self._json("POST", f"/lmsp/v1/tasks/{_segment(task_id)}/cancel")

    def follow_task(self, task_id: str, after: int = 0, *, retries: int = 5) -> Iterator[Event]:
        """Every event of a task after `after`, across dropped connections.

        Every TransportError is a reason to reconnect; `retries` bounds consecutive
        reconnections that bring no new event (with a growing pause between them),
        and any new event resets the count. When they run out, StreamInterrupted
        says so, caused by the last failure. A problem the server answers is
        raised at once, but for 410 event_history_expired (see the module's doc).
        """
        path = f"/lmsp/v1/tasks/{_segment(task_id)}/events"
        last = after
        failures = 0
        while True:
            headers = {"Last-Event-ID": str(last)} if last else {}
            progressed = False
            try:
                conn, resp = self._open("GET", path, None, headers)
                try:
                    for event in self._events(resp, "GET", path):
                        if event.id is not None and event.id <= last:
                            continue  # already yielded before the reconnection
                        if event.id is not None:
                            last = event.id
                        failures, progressed = 0, True
                        yield event
                    return
                except _EndedEarly:
                    # the server had nothing after `last` for a final task: `last` was its final event
                    if not progressed and self.get_task(task_id)["status"] in FINAL_STATUSES:
                        return
                    raise
                finally:
                    conn.close()
            except TransportError as e:
                failure = e
            except LMSPError as e:
                if e.code != "event_history_expired":
                    raise
                yield self._final_event(task_id)
                return
            failures += 1
            if failures > retries:
                raise StreamInterrupted(
                    f"{self._where('GET', path)}: gave up after {retries} reconnections without progress"
                ) from failure
            time.sleep(min(0.1 * 2 ** (failures - 1), 2.0))

    def wait_task(self, task_id: str, poll: float = 0.5) -> dict:
        """The task once it is final (polling, for callers that want no events)."""
        while (task := self.get_task(task_id))["status"] not in FINAL_STATUSES:
            time.sleep(poll)
        return task

    def _final_event(self, task_id: str) -> Event:
        """The final event rebuilt from the finished task, when its events expired."""
        task = self.wait_task(task_id)
        response = task.get("response") or {}
        data = {"response_id": task.get("response_id"), "status": task["status"], "response": response}
        for key in ("usage", "error", "incomplete_details"):
            if response.get(key) is not None:
                data[key] = response[key]
        return Event(None, f"response.{task['status']}", data)

    # -- HTTP -----------------------------------------------------------------

    @staticmethod
    def _idempotency(fields: dict) -> dict:
        """`idempotency_key=` is sent as the Idempotency-Key header, not in the body."""
        key = fields.pop("idempotency_key", None)
        return {"Idempotency-Key": key} if key else {}

    def _where(self, method: str, path: str) -> str:
        """What a request is, for its errors: `GET /lmsp/v1/models on host:port`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{method} {self.prefix}{path} on {host}:{self.port}"

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def _send(self, method: str, path: str, body: Any, headers: dict):
        """The open connection and the head of its response."""
        headers = {"LMSP-Version": "1.0", **headers}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn = self._connect()
        doing = "connecting"
        try:
            conn.connect()
            doing = "sending the request"
            conn.request(method, self.prefix + path, payload, headers)
            doing = "waiting for the response"
            return conn, conn.getresponse()
        except _TRANSPORT_FAILURES as e:
            conn.close()
            raise TransportError(f"{self._where(method, path)}: {doing} failed: {e!r}") from e
        except BaseException:
            conn.close()
            raise

    def _read(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, method: str, path: str) -> bytes:
        """The whole body of a response; its connection is closed after it."""
        try:
            return resp.read()
        except _TRANSPORT_FAILURES as e:
            raise TransportError(f"{self._where(method, path)}: reading the response body failed: {e!r}") from e
        finally:
            conn.close()

    def _json(self, method: str, path: str, body: Any = None, headers: dict | None = None) -> Any:
        conn, resp = self._send(method, path, body, headers or {})
        data = self._read(conn, resp, method, path)
        if not 200 <= resp.status < 300:  # (3xx too: this client follows no redirect)
            raise _answered_error(self._where(method, path), resp, data)
        try:
            return json.loads(data) if data else None
        except ValueError as e:  # (a body that runs to the close of a dropped connection ends here too)
            raise TransportError(
                f"{self._where(method, path)}: the answer is not JSON ({resp.status}, "
                f"{resp.getheader('Content-Type')}, {len(data)} bytes)"
            ) from e

    def _open(self, method: str, path: str, body: Any, headers: dict):
        """A streaming request: the open connection and its response, or LMSPError."""
        conn, resp = self._send(method, path, body, {"Accept": "text/event-stream", **headers})
        if not 200 <= resp.status < 300:
            raise _answered_error(self._where(method, path), resp, self._read(conn, resp, method, path))
        return conn, resp

    def _events(self, resp: http.client.HTTPResponse, method: str, path: str) -> Iterator[Event]:
        """Parse events until the final one; a stream that ends earlier was cut."""
        try:
            for event in parse_sse(iter(resp.readline, b"")):
                yield event
                if event.event in FINAL_EVENTS:
                    try:
                        resp.read()  # the end of the body: the service closes the stream now
                    except _TRANSPORT_FAILURES:
                        pass  # the final event arrived; how the stream ended does not matter
                    return
        except _TRANSPORT_FAILURES as e:
            raise StreamInterrupted(f"{self._where(method, path)}: reading the event stream failed: {e!r}") from e
        raise _EndedEarly(f"{self._where(method, path)}: the event stream ended before its final event")


def _segment(value: str) -> str:
    """An id as one path segment: a `/`, `?` or space in it cannot change the route."""
    return urllib.parse.quote(value, safe=":")


def _answered_error(where: str, resp: http.client.HTTPResponse, data: bytes) -> LMSPError:
    """The error of an answer that is not a success, with its problem document.

    An answer without one (a proxy's, an empty body) gets one made of its status
    line, with its text, if any, as the detail.
    """
    try:
        problem = json.loads(data)
    except ValueError:
        problem = None
    if not isinstance(problem, dict):
        text = data.decode("utf-8", "replace").strip()[:200]
        problem = {"status": resp.status, "title": _reason(resp), **({"detail": text} if text else {})}
    summary = problem.get("code") or problem.get("title") or _reason(resp)
    detail = problem.get("detail")
    return LMSPError(f"{where}: {resp.status} {summary}" + (f": {detail}" if detail else ""), resp.status, problem)


def _reason(resp: http.client.HTTPResponse) -> str:
    """The reason phrase of an answer's status line, or the standard one when it has none."""
    try:
        return resp.reason or http.HTTPStatus(resp.status).phrase
    except ValueError:  # a status HTTP does not define
        return "(no reason given)"

"""The LMSP face: every route under /lmsp/v1 (docs/protocol.md §6, D3, D6).

    GET    /lmsp/v1/models                  models:read      the models
    GET    /lmsp/v1/models/{model_id}       models:read      one of them
    POST   /lmsp/v1/responses               responses:write  a response object, or (stream) its events
    GET    /lmsp/v1/responses/{id}          responses:read   a stored response, as served
    DELETE /lmsp/v1/responses/{id}          responses:read   forget it
    POST   /lmsp/v1/tasks                   tasks:write      202 + Location, the task
    GET    /lmsp/v1/tasks/{task_id}         tasks:read       the task
    GET    /lmsp/v1/tasks/{task_id}/events  tasks:read       its events as SSE, resumable
    POST   /lmsp/v1/tasks/{task_id}/cancel  tasks:write      the task, once stopped
    DELETE /lmsp/v1/tasks/{task_id}         tasks:write      forget a final task (409 if it runs)

A response or a task runs through lmsp_min/generation.py as the OpenAI face's do; this
face writes the LMSP events as they are, one SSE message each (lmsp_min/sse.py), and
answers failures as problem documents (the router's default format). POSTs that
generate honour an Idempotency-Key (lmsp_min/idempotency.py). Another principal's task
or response is a 404, exactly like an unknown id: nothing tells a client that an id it
does not own exists.

Reading the request path: a response goes on to lmsp_min/generation.py (`prepare`,
`respond`, `response_events`), a task to lmsp_min/tasks.py.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import aclosing

from lmsp_min import generation, idempotency, sse
from lmsp_min.events import Event, compact_json
from lmsp_min.http import Request, Response, json_response
from lmsp_min.problems import Problem, quoted
from lmsp_min.routing import Router, read_json_body
from lmsp_min.store import LoggedEvent

TASKS = "/lmsp/v1/tasks"
_SEQ = re.compile(r"[0-9]+")
# An `after` past this (19 digits or more) is past every event a task can have: it replays
# nothing, as any number past the last event does, without parsing thousands of digits.
_PAST_EVERY_EVENT = 10**18


def add_routes(router: Router) -> None:
    router.add("GET", "/lmsp/v1/models", "models:read", list_models)
    router.add("GET", "/lmsp/v1/models/{model_id}", "models:read", get_model)
    router.add("POST", "/lmsp/v1/responses", "responses:write", create_response)
    router.add("GET", "/lmsp/v1/responses/{response_id}", "responses:read", get_response)
    router.add("DELETE", "/lmsp/v1/responses/{response_id}", "responses:read", delete_response)
    router.add("POST", TASKS, "tasks:write", create_task)
    router.add("GET", TASKS + "/{task_id}", "tasks:read", get_task)
    router.add("GET", TASKS + "/{task_id}/events", "tasks:read", task_events)
    router.add("POST", TASKS + "/{task_id}/cancel", "tasks:write", cancel_task)
    router.add("DELETE", TASKS + "/{task_id}", "tasks:write", delete_task)


def message(event: Event | LoggedEvent) -> bytes:
    """An LMSP event as its SSE message: the same bytes from a direct stream and a task's log."""
    if isinstance(event, LoggedEvent):
        return sse.message(event.data, event=event.event, event_id=event.seq)
    return sse.message(compact_json(event.data), event=event.name, event_id=event.id)


async def _messages(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    async with aclosing(events):
        async for event in events:
            yield message(event)


# -- models ------------------------------------------------------------------------------


async def list_models(request: Request, service) -> Response:
    await service.registry.refresh()  # a model pulled since the service started is listed
    capabilities = service.capabilities()
    return json_response({"object": "list",
                          "data": [entry.model_object(capabilities) for entry in service.registry]})


async def get_model(request: Request, service) -> Response:
    entry = await service.registry.find(request.params["model_id"])
    return json_response(entry.model_object(service.capabilities()))


# -- responses ---------------------------------------------------------------------------


async def create_response(request: Request, service):
    """POST /lmsp/v1/responses: a response object, or (stream) its events as SSE;
    at most once per Idempotency-Key (lmsp_min/idempotency.py)."""
    body = await read_json_body(request)
    return await idempotency.run_once(service.store, request, "POST /lmsp/v1/responses", body,
                                      lambda: _respond(body, request, service))


async def _respond(body: dict, request: Request, service):
    prepared = await generation.prepare(body, request.principal, service)
    if prepared.request.stream:
        chunks = _messages(generation.response_events(prepared, request, service))
        return sse.stream(prepared.stream_body(chunks), service.config.limits)
    await generation.respond(prepared, request, service)
    return json_response(prepared.run.response_object())


async def _stored(request: Request, service):
    response_id = request.params["response_id"]
    stored = None
    if service.stores_responses:
        stored = await service.store.get_response(response_id, request.principal)
    if stored is None:
        raise Problem("response_not_found", f"no stored response has the id {quoted(response_id)}")
    return stored


async def get_response(request: Request, service) -> Response:
    """The stored response, byte for byte as it was first served."""
    stored = await _stored(request, service)
    return Response(200, stored.body.encode("utf-8"), "application/json")


async def delete_response(request: Request, service) -> Response:
    stored = await _stored(request, service)
    await service.store.delete_response(stored.id, request.principal)
    return json_response({"id": stored.id, "object": "response.deleted", "deleted": True})


# -- tasks -------------------------------------------------------------------------------


def _tasks(service):
    if service.tasks is None:
        raise Problem("not_found", "this service does not run tasks")
    return service.tasks


def _task_reply(row, status: int = 200) -> Response:
    return json_response(row.object(), status, [("Location", f"{TASKS}/{row.id}")])


async def create_task(request: Request, service) -> Response:
    """POST /tasks: the body of POST /responses (`stream` ignored), run in the background."""
    tasks = _tasks(service)
    body = await read_json_body(request)

    async def start() -> Response:
        prepared = await generation.prepare(body, request.principal, service)
        return _task_reply(await tasks.start(prepared, body), 202)

    async def replay(task_id: str) -> Response:
        return _task_reply(await tasks.get(task_id, request.principal), 202)

    return await idempotency.run_once(service.store, request, "POST " + TASKS, body, start, replay)


async def get_task(request: Request, service) -> Response:
    return json_response((await _tasks(service).get(request.params["task_id"], request.principal)).object())


async def cancel_task(request: Request, service) -> Response:
    row = await _tasks(service).cancel(request.params["task_id"], request.principal)
    return json_response(row.object())


async def delete_task(request: Request, service) -> Response:
    """The task and its events are gone; a response it stored is not (DELETE /responses/{id})."""
    task_id = request.params["task_id"]
    await _tasks(service).delete(task_id, request.principal)
    return json_response({"id": task_id, "object": "task.deleted", "deleted": True})


def resume_point(request: Request) -> int:
    """The last event id the client has: `after` wins over `Last-Event-ID`; 0 = from the start."""
    if "after" in request.query:
        param, value = "after", request.query["after"]
    elif "last-event-id" in request.headers:
        param, value = "Last-Event-ID", request.headers["last-event-id"].strip()
    else:
        return 0
    if not _SEQ.fullmatch(value):
        raise Problem("invalid_request", f"'{param}' must be a non-negative integer (an event id)",
                      param=param)
    digits = value.lstrip("0")
    return int(digits or "0") if len(digits) < 19 else _PAST_EVERY_EVENT


async def task_events(request: Request, service):
    batches = await _tasks(service).events(request.params["task_id"], request.principal, resume_point(request))
    return sse.stream(_task_messages(batches), service.config.limits)


async def _task_messages(batches: AsyncIterator[list[LoggedEvent]]) -> AsyncIterator[bytes]:
    """A batch of logged events (as many as were committed together) in one chunk."""
    async with aclosing(batches):
        async for batch in batches:
            yield b"".join(message(event) for event in batch)

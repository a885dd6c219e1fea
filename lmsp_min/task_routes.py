"""Routes of tasks (D3) and stored responses (6.2, D6).

    POST   /lmsp/v1/tasks                   tasks:write      202 + Location, the task
    GET    /lmsp/v1/tasks/{task_id}         tasks:read       the task
    GET    /lmsp/v1/tasks/{task_id}/events  tasks:read       its events as SSE, resumable
    POST   /lmsp/v1/tasks/{task_id}/cancel  tasks:write      the task, once stopped
    DELETE /lmsp/v1/tasks/{task_id}         tasks:write      forget a final task (409 if it runs)
    GET    /lmsp/v1/responses/{id}          responses:read   a stored response, as served
    DELETE /lmsp/v1/responses/{id}          responses:read   forget it

Another principal's task or response is a 404, exactly like an unknown id:
nothing tells a client that an id it does not own exists.
"""

from __future__ import annotations

import re

from lmsp_min import idempotency
from lmsp_min.app import Router, prepare_generation, read_json_body
from lmsp_min.http import Request, Response, StreamingResponse, json_response
from lmsp_min.problems import Problem, quoted

TASKS = "/lmsp/v1/tasks"
_SEQ = re.compile(r"[0-9]+")
# An `after` past this (19 digits or more) is past every event a task can have: it replays
# nothing, as any number past the last event does, without parsing thousands of digits.
_PAST_EVERY_EVENT = 10**18


def add_routes(router: Router) -> None:
    router.add("POST", TASKS, "tasks:write", create_task)
    router.add("GET", TASKS + "/{task_id}", "tasks:read", get_task)
    router.add("GET", TASKS + "/{task_id}/events", "tasks:read", task_events)
    router.add("POST", TASKS + "/{task_id}/cancel", "tasks:write", cancel_task)
    router.add("DELETE", TASKS + "/{task_id}", "tasks:write", delete_task)
    router.add("GET", "/lmsp/v1/responses/{response_id}", "responses:read", get_response)
    router.add("DELETE", "/lmsp/v1/responses/{response_id}", "responses:read", delete_response)


def _tasks(service):
    if service.tasks is None:
        raise Problem("not_found", "this service does not run tasks")
    return service.tasks


def _task_reply(row, status: int = 200) -> Response:
    return json_response(row.object(), status, [("Location", f"{TASKS}/{row.id}")])


# -- tasks -----------------------------------------------------------------------


async def create_task(request: Request, service) -> Response:
    """POST /tasks: the body of POST /responses (`stream` ignored), run in the background."""
    tasks = _tasks(service)
    body = await read_json_body(request)

    async def start() -> Response:
        generation = await prepare_generation(body, request.principal, service)
        return _task_reply(await tasks.start(generation, body), 202)

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


async def task_events(request: Request, service) -> StreamingResponse:
    after = resume_point(request)
    chunks = await _tasks(service).events(request.params["task_id"], request.principal, after)
    return StreamingResponse(chunks)


# -- stored responses ------------------------------------------------------------


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

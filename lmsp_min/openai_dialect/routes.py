"""The routes of the OpenAI dialect, and how each runs on the LMSP machinery.

    GET    /v1/models                        models:read      the models (OpenAI's model objects)
    GET    /v1/models/{model_id}             models:read      one of them
    POST   /v1/responses                     responses:write  a response: sync, `stream`, `background`
                                                              (background also needs tasks:write)
    GET    /v1/responses/{id}                responses:read   a stored or background response;
                                                              `?stream=true&starting_after=N` replays
                                                              and follows a background one's events
                                                              (also needs tasks:read)
    DELETE /v1/responses/{id}                responses:read   forget a stored response, or a final
                                                              background one (also needs tasks:write)
    GET    /v1/responses/{id}/input_items    responses:read   the input a stored response was made from
    POST   /v1/responses/{id}/cancel         tasks:write      stop a background response
    POST   /v1/responses/input_tokens        responses:write  the input tokens a request would have
    POST   /v1/chat/completions              responses:write  a chat completion: sync or `stream`, `n` choices
    POST   /v1/completions                   responses:write  a plain completion of raw prompts (completions.py)
    POST   /v1/embeddings                    responses:write  embeddings of texts or token ids (embeddings.py)

Every request is translated (requests.py) into the LMSP request it asks for and runs
through lmsp_min/generation.py exactly as `/lmsp/v1/responses` does (`prepare`, then
`respond` or `response_events`); its LMSP events are then written as the dialect writes
them (responses.py, chat.py), framed by lmsp_min/sse.py. Every failure under /v1, an
unknown route's 404 included, is answered as an OpenAI error object (errors.py: the
mount's error format).
A background response is an LMSP task (tasks.py) whose request is the OpenAI body; it is
named by its response id (`Store.get_task_of_response`). A response stored by this
dialect is stored as the OpenAI object it served (its output items are valid LMSP input
items, so previous_response_id works across both faces); one stored through /lmsp/v1 or
by a task is an LMSP object, turned into OpenAI's when it is read here.
"""

import json
import re
import time
from contextlib import aclosing
from typing import AsyncIterator, Callable

from lmsp_min import generation, sse
from lmsp_min.events import FINAL_EVENTS
from lmsp_min.generation import Generation
from lmsp_min.http import Request, Response, json_response
from lmsp_min.openai_dialect import chat, choices, completions, embeddings, errors, requests, responses
from lmsp_min.problems import Problem, quoted
from lmsp_min.routing import Router, read_json_body
from lmsp_min.store import FINAL_STATUSES, TaskRow
from lmsp_min.tasks import output_from_events
from lmsp_min.validate import invalid, kept_items

RESPONSES = "/v1/responses"


def add_routes(router: Router) -> None:
    router.mount("/v1", errors.error_response)
    for method, path, scope, handler in (
        ("GET", "/v1/models", "models:read", list_models),
        ("GET", "/v1/models/{model_id}", "models:read", get_model),
        ("POST", RESPONSES, "responses:write", create_response),
        ("POST", RESPONSES + "/input_tokens", "responses:write", count_input_tokens),  # (before {response_id})
        ("GET", RESPONSES + "/{response_id}", "responses:read", get_response),
        ("DELETE", RESPONSES + "/{response_id}", "responses:read", delete_response),
        ("GET", RESPONSES + "/{response_id}/input_items", "responses:read", list_input_items),
        ("POST", RESPONSES + "/{response_id}/cancel", "tasks:write", cancel_response),
        ("POST", "/v1/chat/completions", "responses:write", create_chat_completion),
        ("POST", "/v1/completions", "responses:write", completions.create_completion),
        ("POST", "/v1/embeddings", "responses:write", embeddings.create_embeddings),
    ):
        router.add(method, path, scope, handler)


# -- models ------------------------------------------------------------------------------


def _model_object(entry) -> dict:
    return {"id": entry.id, "object": "model", "created": entry.created_at, "owned_by": "local"}


async def list_models(request: Request, service) -> Response:
    await service.registry.refresh()
    return json_response({"object": "list", "data": [_model_object(entry) for entry in service.registry]})


async def get_model(request: Request, service) -> Response:
    return json_response(_model_object(await service.registry.find(request.params["model_id"])))


# -- generating ----------------------------------------------------------------------------


async def _lmsp_events(prepared: Generation, call: requests.Translated, request: Request,
                       service) -> AsyncIterator[tuple[str, dict]]:
    """The (name, data) of each LMSP event of a streamed generation (generation.py's
    `response_events`), an error naming the client's params (`call.rename_document`)."""
    async with aclosing(generation.response_events(prepared, request, service)) as events:
        async for event in events:
            data = event.data
            if "error" in data:
                data = {**data, "error": call.rename_document(data["error"])}
            yield event.name, data


async def _respond(prepared: Generation, call: requests.Translated, request: Request, service) -> None:
    """Run a synchronous generation to its end; a failed one is its problem, named as the
    client's request names things."""
    try:
        await generation.respond(prepared, request, service)
    except Problem as problem:
        raise call.rename(problem) from None


# -- POST /v1/responses ------------------------------------------------------------------------


async def _prepare_response(call: requests.Translated, principal: str, service) -> Generation:
    """The LMSP generation of a Responses request: its instructions as a system message
    first, then the conversation previous_response_id names, then its own input."""
    prefix = [] if call.instructions is None else [{"type": "message", "role": "system",
                                                    "content": call.instructions}]
    effective = await generation.effective_input(service, principal, call.previous_response_id, call.input)
    previous = effective[:len(effective) - len(call.input)]
    call.skipped, call.previous = len(prefix), len(previous)
    try:
        prepared = await generation.prepare({**call.body, "input": [*prefix, *effective]}, principal, service)
    except Problem as problem:
        raise call.rename(problem) from None
    # What a next turn's previous_response_id brings back: not these instructions (as OpenAI's API)
    prepared.input_items = kept_items(effective)
    return prepared


async def create_response(request: Request, service):
    body = await read_json_body(request)
    call = requests.responses_request(body, service.stores_responses)
    if call.background:
        return await _create_background(call, body, request, service)
    prepared = await _prepare_response(call, request.principal, service)
    echo = responses.echo_of(body, store=prepared.request.store)
    ended_at = _read_once(time.time)  # the same moment in the stored body, the reply and the final event

    def openai_object() -> dict:
        lmsp = prepared.run.response_object()
        return responses.response_object(lmsp, echo, ended_at() if lmsp["status"] == "completed" else None)

    prepared.stored_object = openai_object  # (stored as served: previous_response_id reads either)
    if call.stream:
        adapter = responses.ResponseEvents(prepared.run.id, prepared.run.created_at, prepared.run.model_id,
                                           echo, ended_at)
        chunks = _translated(_lmsp_events(prepared, call, request, service), adapter)
        return sse.stream(prepared.stream_body(chunks), service.config.limits)
    await _respond(prepared, call, request, service)
    return json_response(openai_object())


def _read_once(clock: Callable[[], float]) -> Callable[[], float]:
    """`clock`, read the first time only."""
    moment: list[float] = []

    def read() -> float:
        if not moment:
            moment.append(clock())
        return moment[0]
    return read


async def count_input_tokens(request: Request, service) -> Response:
    """What a Responses request's input comes to in tokens (its instructions, the conversation
    previous_response_id names, the tools as its model's prompt shows them): it is prepared
    as `create_response` prepares it, then not generated."""
    body = await read_json_body(request)
    prepared = await _prepare_response(requests.responses_request(body, service.stores_responses),
                                       request.principal, service)
    prepared.release()
    counted = prepared.prepared.counts.input_tokens
    return json_response({"object": "response.input_tokens", "input_tokens": counted})


async def _translated(events: AsyncIterator[tuple[str, dict]],
                      adapter: responses.ResponseEvents) -> AsyncIterator[bytes]:
    """LMSP events as the Responses stream's SSE messages."""
    async with aclosing(events):
        async for name, data in events:
            yield b"".join(responses.event_message(event) for event in adapter.translate(name, data))


async def _create_background(call: requests.Translated, body: dict, request: Request, service):
    """A background response is an LMSP task; its id is the response's."""
    service.auth.authenticate(request.headers.get("authorization"), "tasks:write", request.headers.get("host"))
    if service.tasks is None:
        raise Problem("unsupported_capability", "this service does not run background responses", param="background")
    if body.get("store") is False:
        raise invalid("store", "a background response is stored until it is fetched: 'store' cannot be false")
    prepared = await _prepare_response(call, request.principal, service)
    row = await service.tasks.start(prepared, body)
    if call.stream:
        return await _task_stream(row, request.principal, service, after=-1)
    return json_response(await _task_response(row, service))


# -- background and stored responses ---------------------------------------------------------------


def _task_echo(row: TaskRow, service) -> dict:
    body = json.loads(row.request)
    return responses.echo_of(body, store=_task_stores(body, service), background=True)


def _task_stores(body: dict, service) -> bool:
    """Whether a task's response is stored when it ends: a background response's unless
    `store: false` (which the dialect refuses), a task made through /lmsp/v1 if it asked."""
    made_here = body.get("background") is True  # (LMSP refuses a `background` field)
    return service.stores_responses and (body.get("store") is not False if made_here else body.get("store") is True)


async def _task_response(row: TaskRow, service) -> dict:
    """The response of a task as it stands: final, or as far as its committed events go."""
    if row.response is not None:
        lmsp = json.loads(row.response)
    else:
        events = await service.store.read_events(row.id, 0)
        lmsp = {"id": row.response_id, "object": "response", "created_at": row.created_at, "status": row.status,
                "model": row.model, "output": output_from_events(events), "usage": None, "error": None,
                "incomplete_details": None}
    return responses.response_object(lmsp, _task_echo(row, service), row.ended_at)


async def _task_of(response_id: str, principal: str, service) -> TaskRow | None:
    if service.tasks is None:
        return None
    return await service.store.get_task_of_response(response_id, principal)


def _not_found(response_id: str) -> Problem:
    return Problem("response_not_found", f"no stored or background response has the id {quoted(response_id)}")


async def _task_stream(row: TaskRow, principal: str, service, after: int):
    """A background response's events from the start, as OpenAI events, those numbered
    after `after` sent (the SDK's resume filters on sequence_number too)."""
    try:
        batches = await service.tasks.events(row.id, principal, 0)
    except Problem as problem:  # (410 once its events expired: named by the id the client knows)
        if problem.code != "event_history_expired":
            raise
        raise Problem("event_history_expired", f"the events of response '{row.response_id}' are no longer "
                      "kept; retrieve it without 'stream' for its result") from None
    adapter = responses.ResponseEvents(row.response_id, row.created_at, row.model, _task_echo(row, service),
                                       lambda: row.ended_at)

    async def body() -> AsyncIterator[bytes]:
        nonlocal row
        async with aclosing(batches):
            async for batch in batches:
                if row.ended_at is None and any(event.event in FINAL_EVENTS for event in batch):
                    # (its final event and ended_at are written in one transaction: the row has it now)
                    row = await service.store.get_task(row.id, principal) or row
                events = [translated for event in batch
                          for translated in adapter.translate(event.event, json.loads(event.data))
                          if translated["sequence_number"] > after]
                if events:
                    yield b"".join(responses.event_message(event) for event in events)

    return sse.stream(body(), service.config.limits)


_SEQUENCE = re.compile(r"[0-9]{1,18}")


async def get_response(request: Request, service):
    response_id = request.params["response_id"]
    if request.query.get("stream") in ("true", "1"):  # a task's events: tasks:read, as on /lmsp/v1
        service.auth.authenticate(request.headers.get("authorization"), "tasks:read", request.headers.get("host"))
        row = await _task_of(response_id, request.principal, service)
        if row is None:
            if service.stores_responses and await service.store.get_response(response_id, request.principal):
                raise invalid("stream", "only a background response can be streamed again: this one "
                              "was not created with 'background': true")
            raise _not_found(response_id)
        after = request.query.get("starting_after", "-1")
        if after != "-1" and not _SEQUENCE.fullmatch(after):
            raise invalid("starting_after", "'starting_after' must be a sequence number (a non-negative integer)")
        return await _task_stream(row, request.principal, service, int(after))
    return json_response(await _retrieve(response_id, request.principal, service))


async def _retrieve(response_id: str, principal: str, service) -> dict:
    row = await _task_of(response_id, principal, service)
    stored = await service.store.get_response(response_id, principal) if service.stores_responses else None
    if stored is not None:
        body = json.loads(stored.body)
        if responses.is_openai_object(body):
            return body
        echo = _task_echo(row, service) if row is not None else responses.echo_of({}, store=True)
        return responses.response_object(body, echo, row.ended_at if row is not None else None)
    if row is None or _stored_and_deleted(row, service):
        raise _not_found(response_id)
    return await _task_response(row, service)


def _stored_and_deleted(row: TaskRow, service) -> bool:
    """Whether a task's response, which it stored, has been deleted (DELETE /lmsp/v1/responses/{id})."""
    return row.status in FINAL_STATUSES and _task_stores(json.loads(row.request), service)


async def delete_response(request: Request, service) -> Response:
    """A background response is its task and the response it stored, one resource on this
    face: both go, as DELETE /lmsp/v1/tasks/{id} would (409 while it runs), then the stored one."""
    response_id = request.params["response_id"]
    row = await _task_of(response_id, request.principal, service)
    stored = await service.store.get_response(response_id, request.principal) if service.stores_responses else None
    if stored is None and (row is None or _stored_and_deleted(row, service)):
        raise _not_found(response_id)  # (as GET finds it)
    if row is not None:
        service.auth.authenticate(request.headers.get("authorization"), "tasks:write", request.headers.get("host"))
        try:
            await service.tasks.delete(row.id, request.principal)
        except Problem as problem:  # (409 while it runs: named by the id the client knows)
            if problem.code != "task_running":
                raise
            raise Problem("task_running", f"response {quoted(response_id)} is {row.status}: cancel it before "
                          "deleting it") from None
    if stored is not None:
        await service.store.delete_response(stored.id, request.principal)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def list_input_items(request: Request, service) -> Response:
    """A stored response's input (its conversation's earlier turns too; not its instructions),
    paged as OpenAI pages it: `order` (desc by default), `limit` (20, at most 100), `after` an item id."""
    response_id = request.params["response_id"]
    stored = await service.store.get_response(response_id, request.principal) if service.stores_responses else None
    if stored is None:
        raise _not_found(response_id)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", "'order' must be 'asc' or 'desc'")
    limit = request.query.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise invalid("limit", "'limit' must be an integer from 1 to 100")
    items = responses.input_items(stored.input, response_id)
    if order == "desc":
        items.reverse()
    if "after" in request.query:
        ids = [item["id"] for item in items]
        if request.query["after"] not in ids:
            raise invalid("after", "'after' must be the id of one of this response's input items")
        items = items[ids.index(request.query["after"]) + 1:]
    page = items[:int(limit)]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})


async def cancel_response(request: Request, service) -> Response:
    response_id = request.params["response_id"]
    row = await _task_of(response_id, request.principal, service)
    if row is None:
        stored = await service.store.get_response(response_id, request.principal) if service.stores_responses else None
        if stored is not None:
            raise invalid("response_id", "only a background response can be cancelled")
        raise _not_found(response_id)
    row = await service.tasks.cancel(row.id, request.principal)
    return json_response(await _task_response(row, service))


# -- POST /v1/chat/completions ---------------------------------------------------------------------


async def create_chat_completion(request: Request, service):
    body = await read_json_body(request)
    call = requests.chat_request(body)
    prepared = await choices.prepare(call, [(call.input, None)], request.principal, service)
    if call.stream:  # (a chat completion is never stored: its LMSP request says store false)
        chunks = _chat_sse(prepared, call, request, service)
        return sse.stream(choices.stream_body(prepared, chunks), service.config.limits)
    await choices.respond(prepared, call, request, service)
    return json_response(chat.completion_object([choice.run.response_object() for choice in prepared],
                                                call.logprobs))


async def _chat_sse(prepared: list[Generation], call: requests.Translated, request: Request,
                    service) -> AsyncIterator[bytes]:
    run = prepared[0].run
    chunks = chat.ChatChunks(run.id, run.created_at, run.model_id, call.include_usage, len(prepared), call.logprobs)
    async with aclosing(choices.events(prepared, call, request, service)) as events:
        async for index, name, data in events:
            body = chunks.translate(index, name, data)
            if body:
                yield body

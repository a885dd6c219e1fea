"""Routes: from an HTTP request to a response object, an event stream or a problem.

`Router` maps (method, path) to a handler and the scope it needs (D7); a path
no route matches is `404 not_found`, a known path with another method `405
method_not_allowed` with `Allow`. Every handler is
`async def handler(request, service) -> Response | StreamingResponse`.

`POST /lmsp/v1/responses` is built from two reusable steps, which tasks use too:

    generation = await prepare_generation(body, principal, service)
        # validate, find and load the model, check capabilities, resolve
        # previous_response_id, render and tokenize (context window checked here,
        # before anything is generated)
    generation.events()
        # the LMSP events (events.ResponseRun), from response.created to a final event

The generation holds its model's admission (lmsp_min/admission.py): it waits for
its turn, fair between principals, before the engine generates; whoever owns it
releases it explicitly, `generation.release()`, once it is over or will never
start (a synchronous response when it returns, a stream when the HTTP layer
closes its body, a task when its runner ends).

Reading the request path: lmsp_min/http.py calls `App` here; the request is
validated in lmsp_min/validate.py, prepared by engine/chat.py (`prepare_chat`),
and its events come from lmsp_min/events.py (`ResponseRun.events`) fed by
engine/chat.py (`generate_chat`); `_sse` below turns them into the SSE body.
"""

import json
import re
from collections.abc import AsyncIterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from urllib.parse import unquote

import trio

from lmsp_min import idempotency, openai_dialect
from lmsp_min.admission import Admission
from lmsp_min.events import SSE_KEEPALIVE, Event, ResponseRun, ServiceStopping
from lmsp_min.http import Request, Response, StreamingResponse, json_response
from lmsp_min.problems import Problem, clipped, quoted, shutting_down
from lmsp_min.validate import (
    ResponsesRequest,
    items_to_messages,
    kept_items,
    parse_json_body,
    validate_responses_request,
)

# Rendering and tokenizing a short input takes well under a millisecond, less
# than handing it to a worker thread and back; longer inputs, and requests that
# compile a grammar (tools, json_schema), go to a thread so that the event loop
# is never held for long.
INLINE_PREPARE_CHARS = 1024

# -- routing -----------------------------------------------------------------------------


@dataclass
class Route:
    pattern: str  # e.g. "/lmsp/v1/models/{model_id}"
    regex: re.Pattern
    handlers: dict  # method -> (scope, handler)


class Router:
    """(method, path) -> (handler, scope, path parameters)."""

    def __init__(self):
        self.routes: list[Route] = []

    def add(self, method: str, pattern: str, scope: str, handler) -> None:
        """Register `handler` for `method` on `pattern` ({name} matches one path segment)."""
        for route in self.routes:
            if route.pattern == pattern:
                route.handlers[method] = (scope, handler)
                return
        regex = re.compile("".join(
            f"(?P<{part[1:-1]}>[^/]+)" if part.startswith("{") else re.escape(part)
            for part in re.split(r"(\{[a-z_]+\})", pattern)
        ))
        self.routes.append(Route(pattern, regex, {method: (scope, handler)}))

    def match(self, method: str, path: str):
        """HEAD is answered by the GET handler (the HTTP layer leaves the body out)."""
        for route in self.routes:
            found = route.regex.fullmatch(path)
            if found is None:
                continue
            if method == "HEAD" and "GET" in route.handlers:
                method = "GET"
            if method not in route.handlers:
                methods = set(route.handlers) | ({"HEAD"} if "GET" in route.handlers else set())
                allow = ", ".join(sorted(methods))
                raise Problem("method_not_allowed",
                              f"{clipped(method)} is not allowed on this route (allowed: {allow})",
                              headers=[("Allow", allow)])
            scope, handler = route.handlers[method]
            return handler, scope, {name: unquote(value) for name, value in found.groupdict().items()}
        raise Problem("not_found", "no such route")


_VERSION_1 = re.compile(r"\s*0*1(?:\.[0-9]+)*\s*")  # a 1.x, as text: "01.2" is 1.2
MAX_VERSION_CHARS = 64  # an LMSP-Version header longer than this is no version we speak


def check_version(value: str | None) -> None:
    """D1: absent means 1.0, any 1.x is fine, another major version is refused.

    A header sent twice arrives joined ("1.0, 1.0"): each value must be a 1.x. The major
    version is compared as text, never converted: int() of thousands of digits raises
    (Python's int_max_str_digits), and costs time quadratic in the length before that.
    """
    if value is None:
        return
    if len(value) > MAX_VERSION_CHARS or not all(_VERSION_1.fullmatch(part) for part in value.split(",")):
        raise Problem("unsupported_version",
                      f"LMSP-Version {quoted(value.strip(), 20)} is not supported; this service speaks LMSP 1.0")


class App:
    """The service's request handler: route, authenticate, check the version, dispatch."""

    def __init__(self, service, router: Router):
        self.service = service
        self.router = router

    async def __call__(self, request: Request):
        try:
            return await self._dispatch(request)
        except Problem as problem:
            if openai_dialect.is_dialect_path(request.path):  # /v1: an OpenAI error object
                return openai_dialect.error_response(problem)
            raise

    async def _dispatch(self, request: Request):
        if self.service.http is not None and self.service.http.draining:
            raise shutting_down()
        handler, scope, params = self.router.match(request.method, request.path)
        request.params = params
        request.principal = self.service.auth.authenticate(request.headers.get("authorization"), scope,
                                                           request.headers.get("host"))
        check_version(request.headers.get("lmsp-version"))
        return await handler(request, self.service)


def default_router() -> Router:
    router = Router()
    router.add("GET", "/lmsp/v1/models", "models:read", list_models)
    router.add("GET", "/lmsp/v1/models/{model_id}", "models:read", get_model)
    router.add("POST", "/lmsp/v1/responses", "responses:write", create_response)
    from lmsp_min.task_routes import add_routes  # (it imports this module)

    add_routes(router)  # tasks and stored responses
    openai_dialect.add_routes(router)  # the OpenAI dialect at /v1
    return router


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


async def read_json_body(request: Request) -> dict:
    """The body of a JSON request: 415 unless it is declared application/json."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        shown = media_type or "none"
        raise Problem("unsupported_media_type",
                      f"the body must be application/json (Content-Type: {clipped(shown)})")
    return parse_json_body(await request.body())


class GenerationsInProgress:
    """The responses generating now, so that a stopping service can end them itself.

    Once a drain's grace is over, `stop` cancels each one's wait for the engine: the
    response ends `failed` with `model_unavailable`, which a stream gets as its final
    event and a synchronous request as a 503, instead of a connection cut mid-body.
    """

    def __init__(self):
        self._waits: set[trio.CancelScope] = set()
        self.stopped = False

    @contextmanager
    def engine_wait(self):
        """A cancel scope around one wait for the engine's next event."""
        with trio.CancelScope() as scope:
            if self.stopped:
                scope.cancel()
            self._waits.add(scope)
            try:
                yield scope
            finally:
                self._waits.discard(scope)

    def stop(self) -> None:
        self.stopped = True
        for scope in list(self._waits):
            scope.cancel()


@dataclass
class PreparedResponse:
    """A validated, prepared response, ready to generate."""

    request: ResponsesRequest
    principal: str
    input_items: list[dict]  # the effective input (previous response's items, then this request's),
                             # as a stored response keeps it (validate.kept_items)
    model: object  # the engine model
    prepared: object  # the engine's prepared chat (prompt tokens, constraints)
    run: ResponseRun
    admission: Admission  # of this response's model (ModelEntry.admit): its turn, released by `release`
    in_progress: GenerationsInProgress  # the service's, which ends it if the service stops first

    def events(self) -> AsyncIterator[Event]:
        """The LMSP events of this response (start it once): the engine's chat events
        made LMSP events by `ResponseRun.events`. Its admission is released as soon as
        the engine's events end."""
        return self.run.events(self._engine_events())

    def release(self) -> None:
        """Release the admission (again: nothing). The owner calls it when the response
        is over, or will never be generated."""
        self.admission.release()

    async def _engine_events(self):
        """The engine's chat events, asked for only when the first one is wanted, once
        the admission's turn has come.

        So that an engine refusing to start fails inside the event generator, where it
        becomes a failed response, like any generation failure. A service that stops
        cuts the wait for the turn or the next event (never a yield: the consumer runs
        outside the cancel scope), and ServiceStopping ends the response. A schema whose
        bound only the output reaches (engine/constrain/matcher.py) is the Problem it is
        while preparing.
        """
        from engine.errors import SchemaError

        try:
            with self.in_progress.engine_wait() as wait:
                await self.admission.turn()
            if wait.cancelled_caught:
                raise ServiceStopping
            chat = self.model.generate_chat(self.prepared)
            try:
                while True:
                    with self.in_progress.engine_wait() as wait:
                        try:
                            event = await chat.__anext__()
                        except StopAsyncIteration:
                            return
                        except SchemaError as exc:
                            raise _schema_problem(exc) from None
                    if wait.cancelled_caught:
                        raise ServiceStopping
                    yield event
            finally:
                if hasattr(chat, "aclose"):
                    await chat.aclose()
        finally:
            self.release()


async def prepare_generation(body: dict, principal: str, service) -> PreparedResponse:
    """Everything that can refuse a request, done before any generation (D1, D2, D4, D9)."""
    from engine.errors import ChatTemplateError, ContextLengthExceeded, SchemaError

    request = validate_responses_request(body)
    entry = await service.registry.find(request.model, param="model")
    if request.previous_response_id is not None and not service.stores_responses:
        raise Problem("unsupported_capability",
                      "this service does not store responses, so previous_response_id cannot be used",
                      param="previous_response_id")
    model = await entry.load(service.log)
    if entry.full:  # refused before the work below (entry.admit at the end counts it in)
        raise Problem("rate_limited", "too many requests are waiting for this model; retry in a moment",
                      headers=[("Retry-After", "1")])
    if request.tools and "tools" not in entry.capabilities:
        raise Problem("unsupported_capability", f"model '{entry.id}' has no 'tools' capability", param="tools")
    if request.json_schema is not None and "structured_output" not in entry.capabilities:
        raise Problem("unsupported_capability", f"model '{entry.id}' has no 'structured_output' capability",
                      param="response_format")

    items = request.input
    if request.previous_response_id is not None:
        items = await service.conversation_input(principal, request.previous_response_id, request.input)
    messages = items_to_messages(items, input_start=len(items) - len(request.input))
    chat_request = _chat_request(request, messages)
    try:
        constrained = bool(request.tools) or request.json_schema is not None  # compiles a grammar
        if not constrained and _text_size(messages) <= INLINE_PREPARE_CHARS:
            prepared = model.prepare_chat(chat_request)
        else:
            prepared = await trio.to_thread.run_sync(model.prepare_chat, chat_request)
    except ContextLengthExceeded as exc:  # param: what to change, the input only when it alone fills the window
        param = "input" if exc.n_prompt >= exc.n_ctx else "max_output_tokens"
        raise Problem("context_length_exceeded", str(exc), param=param) from None
    except SchemaError as exc:
        raise _schema_problem(exc) from None
    except ChatTemplateError as exc:
        raise Problem("invalid_request", f"the model's chat template cannot render this input: {exc}",
                      param="input") from None
    run = ResponseRun(entry.id, log=service.log, counts=prepared.counts)
    admission = entry.admit(principal)  # (the caller owns it from here, through the PreparedResponse)
    return PreparedResponse(request, principal, kept_items(items), model, prepared, run, admission,
                            service.generations)


def _schema_problem(exc) -> Problem:
    """D5: a schema we cannot enforce (an engine SchemaError) is refused by name, where it
    is in the request's json_schema or tools (the engine says which: a request may have
    both), whether preparing or generating found it."""
    param = "tools" if exc.field == "tools" else "response_format.json_schema.schema"
    detail = f"the schema cannot be enforced: {exc}"
    if exc.keyword and exc.keyword not in detail:
        detail += f" (keyword '{exc.keyword}')"
    return Problem("invalid_request", detail, param=param + _param_suffix(exc.path))


_SCHEMA_MAPPINGS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


def _param_suffix(pointer: str) -> str:
    """A path into the tools or a schema, as the compiler writes it ("/0/properties/x/anyOf/1",
    keys as they are), as a param suffix written as validation writes params:
    "[0].properties.x.anyOf[1]" (a number is an array index, except as a key of a mapping
    such as `properties`)."""
    suffix, previous = "", None
    for part in pointer.split("/")[1:]:
        suffix += f"[{part}]" if part.isdigit() and previous not in _SCHEMA_MAPPINGS else f".{part}"
        previous = part
    return suffix


def _text_size(messages: list[dict]) -> int:
    return sum(len(m["content"]) + sum(len(str(c["function"]["arguments"])) for c in m.get("tool_calls", ()))
               for m in messages)


def _chat_request(request: ResponsesRequest, messages: list[dict]):
    from engine.chat import ChatRequest
    from engine.sampling import SamplingParams

    sampling = {}
    if request.temperature is not None:
        sampling["temperature"] = request.temperature
    for name in ("top_k", "top_p", "min_p", "seed"):
        if getattr(request, name) is not None:
            sampling[name] = getattr(request, name)
    tools = [{"name": t.name, "description": t.description, "parameters": t.parameters}
             for t in request.tools]
    return ChatRequest(
        messages=messages,
        max_tokens=request.max_output_tokens,
        sampling=SamplingParams(**sampling),
        stop=request.stop,
        tools=tools or None,
        tool_choice=request.tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        allowed_tools=request.allowed_tools,
        json_schema=request.json_schema,
    )


async def create_response(request: Request, service):
    """POST /lmsp/v1/responses: a response object, or (stream) its events as SSE;
    at most once per Idempotency-Key (lmsp_min/idempotency.py)."""
    body = await read_json_body(request)
    return await idempotency.run_once(service.store, request, "POST /lmsp/v1/responses", body,
                                      lambda: _respond(body, request, service))


async def _respond(body: dict, request: Request, service):
    generation = await prepare_generation(body, request.principal, service)
    if generation.request.stream:
        return StreamingResponse(_SSEBody(generation, request, service), idle_chunk=SSE_KEEPALIVE,
                                 idle_interval=service.config.limits.stream_keepalive)
    request.cancel_on_disconnect()  # nobody left to read the response: stop generating
    with generation.admission:
        async with aclosing(generation.events()) as events:
            async for event in events:
                if event.is_final:
                    await _finish(generation, request, service)
    run = generation.run
    if run.status == "failed":
        retry = [("Retry-After", "5")] if run.error["code"] == "model_unavailable" else None  # stopping
        raise Problem(run.error["code"], run.error["detail"], param=run.error.get("param"), headers=retry)
    return json_response(run.response_object())


class _SSEBody:
    """The body of a streamed response (`_sse`), which releases the generation's
    admission when closed: the HTTP layer closes a body however the response ends,
    even one that never started (its client left before the head was sent)."""

    def __init__(self, generation: PreparedResponse, request: Request, service):
        self._generation = generation
        self._chunks = _sse(generation, request, service)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            self._generation.release()


async def _sse(generation: PreparedResponse, request: Request, service) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response: each event as it is produced.

    A client that leaves mid-stream stops the generation (D4). With `store: true` the
    response is stored even so, `cancelled` with what was generated until then (or as it
    ended, when the client left while it was being stored): the client has its id from
    `response.created`, and may come back for it.
    """
    run = generation.run
    finished = False  # _finish done: noted, and stored if asked
    with generation.admission:  # (released here once started; _SSEBody if it never starts)
        async with aclosing(generation.events()) as events:
            try:
                async for event in events:
                    if event.is_final:
                        await _finish(generation, request, service)
                        finished = True
                    yield event.sse()
            except Exception as exc:
                service.log(f"error: the stream of {run.id} failed: {type(exc).__name__}: {exc}")
                yield run.error_event(Problem("internal_error", "an unexpected error occurred")).sse()
            except BaseException:  # cancelled (the client left) or closed (GeneratorExit), mid-response
                if not finished and generation.request.store:
                    with trio.CancelScope(shield=True):
                        await events.aclose()  # the generation ends first (D4), not after the write
                        if run.status == "in_progress":
                            run.cancelled()
                        try:
                            await _finish(generation, request, service)
                        except Exception as exc:  # (the client is gone either way)
                            service.log(f"error: storing {run.id}, whose client left, failed: "
                                        f"{type(exc).__name__}: {exc}")
                raise


async def _finish(generation: PreparedResponse, request: Request, service) -> None:
    """Before the final event goes out: note the tokens, store the response if asked (D6).

    A failed response is stored too when it was streamed, as a task's is: the client has
    its id ("failed" appears in stored responses, 6.2). A synchronous request that fails
    gets a problem document instead, which names no response to fetch later.
    """
    usage = generation.run.usage
    if usage is not None:
        request.log_note = f"tokens={usage['input_tokens']}+{usage['output_tokens']}"
    failed_synchronously = generation.run.status == "failed" and not generation.request.stream
    if generation.request.store and service.stores_responses and not failed_synchronously:
        await service.store.put_response(
            generation.run.id, generation.principal, generation.input_items,
            json.dumps(generation.run.response_object(), ensure_ascii=False, separators=(",", ":")),
        )

"""The pipeline both faces mount: a request prepared, generated, and its events pumped to their end.

Every generating route runs through these steps, whatever face it is on:

    generation = await prepare(body, principal, service)
        # everything that can refuse the request, before any token (D1, D2, D4, D9):
        # validate (lmsp_min/validate.py), find and load the model, check its
        # capabilities, resolve previous_response_id, render and tokenize (the
        # context window is checked here)
    pump(generation, finish, cut)
        # the one loop from the engine to the final event: the engine's chat events
        # (engine/api.py) made LMSP events (lmsp_min/events.py `ResponseRun`), the final
        # one recorded by `finish` before it goes out

and then one of:

    await respond(generation, request, service)     a synchronous response, to its end
    response_events(generation, request, service)   a streamed one's events, to frame as SSE
    Tasks.start(generation, body)                   a task (lmsp_min/tasks.py), whose log `finish` commits

A direct response's `finish` notes its tokens on the access-log line and stores it if
asked (D6): `Generation.stored_object` is what is stored (the LMSP response object, or
the OpenAI one that face served). The LMSP face (lmsp_min/routes.py) frames the events as
they are, the OpenAI face (lmsp_min/openai_dialect/routes.py) translates them first.

A generation holds its model's admission (lmsp_min/admission.py): it waits for its
turn, fair between principals, before the engine generates. Whoever owns it releases it,
`generation.release()`, once it is over or will never start: `respond` when it returns, a
stream's body when the HTTP layer closes it (`Generation.stream_body`), a task's runner.

Reading the request path: the faces call `prepare` with the LMSP request body; the
engine's side is engine/api.py; the events go on to lmsp_min/events.py, then to
lmsp_min/sse.py (streams) or lmsp_min/store/ (stored responses).
"""

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, contextmanager
from dataclasses import dataclass

import trio

from engine import describe
from engine.api import ChatRequest, SamplingParams
from engine.errors import ChatTemplateError, ContextLengthExceeded, OutputBudgetTooSmall, PromptError, SchemaError
from lmsp_min.admission import Admission
from lmsp_min.events import Event, ResponseRun, ServiceStopping, compact_json
from lmsp_min.http import Request
from lmsp_min.problems import Problem
from lmsp_min.registry import rate_limited
from lmsp_min.validate import (EXTENSION, ResponsesRequest, items_to_messages, kept_items,
                               validate_responses_request)

# Rendering and tokenizing a short input takes well under a millisecond, less
# than handing it to a worker thread and back; longer inputs, and requests that
# compile a grammar (tools, json_schema), go to a thread so that the event loop
# is never held for long.
INLINE_PREPARE_CHARS = 1024


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
class Generation:
    """A validated, prepared response, ready to generate."""

    request: ResponsesRequest
    principal: str
    input_items: list[dict]  # the effective input (previous response's items, then this request's),
                             # as a stored response keeps it (validate.kept_items)
    model: object  # the engine model (engine/model.py `Model`)
    prepared: object  # the engine's prepared chat (prompt tokens, constraints)
    run: ResponseRun
    admission: Admission  # of this response's model (ModelEntry.admit): its turn, released by `release`
    in_progress: GenerationsInProgress  # the service's, which ends it if the service stops first
    stored_object: Callable[[], dict] | None = None  # what `store` keeps; None: run.response_object()
    body: dict | None = None  # the LMSP request body it was prepared from (`prepare` again gives it again)

    def events(self) -> AsyncIterator[Event]:
        """The LMSP events of this response (start it once): the engine's chat events
        made LMSP events by `ResponseRun.events`. Its admission is released as soon as
        the engine's events end."""
        return self.run.events(self._engine_events())

    def release(self) -> None:
        """Release the admission (again: nothing). The owner calls it when the response
        is over, or will never be generated."""
        self.admission.release()

    def stream_body(self, chunks: AsyncIterator[bytes]) -> "StreamBody":
        """`chunks` as the body of a streamed response, which releases this generation
        when the HTTP layer closes it."""
        return StreamBody([self], chunks)

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


class StreamBody:
    """The body of a streamed response, which releases its generations' admissions when
    closed (one, or an OpenAI request's n choices): the HTTP layer closes a body however
    the response ends, even one that never started (its client left before the head was sent)."""

    def __init__(self, generations: "list[Generation]", chunks: AsyncIterator[bytes]):
        self._generations = generations
        self._chunks = chunks

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            for generation in self._generations:
                generation.release()


# -- preparing -------------------------------------------------------------------------------


async def prepare(body: dict, principal: str, service, prompt: str | list[int] | None = None) -> Generation:
    """Everything that can refuse a request, done before any generation (D1, D2, D4, D9).

    `prompt`, a raw prompt (text or token ids: /v1/completions), is generated instead of
    the input's messages, without the chat template (engine/chat.py `prepare_text`); the
    body's `input` is then a stand-in, one user message holding the prompt's text (what
    validation reads, and a stored response would keep).
    """
    request = validate_responses_request(body)
    entry = await service.registry.find(request.model, param="model")
    if not describe.generates(entry.architecture):
        raise Problem("unsupported_capability", f"model '{entry.id}' is an embedding model ({entry.architecture}): "
                      "it does not generate text; ask POST /v1/embeddings", param="model")
    if request.previous_response_id is not None:  # (refused before a model is loaded for it;
        _require_conversations(service)           # effective_input, below, asks for others too)
    model = await entry.load(service.log)
    if entry.full_for(principal):  # refused before the work below (entry.admit at the end counts it in)
        raise rate_limited()
    _check_capabilities(request, entry)
    if request.logit_bias:
        _check_vocabulary(request, model.info.n_vocab)
    items = await effective_input(service, principal, request.previous_response_id, request.input)
    messages = items_to_messages(items, input_start=len(items) - len(request.input))
    prepared = await _prepare_chat(model, _chat_request(request, messages), constrained=bool(request.tools)
                                   or request.json_schema is not None, prompt=prompt)
    run = ResponseRun(entry.id, log=service.log, counts=prepared.counts, logprobs=request.logprobs is not None)
    admission = entry.admit(principal)  # (the caller owns it from here, through the Generation)
    return Generation(request, principal, kept_items(items), model, prepared, run, admission, service.generations,
                      body=body)


def _check_capabilities(request: ResponsesRequest, entry) -> None:
    if request.tools and "tools" not in entry.capabilities:
        raise Problem("unsupported_capability", f"model '{entry.id}' has no 'tools' capability", param="tools")
    if request.json_schema is not None and "structured_output" not in entry.capabilities:
        raise Problem("unsupported_capability", f"model '{entry.id}' has no 'structured_output' capability",
                      param="response_format")


def _check_vocabulary(request: ResponsesRequest, n_vocab: int) -> None:
    """The token ids of the request's logit_bias are in the model's vocabulary (a raw
    prompt's are the engine's to check: PromptError)."""
    for token, _ in request.logit_bias:
        if token >= n_vocab:
            raise Problem("invalid_request", f"logit_bias names token {token}, outside the vocabulary of "
                          f"model '{request.model}' (0 to {n_vocab - 1})",
                          param=f"extensions.{EXTENSION}.logit_bias.{token}")


def _require_conversations(service) -> None:
    if not service.stores_responses:
        raise Problem("unsupported_capability",
                      "this service does not store responses, so previous_response_id cannot be used",
                      param="previous_response_id")


async def effective_input(service, principal: str, previous_response_id: str | None,
                          items: list[dict]) -> list[dict]:
    """A request's input items, after the conversation previous_response_id names (the
    stored response's input and output: `Service.conversation_input`), if it names one."""
    if previous_response_id is None:
        return items
    _require_conversations(service)
    return await service.conversation_input(principal, previous_response_id, items)


async def _prepare_chat(model, chat_request: ChatRequest, constrained: bool,
                        prompt: str | list[int] | None = None):
    """The engine's prepared chat (of a raw `prompt` if given), in a worker thread unless it
    is quick (INLINE_PREPARE_CHARS); an engine error as the Problem it is for the request."""
    def engine_prepare():
        if prompt is None:
            return model.prepare_chat(chat_request)
        return model.prepare_text(prompt, chat_request)

    try:
        size = _text_size(chat_request.messages) if prompt is None else len(prompt)
        if not constrained and size <= INLINE_PREPARE_CHARS:
            return engine_prepare()
        return await trio.to_thread.run_sync(engine_prepare)
    except ContextLengthExceeded as exc:  # param: what to change, the input only when it alone fills the window
        too_long = "input" if prompt is None else "prompt"
        param = too_long if exc.n_prompt >= exc.n_ctx else "max_output_tokens"
        raise Problem("context_length_exceeded", str(exc), param=param) from None
    except SchemaError as exc:
        raise _schema_problem(exc) from None
    except PromptError as exc:
        raise Problem("invalid_request", str(exc), param="prompt") from None
    except OutputBudgetTooSmall as exc:  # (the face names its own limit: max_tokens, max_completion_tokens)
        raise Problem("invalid_request", f"{exc}: a constrained output is always complete, so the limit "
                      f"must be at least {exc.needed}", param="max_output_tokens") from None
    except ChatTemplateError as exc:
        raise Problem("invalid_request", f"the model's chat template cannot render this input: {exc}",
                      param="input") from None


def _schema_problem(exc: SchemaError) -> Problem:
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


def _chat_request(request: ResponsesRequest, messages: list[dict]) -> ChatRequest:
    sampling = {}
    if request.temperature is not None:
        sampling["temperature"] = request.temperature
    for name in ("top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty", "logprobs"):
        if getattr(request, name) is not None:
            sampling[name] = getattr(request, name)
    tools = [{"name": t.name, "description": t.description, "parameters": t.parameters}
             for t in request.tools]
    return ChatRequest(
        messages=messages,
        max_tokens=request.max_output_tokens,
        sampling=SamplingParams(**sampling, logit_bias=request.logit_bias),
        stop=request.stop,
        tools=tools or None,
        tool_choice=request.tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        allowed_tools=request.allowed_tools,
        json_schema=request.json_schema,
    )


# -- generating ------------------------------------------------------------------------------

Finish = Callable[[Event], Awaitable[None]]


async def pump(generation: Generation, finish: Finish,
               cut: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[Event]:
    """Every LMSP event of `generation`, from `response.created` to its final event.

    Before the final event goes out, `finish(final)` records it (stores the response, or
    notes it for the task's log). A consumer that stops early (a cancellation or a close
    mid-response: its client left, its task was cancelled) ends the generation first
    (D4); then, shielded, `cut` (if given) records how the response ended: cut short, or
    as it ended, when what stopped the consumer interrupted `finish`. A failure of
    `finish` (a store that cannot write) is the consumer's to report.
    """
    finished = False
    with generation.admission:  # (released however the pump ends; `stream_body` if it never starts)
        async with aclosing(generation.events()) as events:
            try:
                async for event in events:
                    if event.is_final:
                        await finish(event)
                        finished = True
                    yield event
            except Exception:
                raise
            except BaseException:  # the consumer stopped early, mid-response
                if cut is not None and not finished:
                    with trio.CancelScope(shield=True):
                        await events.aclose()  # the generation ends first (D4), not after the write
                        await cut()
                raise


async def response_events(generation: Generation, request: Request, service) -> AsyncIterator[Event]:
    """The events of a response answered directly (not a task), to its final event.

    Its tokens are noted on the access-log line and the response stored if asked (D6)
    before the final event goes out. A stream whose client leaves stops generating and,
    with `store: true`, is stored even so, `cancelled` with what was generated until then,
    or as it ended when the client left while it was being stored (the client has its id
    from `response.created`, and may come back for it). A failure of the service's own
    ends a stream with an `error` event (its cause goes to the log; a problem, such as a
    full disk's 503, is the event's `error`); a synchronous request gets it raised.
    """
    run = generation.run

    async def finish(final: Event) -> None:
        await _record(generation, request, service)

    async def store_cut() -> None:
        if run.status == "in_progress":  # (else it ended, and its client left while it was stored)
            run.cancelled()
        try:
            await _record(generation, request, service)
        except Exception as exc:  # (the client is gone either way)
            service.log(f"error: storing {run.id}, whose client left, failed: {type(exc).__name__}: {exc}")

    keeps_cut = generation.request.stream and generation.request.store
    async with aclosing(pump(generation, finish, store_cut if keeps_cut else None)) as events:
        try:
            async for event in events:
                yield event
        except Exception as exc:
            if not generation.request.stream:
                raise  # (a synchronous request answers it: a store away is its 503)
            service.log(f"error: the stream of {run.id} failed: {type(exc).__name__}: {exc}")
            # (a Problem is written for the client: a store away, its disk full, is its 503)
            yield run.error_event(exc if isinstance(exc, Problem) else Problem("internal_error",
                                                                               "an unexpected error occurred"))


async def respond(generation: Generation, request: Request, service) -> None:
    """Generate a synchronous response to its end: `generation.run` then holds it. A
    failed one is raised as its problem (a stopping service's with Retry-After); its
    client leaving stops it (D4)."""
    request.cancel_on_disconnect()  # nobody left to read the response: stop generating
    async with aclosing(response_events(generation, request, service)) as events:
        async for _ in events:
            pass
    error = generation.run.error
    if generation.run.status == "failed":
        retry = [("Retry-After", "5")] if error["code"] == "model_unavailable" else None
        raise Problem(error["code"], error["detail"], param=error.get("param"), headers=retry)


async def _record(generation: Generation, request: Request, service) -> None:
    """Before the final event goes out: note the tokens, store the response if asked (D6).

    A failed response is stored too when it was streamed, as a task's is: the client has
    its id ("failed" appears in stored responses, 6.2). A synchronous request that fails
    gets a problem document instead, which names no response to fetch later.
    """
    run = generation.run
    if run.usage is not None:
        request.log_note = f"tokens={run.usage['input_tokens']}+{run.usage['output_tokens']}"
    failed_synchronously = run.status == "failed" and not generation.request.stream
    if generation.request.store and service.stores_responses and not failed_synchronously:
        stored = (generation.stored_object or run.response_object)()
        await service.store.put_response(run.id, generation.principal, generation.input_items, compact_json(stored))

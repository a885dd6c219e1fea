"""The service: models, auth, storage and routes, served over HTTP.

A trio program runs one like this:

    async with Service.open(ServiceConfig(model_paths=[path])) as service:
        async with trio.open_nursery() as nursery:
            addresses = await nursery.start(lmsp_min.serve, service, "127.0.0.1", 8080)

`lmsp-min serve` does exactly that. On SIGINT or SIGTERM it stops cleanly
(`Service.drain`): GET /healthz answers 503 (lmsp_min/routing.py), running tasks are
handed over to the other nodes of a PostgreSQL store (else they end `failed`), no new
connection, idle ones closed, requests in progress given --drain-seconds to finish,
then those still generating ended `failed` (model_unavailable), and everything cancelled.

Every piece has an owner that ends it. `serve` runs the HTTP server and the
tasks in its nursery, so once it returns no request or task is left; then the
service's `async with` closes the models it loaded (engine/model.py
`Model.close`: their scheduler threads joined), then the store.

Reading the request path starts here: `serve` runs lmsp_min/http.py's HTTPServer,
whose handler is lmsp_min/routing.py's `App`, over the routes of both faces
(`faces_router`: lmsp_min/routes.py, lmsp_min/openai_dialect/routes.py).
"""

import os
import signal
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

import engine
from lmsp_min import paths, routes
from lmsp_min.auth import Auth, is_loopback
from lmsp_min.cors import CorsPolicy
from lmsp_min.events import compact_json
from lmsp_min.generation import GenerationsInProgress, prepare
from lmsp_min.http import HTTPServer, Limits
from lmsp_min.problems import Problem, leaf_exceptions, quoted
from lmsp_min.openai_dialect import routes as openai_routes
from lmsp_min.registry import DEFAULT_MAX_BATCH, DEFAULT_QUEUE_DEPTH, Registry
from lmsp_min.routing import App, Router
from lmsp_min.store import STORE_TIMEOUT, StoreError
from lmsp_min.store.open import open_store
from lmsp_min.tasks import STORE_RETENTION, Tasks
from lmsp_min.validate import MAX_INPUT_ITEMS

SHUTDOWN_GRACE = 30.0  # seconds requests in progress get to finish after SIGINT / SIGTERM (--drain-seconds)
LAST_WORDS = 2.0  # seconds, after that, for the responses still generating to say they were stopped


def faces_router() -> Router:
    """The routes of both faces: LMSP at /lmsp/v1, OpenAI's API at /v1 (its own error format)."""
    router = Router()
    routes.add_routes(router)
    openai_routes.add_routes(router)
    return router


def stderr_log(line: str) -> None:
    """The service's log. A line that cannot be written is dropped (stderr may be a pipe
    whose reader has ended, `2>&1 | tee`): raising would end the server at its next line."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


@dataclass
class ServiceConfig:
    """Everything `lmsp-min serve` can be told."""

    model_paths: list[Path] = field(default_factory=list)
    models_dir: Path | None = None  # every .gguf here is served
    tokens_file: Path | None = None  # none: loopback only, principal "local"
    allowed_hosts: list[str] = field(default_factory=list)  # --allow-host: Host names accepted without tokens
    cors_origins: list[str] = field(default_factory=list)  # --cors-origin: pages that may call it ("*": any)
    data_dir: Path | None = None  # the store's database (None: lmsp_min.paths.data_dir())
    store: bool = True  # False (--no-store): nothing outlives the process
    store_url: str | None = None  # postgresql://...: a PostgreSQL store, shared by several nodes
    store_lease: float = 10.0  # seconds a PostgreSQL node's tasks outlive its last sign of life
    store_timeout: float = STORE_TIMEOUT  # seconds a store call may take, then its request is a 503
    drain_seconds: float = SHUTDOWN_GRACE  # --drain-seconds: what requests in progress get after SIGTERM
    event_retention: float = 3600.0  # seconds a finished task's events are kept (D3)
    store_retention: float = STORE_RETENTION  # seconds stored responses and final tasks are kept (0: for ever)
    limits: Limits = field(default_factory=Limits)
    access_log: bool = True  # one line per request on stderr
    context_cap: int | None = None  # --ctx: every model's context window is at most this (D4)
    kv_cache_bytes: int | None = 1024 << 20  # --kv-cache-mib: each model's running requests' KV caches
                                             # together (None: no bound)
    queue_depth: int = DEFAULT_QUEUE_DEPTH  # --queue-depth: requests each model admits at once (D9)
    speculate: bool = True  # --no-speculate: no drafts from the context or forced text (never changes output)
    pooling: str | None = None  # --pooling: how every model's embeddings pool (None: each model's own)
    max_batch: int = DEFAULT_MAX_BATCH  # --max-batch: requests each model's engine steps together


class Service:
    """What a request handler can reach: the models, auth, the store, the log.

    `store` (lmsp_min/store/) is optional: without one, `previous_response_id`
    is `unsupported_capability` and `store: true` is ignored (D2). `tasks` (set
    by `open`) runs the background responses, in `serve`'s nursery.
    """

    def __init__(self, registry: Registry, *, auth: Auth | None = None, store=None,
                 config: ServiceConfig | None = None, log=stderr_log):
        self.registry = registry
        self.auth = auth or Auth()
        self.store = store
        self.config = config or ServiceConfig()
        self.cors = CorsPolicy(self.config.cors_origins)
        self.tasks = None
        self.http: HTTPServer | None = None  # set by serve()
        self.router = faces_router()
        self.log = log
        self.generations = GenerationsInProgress()  # ended `failed` if the service stops first
        self.draining = False  # `drain` has begun: GET /healthz says 503

    @classmethod
    @asynccontextmanager
    async def open(cls, config: ServiceConfig, log=stderr_log):
        """`async with Service.open(config) as service:` reads the model headers and the
        tokens file (ValueError: a message for the user) and opens the store; at the end
        it closes the models loaded meanwhile, then the store."""
        registry = await Registry.scan(config.model_paths, config.models_dir, log, config.context_cap,
                                       config.kv_cache_bytes, config.queue_depth, config.speculate,
                                       config.max_batch)
        auth = (Auth.from_file(config.tokens_file) if config.tokens_file is not None
                else Auth(allowed_hosts=config.allowed_hosts))
        location = config.store_url or ((config.data_dir or paths.data_dir()) if config.store else None)
        store = await open_store(location, lease=config.store_lease, timeout=config.store_timeout, log=log)
        service = cls(registry, auth=auth, store=store, config=config, log=log)
        service.tasks = Tasks(store, event_retention=config.event_retention, store_retention=config.store_retention,
                              stores_responses=service.stores_responses, log=log,
                              prepare=lambda body, principal: prepare(body, principal, service))
        try:
            yield service
        finally:
            with trio.CancelScope(shield=True):  # (closing is cleanup: a cancelled service still does it)
                await service.aclose()

    async def drain(self, grace: float = SHUTDOWN_GRACE) -> None:
        """Stop taking requests; give those in progress up to `grace` seconds to finish.

        Running tasks are handed over first to the other nodes (lmsp_min/tasks.py `stop`),
        or, where none can take them (SQLite), end `failed` (`model_unavailable`), so that
        the clients following them get their final event before their streams close. Responses
        still generating after the grace end `failed` too (`model_unavailable`), and
        get LAST_WORDS seconds to send that: a stream its final event, a synchronous
        request a 503."""
        self.draining = True
        if self.tasks is not None:
            await self.tasks.stop()
        if self.http is not None:
            await self.http.drain(grace)
            if self.http.connections:
                self.generations.stop()
                await self.http.drain(LAST_WORDS)

    async def aclose(self) -> None:
        """Close the models the registry loaded, each in a worker thread (a model ends the
        forward step it is in), then the store (--no-store's database is in memory:
        nothing is left). `open`'s `async with` calls it."""
        try:
            for entry in self.registry:
                await trio.to_thread.run_sync(entry.close)
        finally:
            if self.store is not None:  # (in a worker thread too: PostgreSQL's says goodbye over the network)
                await trio.to_thread.run_sync(self.store.close)

    @property
    def stores_responses(self) -> bool:
        """D2 `conversations`: responses are kept beyond this process."""
        return self.store is not None and getattr(self.store, "persistent", True)

    def capabilities(self) -> tuple[str, ...]:
        """The service-level capabilities every model object lists."""
        names = ["streaming"]
        if self.stores_responses:
            names.append("conversations")
        if self.tasks is not None:
            names.append("tasks")
        return tuple(names)

    async def conversation_input(self, principal: str, response_id: str, new_items: list[dict]) -> list[dict]:
        """The effective input of a request with previous_response_id: the stored response's
        input then output items, then `new_items`.

        Our reading of D9 ("bounded everything"): previous_response_id is a shorthand for
        sending the whole conversation in one request, so the effective input is held to
        the bounds of one request: MAX_INPUT_ITEMS items, and max_body_bytes as compact
        UTF-8 JSON. The context window is no bound: it holds only what the prompt renders
        (not reasoning items, nor keys no template reads). Unbounded, the stored input
        grew with every turn, and every later turn loaded all of it.
        """
        stored = await self.store.get_response(response_id, principal)
        if stored is None:
            raise Problem("response_not_found", f"no stored response has the id {quoted(response_id)}",
                          param="previous_response_id")
        items = [*stored.input, *stored.output, *new_items]
        restart = "start a new conversation (without previous_response_id)"
        if len(items) > MAX_INPUT_ITEMS:
            raise Problem("invalid_request",
                          f"this conversation would hold {len(items)} input items, more than the "
                          f"{MAX_INPUT_ITEMS} one request may send: {restart}, or send fewer items",
                          param="previous_response_id")
        size = len(compact_json(items).encode("utf-8"))
        max_bytes = self.config.limits.max_body_bytes
        if size > max_bytes:
            raise Problem("request_too_large",
                          f"this conversation's input would be {size} bytes of JSON, more than the "
                          f"{max_bytes} one request may send: {restart}, or send smaller items",
                          param="previous_response_id")
        return items


async def serve(service: Service, host: str = "127.0.0.1", port: int = 8080, *,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `service` on host:port until cancelled; reports the bound addresses.

    Refuses (ValueError) to listen beyond loopback without tokens (D7).
    """
    if not service.auth.enabled and not is_loopback(host):
        raise ValueError(f"refusing to listen on {host} without tokens: a service without "
                         "--tokens-file only listens on loopback (127.0.0.1, ::1 or localhost)")
    app = App(service, service.router)
    log = service.log if service.config.access_log else _errors_only(service.log)
    service.http = HTTPServer(app, limits=service.config.limits, log=log)
    async with trio.open_nursery() as nursery:
        if service.tasks is not None:  # tasks a crash left running are failed before any request
            await nursery.start(service.tasks.run)
        addresses = await nursery.start(service.http.serve, host, port)
        task_status.started(addresses)


def _errors_only(log):
    return lambda line: log(line) if line.startswith(("error", "warning")) else None


# -- lmsp-min serve (the command line is in cli.py) ------------------------------------------------------------------------


def ensure_default_model(config: ServiceConfig, log=stderr_log) -> None:
    """No --model and an empty models directory: fetch the default model into it."""
    if config.model_paths or (config.models_dir is not None and any(config.models_dir.glob("*.gguf"))):
        return
    from lmsp_min import fetch

    log(f"no model given and none in {config.models_dir}: fetching {fetch.DEFAULT_MODEL}")
    config.model_paths.append(fetch.pull(fetch.DEFAULT_MODEL))


def run(config: ServiceConfig, host: str, port: int) -> None:
    """`lmsp-min serve`: run the service until SIGINT or SIGTERM.

    Raises ValueError, with a message for the user, when it cannot start.
    """
    if not is_loopback(host) and config.tokens_file is None:
        raise ValueError(f"refusing to listen on {host} without --tokens-file: without tokens "
                         "the service only listens on loopback (127.0.0.1, ::1 or localhost)")
    ensure_default_model(config)
    try:
        trio.run(_serve_until_signal, config, host, port)
    except Exception as exc:
        # trio's nurseries wrap what fails in them in exception groups (strictly since trio
        # 0.25): an address that is taken is one OSError for the user, a database that
        # cannot be read (found as tasks recover) one StoreError, not a traceback
        error = _only(exc, (OSError, StoreError))
        if error is None:
            raise
        raise error from None


def _only(exc: BaseException, kind: type | tuple[type, ...]) -> BaseException | None:
    """The one `kind` exception that exc is, or that its (nested) groups hold alone, else None."""
    leaves = leaf_exceptions(exc)
    return leaves[0] if len(leaves) == 1 and isinstance(leaves[0], kind) else None


async def _serve_until_signal(config: ServiceConfig, host: str, port: int) -> None:
    """Serve until a signal; then finish what is in progress (a second signal: stop now)."""
    async with Service.open(config) as service:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                addresses = await nursery.start(serve, service, host, port)
                _banner(service, addresses)

                grace = config.drain_seconds

                async def drain_then_stop() -> None:
                    await service.drain(grace)
                    nursery.cancel_scope.cancel()

                draining = False
                async for signum in signals:
                    if draining:
                        stderr_log(f"{signal.Signals(signum).name} again: stopping now")
                        nursery.cancel_scope.cancel()
                        break
                    stderr_log(f"{signal.Signals(signum).name}: finishing the requests in progress "
                               f"(at most {grace + LAST_WORDS:.0f} s; signal again to stop now)")
                    draining = True
                    nursery.start_soon(drain_then_stop)
    stderr_log("stopped")


def _banner(service: Service, addresses) -> None:
    where = ", ".join(f"http://{f'[{host}]' if ':' in host else host}:{port}" for host, port in addresses)
    stderr_log(f"lmsp-min serving LMSP 1.0 on {where}")
    for entry in service.registry:
        stderr_log(f"  model {entry.id}  ({entry.path.name}, {entry.architecture}, {entry.quantization})")
    if not len(service.registry):
        stderr_log("  no models")
    if service.auth.enabled:
        principals = sorted({token.principal for token in service.auth.tokens})
        n = len(service.auth.tokens)
        stderr_log(f"  auth: bearer tokens ({n} token{'s' if n != 1 else ''}; principals {', '.join(principals)})")
    else:
        also = "".join(f", {name}" for name in sorted(service.auth.allowed_hosts))
        stderr_log(f"  auth: none (loopback only, principal 'local'; addressed as localhost{also})")
    if service.cors.enabled:
        origins = sorted(service.cors.origins) + (["* (any page you visit)"] if service.cors.any_origin else [])
        stderr_log(f"  pages of other origins: {', '.join(origins)}")
    stderr_log(f"  storage: {f'on ({service.store.location})' if service.stores_responses else 'off'}")
    stderr_log(f"  compute: {_compute()}")


def _compute() -> str:
    """The engine's threads and the BLAS kernels behind its prefill, which an environment
    variable can make older than the CPU's (docs/performance.md says how much slower)."""
    kernel = engine.blas_kernel()
    blas = f"OpenBLAS with its {kernel} kernels" if kernel else "not OpenBLAS"
    if kernel and os.environ.get("OPENBLAS_CORETYPE"):
        blas += f", as OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']} asks"
        if engine.blas_kernel_below_cpu():  # (set for an older OpenBLAS, it holds this one back)
            blas += (" (without the AVX-512 this CPU has: many streams decode up to 1.6x slower;"
                     " unset it unless this OpenBLAS needs it, docs/serving.md)")
    return f"{engine.num_threads()} threads; numpy's BLAS: {blas}"

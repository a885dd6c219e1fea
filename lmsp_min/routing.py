"""Routing: from an HTTP request to the handler of one face, and a failure to its error format.

`Router` maps (method, path) to a handler and the scope it needs (D7); a path no
route matches is `404 not_found`, a known path with another method `405
method_not_allowed` with `Allow`. A face mounts its routes under a prefix with its
own error format (`Router.mount`): LMSP answers problem documents (lmsp_min/http.py
`problem_response`, the default), the OpenAI face at /v1 its error objects. `App`
is the handler lmsp_min/http.py calls: route, authenticate, check the version,
dispatch, and answer whatever goes wrong in the format of the path's face; it answers
CORS preflights and adds the CORS headers of every response (lmsp_min/cors.py), and
GET /healthz itself, for load balancers (`health`: no auth, no face). Every
handler is `async def handler(request, service) -> Response | StreamingResponse`.

Reading the request path: lmsp_min/http.py calls `App`; the faces' handlers are in
lmsp_min/routes.py (LMSP) and lmsp_min/openai_dialect/routes.py (OpenAI), and both
run the request through lmsp_min/generation.py.
"""

import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

from lmsp_min.cors import is_preflight
from lmsp_min.http import Request, Response, json_response, problem_response
from lmsp_min.problems import Problem, clipped, quoted, shutting_down
from lmsp_min.validate import parse_json_body

ErrorFormat = Callable[[Problem], Response]


@dataclass
class Route:
    pattern: str  # e.g. "/lmsp/v1/models/{model_id}"
    regex: re.Pattern
    handlers: dict  # method -> (scope, handler)


class Router:
    """(method, path) -> (handler, scope, path parameters); path -> its face's error format."""

    def __init__(self):
        self.routes: list[Route] = []
        self._mounts: list[tuple[str, ErrorFormat]] = []  # (prefix, error format), longest prefix first

    def mount(self, prefix: str, error_format: ErrorFormat) -> None:
        """Answer every failure under `prefix` ("/v1": the path itself and all below it) with
        `error_format`, an unknown route's 404 included."""
        self._mounts.append((prefix.rstrip("/"), error_format))
        self._mounts.sort(key=lambda mount: -len(mount[0]))

    def error_format(self, path: str) -> ErrorFormat:
        for prefix, error_format in self._mounts:
            if path == prefix or path.startswith(prefix + "/"):
                return error_format
        return problem_response

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
    """The service's request handler: route, authenticate, check the version, dispatch.

    A failure is answered in the error format of the face the path belongs to: a Problem
    as it is, any other exception (logged with its traceback) as `500 internal_error`."""

    def __init__(self, service, router: Router):
        self.service = service
        self.router = router

    async def __call__(self, request: Request):
        """The response, with the CORS headers its origin gets (lmsp_min/cors.py), failures' too."""
        response = await self._answer(request)
        response.headers = [*response.headers, *self.service.cors.response_headers(request.headers.get("origin"))]
        return response

    async def _answer(self, request: Request):
        try:
            return await self._dispatch(request)
        except Problem as problem:
            return self.router.error_format(request.path)(problem)
        except Exception:
            self.service.log(f"error: unexpected exception in {request.method} {clipped(request.path)}:\n"
                             f"{traceback.format_exc()}")
            return self.router.error_format(request.path)(Problem("internal_error", "an unexpected error occurred"))

    async def _dispatch(self, request: Request):
        if request.path == HEALTH_PATH and request.method in ("GET", "HEAD"):
            return health(self.service)
        if self.service.http is not None and self.service.http.draining:
            raise shutting_down()
        if self.service.cors.enabled and is_preflight(request):  # (it carries no credentials: before auth)
            self.router.match(request.headers["access-control-request-method"], request.path)  # 404, 405
            return self.service.cors.preflight(request)
        handler, scope, params = self.router.match(request.method, request.path)
        request.params = params
        request.principal = self.service.auth.authenticate(request.headers.get("authorization"), scope,
                                                           request.headers.get("host"))
        check_version(request.headers.get("lmsp-version"))
        return await handler(request, self.service)


HEALTH_PATH = "/healthz"  # for load balancers: outside both faces' prefixes, without auth


def health(service) -> Response:
    """GET /healthz: 200 while the node serves; 503, with Retry-After, while it drains (a
    balancer sends new requests elsewhere) or cannot reach its store. A tiny body that
    says which, and nothing a client without a token should not know."""
    if service.draining:
        status = "draining"
    elif service.store is not None and not service.store.reachable:
        status = "store_unavailable"
    else:
        return json_response({"status": "serving"})
    return json_response({"status": status}, 503, [("Retry-After", "5")])


async def read_json_body(request: Request) -> dict:
    """The body of a JSON request: 415 unless it is declared application/json."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        shown = media_type or "none"
        raise Problem("unsupported_media_type",
                      f"the body must be application/json (Content-Type: {clipped(shown)})")
    return parse_json_body(await request.body())

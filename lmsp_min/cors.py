"""Calls from web pages of other origins (CORS, the Fetch standard), as `--cors-origin` allows.

A browser lets a page read a response from another origin (scheme, host and port: a page
at http://localhost:3000 calling http://localhost:8080) only when the response says the
page's origin may. Without `--cors-origin` the service says nothing, and pages of other
origins cannot call it; with it, `CorsPolicy` answers for the origins listed (or `*`, any):

- A preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`, which the
  browser sends before a request with `Authorization` or a JSON body) is answered before
  authentication, as the browser sends it without credentials: `204` with the methods
  and headers the request may use, for `MAX_AGE` seconds. An origin not allowed gets a
  `400` and no CORS header (its browser refuses the request, and never sends it).
- A public page calling a service on a private address or loopback (Chromium's Private
  Network Access) makes its preflight ask `Access-Control-Request-Private-Network: true`;
  an allowed origin is told `Access-Control-Allow-Private-Network: true`, or Chromium
  refuses the request even though its origin is listed.
- Every actual response to an allowed origin (any status, either face, a stream too)
  names it in `Access-Control-Allow-Origin` and exposes the headers a client reads
  (`EXPOSED_HEADERS`); a response to another origin carries no CORS header, and the
  browser keeps it from the page.
- A listed origin is echoed, with `Access-Control-Allow-Credentials: true` (a page that
  fetches with `credentials: "include"` works; the service sets no cookie, and tokens go
  in `Authorization` anyway). `*` answers `*`, never with credentials (Fetch forbids it).

`*` is accepted wherever the service starts: beyond loopback it needs tokens
(lmsp_min/service.py `serve`), and a page then needs one too; on loopback without tokens
it lets any page the user opens use the service, which docs/serving.md says.

What lmsp_min/http.py refuses before any handler runs (431, 408, a malformed request, 429
over the connection limits) carries no CORS header: the page sees a network error. The
rest is answered by lmsp_min/routing.py's `App`, which every answer of both faces passes
(failures too, in the face's error format) and which knows the routes a preflight asks
for: it calls this module; read it next.
"""

import re

from lmsp_min.http import Request, Response
from lmsp_min.problems import Problem, quoted

ANY_ORIGIN = "*"
ALLOWED_METHODS = "GET, HEAD, POST, DELETE"  # every method a route of either face answers
ALLOWED_HEADERS = ("Authorization", "Content-Type", "LMSP-Version", "Idempotency-Key", "Last-Event-ID",
                   "X-Request-Id")
# The openai SDK in a page (JavaScript's, `dangerouslyAllowBrowser`) sends x-stainless-lang, -os,
# -arch, -runtime, -runtime-version, -package-version, -retry-count, -timeout, and more with each
# version: every header so named that a preflight asks for is allowed.
SDK_HEADER = re.compile(r"x-stainless-[a-z0-9-]+")
EXPOSED_HEADERS = "X-Request-Id, Retry-After, Location, Idempotent-Replayed, LMSP-Version"
# Seconds a browser may reuse a preflight's answer: a restart with other --cors-origin values
# holds for every page within ten minutes (Chromium caps it at 7200 anyway).
MAX_AGE = "600"
# An origin as browsers write it: scheme://host[:port], lowercase (an IPv6 host in brackets)
_ORIGIN = re.compile(r"([a-z][a-z0-9+.-]*)://([a-z0-9.-]+|\[[0-9a-f:.]+\])(?::([0-9]{1,5}))?")
_DEFAULT_PORTS = {"http": "80", "https": "443"}  # which a browser leaves out of an Origin


def parse_origin(text: str) -> str:
    """`--cors-origin`'s value as browsers write it in `Origin` (lowercase, no default port,
    no trailing slash), or `*`; ValueError with a message for the command line."""
    if text == ANY_ORIGIN:
        return text
    found = _ORIGIN.fullmatch(text.strip().lower().removesuffix("/"))
    if found is None:
        raise ValueError(f"{text!r} is not an origin: write scheme://host[:port] "
                         "(http://localhost:3000), or * for any")
    scheme, host, port = found.groups()
    return f"{scheme}://{host}" + (f":{port}" if port and port != _DEFAULT_PORTS.get(scheme) else "")


def is_preflight(request: Request) -> bool:
    return (request.method == "OPTIONS" and "origin" in request.headers
            and "access-control-request-method" in request.headers)


class CorsPolicy:
    """The origins whose pages may call the service, and the headers that tell their browsers."""

    def __init__(self, origins=()):
        """`origins` as `parse_origin` reads them (ValueError for one that is not an origin)."""
        parsed = frozenset(map(parse_origin, origins))
        self.origins = parsed - {ANY_ORIGIN}
        self.any_origin = ANY_ORIGIN in parsed

    @property
    def enabled(self) -> bool:
        return self.any_origin or bool(self.origins)

    def preflight(self, request: Request) -> Response:
        """The answer to a preflight (`is_preflight`): what the request it announces may send
        (`response_headers` adds the origin's, as to every response)."""
        origin = request.headers["origin"]
        if self._allow_origin(origin) is None:
            raise Problem("invalid_request", f"pages of the origin {quoted(origin)} may not call this service "
                          "(lmsp-min serve --cors-origin ORIGIN allows them)")
        asked = request.headers.get("access-control-request-headers", "").lower()
        sdk_headers = [name for name in map(str.strip, asked.split(",")) if SDK_HEADER.fullmatch(name)]
        headers = [("Access-Control-Allow-Methods", ALLOWED_METHODS),
                   ("Access-Control-Allow-Headers", ", ".join([*ALLOWED_HEADERS, *sdk_headers])),
                   ("Access-Control-Max-Age", MAX_AGE)]
        if request.headers.get("access-control-request-private-network", "").lower() == "true":
            headers.append(("Access-Control-Allow-Private-Network", "true"))
        return Response(204, b"", None, headers)

    def response_headers(self, origin: str | None) -> list[tuple[str, str]]:
        """The CORS headers of a response to a request from `origin` (None: not from a page of
        another origin); none at all for an origin not allowed, but `Vary: Origin`, as the
        same URL is answered differently for another origin (a cache must not mix them)."""
        if not self.enabled:
            return []
        allowed = self._allow_origin(origin)
        if allowed is None:
            return [("Vary", "Origin")]
        return [("Vary", "Origin"), *allowed, ("Access-Control-Expose-Headers", EXPOSED_HEADERS)]

    def _allow_origin(self, origin: str | None) -> list[tuple[str, str]] | None:
        if origin is None:
            return None
        if origin in self.origins:
            return [("Access-Control-Allow-Origin", origin), ("Access-Control-Allow-Credentials", "true")]
        if self.any_origin:
            return [("Access-Control-Allow-Origin", ANY_ORIGIN)]
        return None

"""Errors as RFC 9457 problem documents (docs/protocol.md D1).

Every error the service reports, whatever the route, is a `Problem`: raised
anywhere in a handler, turned into an `application/problem+json` response by
the HTTP layer, or embedded as the `error` of a failed response or event.
`detail` is written for humans and never carries a path, a stack trace or a
secret: it is always composed here or by the validator, never copied from an
arbitrary exception. What it quotes of the request (a field name, a model id) is
a short prefix (`quoted`), so a megabyte sent is never a megabyte echoed. What an
unexpected exception was is for the log, where `leaf_exceptions` finds it inside
trio's exception groups. The 503s the service says of itself are made here too: a
stopping service (`shutting_down`), and a store that cannot answer (`unavailable`,
`too_slow`, `disk_full`: lmsp_min/store/ raises them).

Next: lmsp_min/http.py writes a Problem as its document; lmsp_min/routing.py picks the
face's format.
"""

# code -> (HTTP status, title). The closed list of D1's error table.
CODES: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "Invalid request"),
    "unsupported_capability": (400, "Unsupported capability"),
    "context_length_exceeded": (400, "Context length exceeded"),
    "unsupported_version": (400, "Unsupported version"),
    "unauthorized": (401, "Unauthorized"),
    "insufficient_scope": (403, "Insufficient scope"),
    "model_not_found": (404, "Model not found"),
    "response_not_found": (404, "Response not found"),
    "task_not_found": (404, "Task not found"),
    "not_found": (404, "Not found"),
    "method_not_allowed": (405, "Method not allowed"),
    "idempotency_conflict": (409, "Idempotency conflict"),
    "task_running": (409, "Task running"),
    "event_history_expired": (410, "Event history expired"),
    "request_too_large": (413, "Request too large"),
    "unsupported_media_type": (415, "Unsupported media type"),
    "idempotency_key_reused": (422, "Idempotency key reused"),
    "rate_limited": (429, "Rate limited"),
    "internal_error": (500, "Internal error"),
    "generation_failed": (500, "Generation failed"),
    "model_unavailable": (503, "Model unavailable"),
}


class Problem(Exception):
    """An error with its D1 code; raise it from any handler.

    `status` defaults to the code's status in D1's table; it is given
    explicitly only where HTTP itself needs another one (408, 431).
    `headers` are extra response headers (`Allow`, `WWW-Authenticate`, `Retry-After`).
    """

    def __init__(
        self,
        code: str,
        detail: str,
        *,
        param: str | None = None,
        status: int | None = None,
        headers: list[tuple[str, str]] | None = None,
    ):
        if code not in CODES:
            raise ValueError(f"unknown problem code {code!r}")
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.param = param
        self.status = status if status is not None else CODES[code][0]
        self.headers = headers or []

    def to_dict(self) -> dict:
        """The problem document: also the `error` of failed responses and events."""
        doc = {
            "type": f"urn:lmsp:error:{self.code}",
            "title": CODES[self.code][1],
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        if self.param is not None:
            doc["param"] = self.param
        return doc


QUOTE_LIMIT = 64  # characters of a client's value that an error quotes


def clipped(value, limit: int = QUOTE_LIMIT) -> str:
    """At most `limit` characters of `value` (its repr if not a string), "…" marking a cut."""
    text = value if isinstance(value, str) else repr(value)[:limit + 1]
    return text if len(text) <= limit else text[:limit] + "…"


def quoted(value, limit: int = QUOTE_LIMIT) -> str:
    """`value` in single quotes, as an error's detail quotes the request: `clipped`."""
    return f"'{clipped(value, limit)}'"


def shutting_down(detail: str = "the service is shutting down") -> Problem:
    """D1's `model_unavailable` while the service stops: for a request it refuses (told to
    retry in a few seconds), or the `error` of a response or task it ends."""
    return Problem("model_unavailable", detail, headers=[("Retry-After", "5")])


def unavailable(detail: str = "the service's database cannot be reached; try again shortly") -> Problem:
    """What a request that needs the database gets while it cannot be reached (503)."""
    return Problem("model_unavailable", detail, headers=[("Retry-After", "2")])


# A full disk is a 503, not WebDAV's 507 (RFC 4918 11.5): the same request succeeds once there
# is room, which 503 with Retry-After tells every client; 507 reads as "a smaller request would
# do", and D1's closed table of codes has none for it. Half a minute: room comes back by an
# operator's hand or a purge, not within seconds.
DISK_FULL_RETRY_AFTER = "30"


def disk_full() -> Problem:
    """What a request whose write finds the database's disk full gets (503)."""
    return Problem("model_unavailable", "the service's storage is full; try again later",
                   headers=[("Retry-After", DISK_FULL_RETRY_AFTER)])


def too_slow(timeout: float) -> Problem:
    """What a request gets when a store call took longer than `timeout` (--store-timeout): 503."""
    return unavailable(f"the service's database did not answer within {timeout:g} s; try again shortly")


def leaf_exceptions(exc: BaseException) -> list[BaseException]:
    """exc, or the exceptions its (nested) exception groups hold: trio's nurseries wrap
    what fails in them in groups (strictly since trio 0.25), which do not say what it was."""
    inner = getattr(exc, "exceptions", None)
    if not isinstance(inner, tuple):
        return [exc]
    return [leaf for member in inner for leaf in leaf_exceptions(member)]

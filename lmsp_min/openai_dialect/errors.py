"""Problems as OpenAI error objects, for every route under /v1.

The service raises the same `Problem`s on both faces (lmsp_min/problems.py); the
OpenAI face writes them as `{"error": {"message", "type", "param", "code"}}` with the
same status, because that is what the openai SDKs read: the status picks the exception
class (`BadRequestError`, `NotFoundError`, `AuthenticationError`, `RateLimitError`...),
`message` becomes its text and `param`/`code` its attributes. Headers (Retry-After,
WWW-Authenticate, Allow) go out as they are: the SDK's retries honour Retry-After.
"""

from lmsp_min.http import Response, json_bytes
from lmsp_min.problems import Problem

# OpenAI's `type` of an error, by status (its API writes invalid_request_error for 404s too).
_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
# Our D1 codes where OpenAI has its own name for the same thing; the others are kept
# (model_not_found and context_length_exceeded are OpenAI's names already).
_CODES = {"unauthorized": "invalid_api_key", "insufficient_scope": "insufficient_permissions",
          "rate_limited": "rate_limit_exceeded"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_code(problem: Problem) -> str:
    return _CODES.get(problem.code, problem.code)


def error_object(problem: Problem) -> dict:
    """The `error` member of an error body (and of a chat stream's error chunk)."""
    return {"message": problem.detail, "type": error_type(problem.status), "param": problem.param,
            "code": error_code(problem)}


def response_error(error: dict | None) -> dict | None:
    """A failed response's `error` (a problem document, 9.3) as OpenAI's response error,
    whose `code` is one of a fixed few (the SDK's ResponseError): by the problem's status;
    its detail is the message."""
    if error is None:
        return None
    status = error.get("status", 500)
    code = "rate_limit_exceeded" if status == 429 else "invalid_prompt" if status < 500 else "server_error"
    return {"code": code, "message": error.get("detail", "")}


def error_response(problem: Problem) -> Response:
    return Response(problem.status, json_bytes({"error": error_object(problem)}), "application/json",
                    list(problem.headers))

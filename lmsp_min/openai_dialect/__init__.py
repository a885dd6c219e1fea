"""The OpenAI dialect: lmsp-min's second face, at /v1, for the openai SDKs and the tools built on them.

One adapter, not a second server: an OpenAI request (Responses or Chat Completions) is
translated into the LMSP request it asks for and runs through the same validation,
engine generation, events, store and tasks as `/lmsp/v1`; its LMSP events are then
written as OpenAI's API writes them. The LMSP routes do not change.

    requests.py   OpenAI request -> LMSP request body; LMSP params renamed back
    responses.py  LMSP response objects and events -> OpenAI Responses objects and events
    chat.py       LMSP response objects and events -> chat.completion (chunks)
    errors.py     Problem -> {"error": {"message", "type", "param", "code"}}
    routes.py     the route table, and how each route runs on the LMSP machinery
"""

from lmsp_min.openai_dialect.errors import error_response, is_dialect_path

__all__ = ["add_routes", "error_response", "is_dialect_path"]


def add_routes(router) -> None:
    """Mount the /v1 routes on an app.Router."""
    from lmsp_min.openai_dialect.routes import add_routes as add  # (routes imports app, which imports us)

    add(router)

"""The OpenAI dialect: lmsp-min's second face, at /v1, for the openai SDKs and the tools built on them.

One adapter, not a second server: an OpenAI request (Responses, Chat Completions or plain
Completions) is translated into the LMSP request it asks for and runs through the same
pipeline as `/lmsp/v1` (lmsp_min/generation.py: validation, engine generation, events,
store and tasks); its LMSP events are then written as OpenAI's API writes them. The LMSP
routes do not change.

    requests.py   OpenAI request -> LMSP request body; LMSP params renamed back
    responses.py  LMSP response objects and events -> OpenAI Responses objects and events
    chat.py       LMSP response objects and events -> chat.completion (chunks)
    choices.py    `n`: the choices of one request, n generations prepared together
    completions.py  POST /v1/completions: raw prompts -> text_completion (chunks)
    errors.py     Problem -> {"error": {"message", "type", "param", "code"}}
    routes.py     the route table, mounted at /v1 with errors.py's format, and how each
                  route runs on the shared pipeline

Reading on: routes.py.
"""

"""The set-ups docs/serving.md gives for Open WebUI (in Docker) and Continue: the requests
each sends, in the shapes their code writes them, answered as they expect.

No container runs here: what is tried is each client's requests on the wire, with the
Host a container sends (`host.docker.internal:8080`) and the headers each client adds.
"""

import json

import pytest

from server_harness import make_service, start_server, tiny_path  # noqa: F401

TINY_ID = "tiny:chat-q8_0"
CONTAINER_HOST = {"Host": "host.docker.internal:8080"}


@pytest.fixture
async def for_containers(nursery, tiny_path):
    """lmsp-min serve --allow-host host.docker.internal"""
    return await start_server(nursery, await make_service([tiny_path], allowed_hosts=["host.docker.internal"]))


def chat_chunks(body: bytes) -> list:
    return [json.loads(block[6:]) for block in body.decode().split("\n\n")
            if block.startswith("data: {")]


async def test_open_webui_lists_the_models_from_its_container(for_containers):
    """Open WebUI's backend: GET {OPENAI_API_BASE_URL}/models, its key as a bearer when it has one."""
    for auth in ({}, {"Authorization": "Bearer sk-anything"}):
        reply = await for_containers.request("GET", "/v1/models", headers={**CONTAINER_HOST, **auth})
        assert reply.status == 200
        assert TINY_ID in [model["id"] for model in reply.json()["data"]]


async def test_open_webui_streams_a_chat_with_its_usage(for_containers):
    """Open WebUI's chat: stream, and stream_options.include_usage, which it always adds."""
    body = {"model": TINY_ID, "messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hello"}],
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.8, "max_tokens": 4}
    reply = await for_containers.request("POST", "/v1/chat/completions", json_body=body,
                                         headers={**CONTAINER_HOST, "Authorization": "Bearer sk-anything"})
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    chunks = chat_chunks(reply.body)
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and reply.body.endswith(b"data: [DONE]\n\n")


async def test_open_webui_generates_a_title_without_streaming(for_containers):
    """Its title and tags tasks: stream false, and max_completion_tokens (it sends 1000: fine
    within the served models' windows, 8,192 and 32,768 tokens, not within the tiny one's 512)."""
    body = {"model": TINY_ID, "messages": [{"role": "user", "content": "Title this chat: Hello"}],
            "stream": False, "max_completion_tokens": 64}
    reply = await for_containers.request("POST", "/v1/chat/completions", json_body=body, headers=CONTAINER_HOST)
    assert reply.status == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"


async def test_continue_streams_a_chat(nursery, tiny_path):
    """Continue's openai provider (apiBase http://localhost:8080/v1/): its body, and the headers
    it sends even without an apiKey ("Bearer undefined", an empty api-key)."""
    server = await start_server(nursery, await make_service([tiny_path]))
    body = {"messages": [{"role": "user", "content": "Write hello in Python"}], "model": TINY_ID,
            "max_tokens": 4, "temperature": 0, "stream": True}
    reply = await server.request("POST", "/v1/chat/completions", json_body=body,
                                 headers={"Host": "localhost:8080", "Authorization": "Bearer undefined",
                                          "api-key": ""})
    assert reply.status == 200
    text = "".join(choice["delta"].get("content") or "" for chunk in chat_chunks(reply.body)
                   for choice in chunk["choices"])
    assert text

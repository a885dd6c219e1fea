"""POST /v1/embeddings over sockets: the real openai SDK, and raw HTTP in the shapes other
clients send (LangChain's token ids, Open WebUI's and litellm's bodies), on the tiny chat
model, the tiny BERT and the tiny nomic-bert.

The oracle for a vector is the float64 reference's final hidden states
(engine/reference.py), pooled and scaled to unit length by hand; for base64, the
float32 bytes the SDK decodes. Errors are OpenAI error objects with OpenAI's status.
"""

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import trio

from engine import load_model
from engine.reference import reference_hidden_states
from server_harness import make_service, start_server, tiny_path  # noqa: F401
from tiny import write_tiny_bert
from waiting import wait_until_sync

CHAT_ID, BERT_ID, NOMIC_ID = "tiny:chat-q8_0", "tiny:bert", "tiny:nomic-bert"
TEXTS = ["Hello, the cat sat on the mat!", "embeddings running", "the dog"]


@pytest.fixture(scope="session")
def bert_path(tmp_path_factory):
    return write_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny-bert.gguf")


@pytest.fixture(scope="session")
def nomic_path(tmp_path_factory):
    return write_tiny_bert(tmp_path_factory.mktemp("nomic") / "tiny-nomic-bert.gguf", architecture="nomic-bert")


@pytest.fixture
async def server(nursery, tiny_path, bert_path, nomic_path):
    return await start_server(nursery, await make_service([tiny_path, bert_path, nomic_path]))


def model_of(server, model_id: str):
    return server.service.registry.get(model_id).model


def expected(server, model_id: str, ids: list[int], pooling: str) -> np.ndarray:
    states = reference_hidden_states(model_of(server, model_id), ids)
    pooled = {"mean": states.mean(axis=0), "cls": states[0], "last": states[-1]}[pooling]
    return pooled / np.linalg.norm(pooled)


async def embeddings(server, body: dict):
    return await server.request("POST", "/v1/embeddings", json_body=body)


async def sdk(server, work):
    def run():
        with openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="sk-anything",
                           max_retries=0, timeout=60) as client:
            return work(client)
    return await trio.to_thread.run_sync(run)


async def test_the_openai_sdk_embeds_texts_through_base64_as_the_reference_does(server):
    created = await sdk(server, lambda client: client.embeddings.create(model=BERT_ID, input=TEXTS))
    assert created.object == "list" and created.model == BERT_ID
    bert = model_of(server, BERT_ID)
    token_lists = [bert.tokenize(text) for text in TEXTS]
    assert [item.index for item in created.data] == [0, 1, 2]
    for item, ids in zip(created.data, token_lists):
        np.testing.assert_allclose(item.embedding, expected(server, BERT_ID, ids, "mean"), atol=1e-5)
    assert created.usage.prompt_tokens == created.usage.total_tokens == sum(map(len, token_lists))


async def test_a_nomic_bert_gguf_embeds_through_the_sdk_and_raw_bodies_as_the_reference_does(server):
    created = await sdk(server, lambda client: client.embeddings.create(model=NOMIC_ID, input=TEXTS))
    raw = await embeddings(server, {"model": NOMIC_ID, "input": TEXTS, "encoding_format": "float"})
    assert created.model == NOMIC_ID and raw.status == 200, raw.body
    nomic = model_of(server, NOMIC_ID)
    for item, as_json, text in zip(created.data, raw.json()["data"], TEXTS):
        reference = expected(server, NOMIC_ID, nomic.tokenize(text), "mean")
        np.testing.assert_allclose(item.embedding, reference, atol=1e-5)
        np.testing.assert_allclose(as_json["embedding"], reference, atol=1e-5)


async def test_the_sdk_sends_token_ids_as_langchain_does_and_gets_the_texts_vectors(server):
    chat = model_of(server, CHAT_ID)
    token_lists = [chat.tokenize(text) for text in TEXTS]
    by_ids = await sdk(server, lambda client: client.embeddings.create(model=CHAT_ID, input=token_lists))
    by_text = await sdk(server, lambda client: client.embeddings.create(model=CHAT_ID, input=TEXTS,
                                                                        encoding_format="float"))
    for a, b, ids in zip(by_ids.data, by_text.data, token_lists):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
        np.testing.assert_allclose(a.embedding, expected(server, CHAT_ID, ids, "mean"), atol=1e-5)
    one = await sdk(server, lambda client: client.embeddings.create(model=CHAT_ID, input=token_lists[0]))
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(token_lists[0])


@pytest.mark.parametrize("body", [
    {"input": TEXTS, "model": BERT_ID},                                     # Open WebUI
    {"model": BERT_ID, "input": TEXTS, "encoding_format": None, "user": "u1"},  # litellm, LlamaIndex
    {"model": BERT_ID, "input": TEXTS, "encoding_format": "float"},
])
async def test_raw_bodies_in_the_clients_shapes_get_json_numbers(server, body):
    reply = await embeddings(server, body)
    assert reply.status == 200, reply.body
    data = reply.json()["data"]
    assert [item["object"] for item in data] == ["embedding"] * 3
    bert = model_of(server, BERT_ID)
    for item, text in zip(data, TEXTS):
        assert all(isinstance(x, float) for x in item["embedding"])
        np.testing.assert_allclose(item["embedding"], expected(server, BERT_ID, bert.tokenize(text), "mean"),
                                   atol=1e-5)


async def test_base64_is_the_float_vectors_float32_bytes(server):
    as_float = (await embeddings(server, {"model": BERT_ID, "input": TEXTS[0]})).json()["data"][0]["embedding"]
    as_b64 = (await embeddings(server, {"model": BERT_ID, "input": TEXTS[0], "encoding_format": "base64"}))
    vector = np.frombuffer(base64.b64decode(as_b64.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(vector, np.asarray(as_float, np.float32))  # (9 digits: the same floats)


async def test_dimensions_are_the_first_components_at_unit_length(server):
    full = (await embeddings(server, {"model": BERT_ID, "input": TEXTS[0]})).json()["data"][0]["embedding"]
    short = await embeddings(server, {"model": BERT_ID, "input": TEXTS[0], "dimensions": 8})
    vector = np.asarray(short.json()["data"][0]["embedding"])
    np.testing.assert_allclose(vector, np.asarray(full[:8]) / np.linalg.norm(full[:8]), atol=1e-6)
    over = await embeddings(server, {"model": BERT_ID, "input": TEXTS[0], "dimensions": 65})
    assert over.status == 400 and over.json()["error"]["param"] == "dimensions"


async def test_the_pooling_of_serve_pooling_replaces_the_models_own(server):
    server.service.config.pooling = "last"  # (what `serve --pooling last` sets)
    reply = await embeddings(server, {"model": BERT_ID, "input": TEXTS[0]})
    ids = model_of(server, BERT_ID).tokenize(TEXTS[0])
    np.testing.assert_allclose(reply.json()["data"][0]["embedding"], expected(server, BERT_ID, ids, "last"),
                               atol=1e-5)


async def test_64_short_inputs_take_one_forward_step(server):
    bert = model_of(server, BERT_ID)
    steps = bert.steps
    reply = await embeddings(server, {"model": BERT_ID, "input": [f"the cat {i}" for i in range(64)]})
    assert reply.status == 200 and len(reply.json()["data"]) == 64
    assert bert.steps == steps + 1


@pytest.mark.parametrize("body, param, code", [
    ({"model": BERT_ID, "input": ""}, "input[0]", "invalid_request"),
    ({"model": BERT_ID, "input": []}, "input", "invalid_request"),
    ({"model": BERT_ID, "input": [[]]}, "input[0]", "invalid_request"),
    ({"model": BERT_ID, "input": ["a", 3]}, "input[1]", "invalid_request"),
    ({"model": BERT_ID, "input": [[1, "2"]]}, "input[0]", "invalid_request"),
    ({"model": BERT_ID, "input": {"text": "a"}}, "input", "invalid_request"),
    ({"model": BERT_ID, "input": ["a"] * 2049}, "input", "invalid_request"),
    ({"model": BERT_ID, "input": [[5, 100000]]}, "input[0]", "invalid_request"),
    ({"model": BERT_ID, "input": [[-1]]}, "input[0]", "invalid_request"),
    ({"model": BERT_ID, "input": ["ok", "the " * 80]}, "input[1]", "context_length_exceeded"),
    ({"model": BERT_ID, "input": "a", "encoding_format": "int8"}, "encoding_format", "invalid_request"),
    ({"model": BERT_ID, "input": "a", "dimensions": 0}, "dimensions", "invalid_request"),
    ({"model": BERT_ID, "input": "a", "dimensions": True}, "dimensions", "invalid_request"),
    ({"model": BERT_ID, "input": "a", "pooling": "mean"}, "pooling", "invalid_request"),
    ({"input": "a"}, "model", "invalid_request"),
])
async def test_bad_requests_are_400_openai_error_objects(server, body, param, code):
    reply = await embeddings(server, body)
    assert reply.status == 400 and reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and (error["param"], error["code"]) == (param, code)


async def test_an_unknown_model_is_the_sdks_not_found_error(server):
    def work(client):
        with pytest.raises(openai.NotFoundError) as missing:
            client.embeddings.create(model="nope", input="a")
        return missing.value
    assert (await sdk(server, work)).code == "model_not_found"


@pytest.mark.parametrize("model_id", [BERT_ID, NOMIC_ID])
async def test_an_embedding_model_on_the_generating_routes_is_a_clear_400(server, model_id):
    chat = await server.request("POST", "/v1/chat/completions", json_body={
        "model": model_id, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status == 400
    assert chat.json()["error"]["code"] == "unsupported_capability" and chat.json()["error"]["param"] == "model"
    assert "/v1/embeddings" in chat.json()["error"]["message"]
    lmsp = await server.responses({"model": model_id, "input": [{"type": "message", "role": "user", "content": "hi"}]})
    assert lmsp.status == 400 and lmsp.json()["code"] == "unsupported_capability"


def test_serve_with_a_bert_gguf_and_pooling_serves_embeddings(tmp_path, bert_path):
    """`lmsp-min serve --model BERT.gguf --pooling cls`, as a user runs it: a process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "LMSP_HOME": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "lmsp_min.cli", "serve", "--model", str(bert_path), "--port", str(port),
         "--no-store", "--pooling", "cls"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    body = json.dumps({"model": BERT_ID, "input": TEXTS[0]}).encode()

    def embedded():
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return json.load(reply)
        except urllib.error.URLError:
            assert process.poll() is None, process.stderr.read()
            return None
    try:
        reply = wait_until_sync(embedded, "the server embedding", seconds=60, every=0.1)
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    with load_model(bert_path) as bert:
        ids = bert.tokenize(TEXTS[0])
        states = reference_hidden_states(bert, ids)
    np.testing.assert_allclose(reply["data"][0]["embedding"], states[0] / np.linalg.norm(states[0]), atol=1e-5)

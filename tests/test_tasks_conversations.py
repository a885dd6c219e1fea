"""Stored responses and conversations (6.2, D2, D6) over real sockets, and principals' isolation."""

import json

import pytest

from lmsp_min.http import Limits
from lmsp_min.validate import MAX_INPUT_ITEMS
from server_harness import make_service, parse_sse, start_server, tiny_path  # noqa: F401

RESPONSES = "/lmsp/v1/responses"
ALICE, BOB = "alice-secret-token", "bob-secret-token"
EVERY_SCOPE = ["models:read", "responses:write", "responses:read", "tasks:write", "tasks:read"]


def body(text: str = "Hello.", **fields) -> dict:
    return {"model": "tiny:chat-q8_0", "input": [{"role": "user", "content": text}],
            "max_output_tokens": 4, "temperature": 0, **fields}


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def server(nursery, tiny_path, tmp_path, store_location):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([
        {"token": ALICE, "principal": "alice", "scopes": EVERY_SCOPE},
        {"token": BOB, "principal": "bob", "scopes": EVERY_SCOPE},
    ]))
    service = await make_service([tiny_path], tokens_file=tokens, data_dir=store_location)
    return await start_server(nursery, service)


async def test_stored_response_is_served_byte_for_byte_then_deleted(server):
    reply = await server.responses(body(store=True), headers=auth(ALICE))
    assert reply.status == 200
    response_id = reply.json()["id"]
    stored = await server.request("GET", f"{RESPONSES}/{response_id}", headers=auth(ALICE))
    assert stored.status == 200 and stored.body == reply.body
    assert stored.headers["content-type"] == "application/json"
    deleted = await server.request("DELETE", f"{RESPONSES}/{response_id}", headers=auth(ALICE))
    assert deleted.json() == {"id": response_id, "object": "response.deleted", "deleted": True}
    for method in ("GET", "DELETE"):
        gone = await server.request(method, f"{RESPONSES}/{response_id}", headers=auth(ALICE))
        assert gone.status == 404 and gone.json()["code"] == "response_not_found"


async def test_unstored_and_unknown_responses_are_404(server):
    reply = await server.responses(body(), headers=auth(ALICE))
    for response_id in (reply.json()["id"], "resp_unknown"):
        got = await server.request("GET", f"{RESPONSES}/{response_id}", headers=auth(ALICE))
        assert got.status == 404 and got.json()["code"] == "response_not_found"


async def test_streamed_response_is_stored_before_its_final_event(server):
    async with server.connection() as client:
        await client.send("POST", RESPONSES, json_body=body(store=True, stream=True), headers=auth(ALICE))
        await client.read_head()
        events = parse_sse(b"".join([chunk async for chunk in client.read_chunks()]))
    response_id = events[0].data["response_id"]
    stored = (await server.request("GET", f"{RESPONSES}/{response_id}", headers=auth(ALICE))).json()
    assert stored["status"] == events[-1].data["status"]
    assert stored["output"][-1] == [e for e in events if e.event == "response.output_item.done"][-1].data["item"]


async def test_previous_response_id_chains_whole_conversations(server):
    first = (await server.responses(body("One.", store=True), headers=auth(ALICE))).json()
    second = (await server.responses(
        {**body("Two.", store=True), "previous_response_id": first["id"]}, headers=auth(ALICE))).json()
    third = await server.responses(
        {**body("Three.", store=True), "previous_response_id": second["id"]}, headers=auth(ALICE))
    assert third.status == 200
    store = server.service.store
    stored = await store.get_response(third.json()["id"], "alice")
    assert stored.input == [
        body("One.")["input"][0], *first["output"],
        body("Two.")["input"][0], *second["output"],
        body("Three.")["input"][0],
    ]
    # the conversation grows the prompt: each turn sees every earlier one
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert third.json()["usage"]["input_tokens"] > second["usage"]["input_tokens"]


async def test_previous_response_id_must_exist_and_be_yours(server):
    mine = (await server.responses(body(store=True), headers=auth(ALICE))).json()
    for token, response_id in ((ALICE, "resp_unknown"), (BOB, mine["id"])):
        reply = await server.responses({**body(), "previous_response_id": response_id}, headers=auth(token))
        assert reply.status == 404 and reply.json()["code"] == "response_not_found"
        assert reply.json()["param"] == "previous_response_id"


def reasoning(text: str = "") -> dict:
    """An earlier output item sent back: accepted, never rendered into the prompt."""
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


def json_size(items: list[dict]) -> int:
    return len(json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


async def test_a_conversation_holds_at_most_the_items_of_one_request(server):
    """D9, our reading: previous_response_id stands for sending the whole conversation in
    one request, so the effective input holds at most MAX_INPUT_ITEMS items. It grew by
    every turn's items, whatever the context window (reasoning items are not rendered)."""
    first_input = [reasoning()] * 4000 + body("One.")["input"]
    first = (await server.responses({**body(store=True), "input": first_input}, headers=auth(ALICE))).json()
    room = MAX_INPUT_ITEMS - len(first_input) - len(first["output"])
    fills = [reasoning()] * (room - 1) + body("Two.")["input"]  # exactly MAX_INPUT_ITEMS in all
    for extra, status in ((0, 200), (1, 400)):
        reply = await server.responses({**body(), "input": [reasoning()] * extra + fills,
                                        "previous_response_id": first["id"]}, headers=auth(ALICE))
        assert reply.status == status, reply.body
    assert reply.json()["code"] == "invalid_request" and reply.json()["param"] == "previous_response_id"
    assert "start a new conversation" in reply.json()["detail"]


async def test_a_conversation_holds_at_most_the_bytes_of_one_request(nursery, tiny_path, tmp_path):
    """D9, our reading: the effective input (the stored turns, then the request's own items
    as sent) is at most --max-body-bytes of JSON (compact, UTF-8), else 413. Each turn that
    sent 3 MB stored 3 MB more, and every later turn loaded all of it."""
    limit = 3000
    service = await make_service([tiny_path], limits=Limits(max_body_bytes=limit), data_dir=tmp_path / "data")
    server = await start_server(nursery, service)
    first_input = [reasoning("x" * 900), *body("Un é.")["input"]]
    first = (await server.responses({**body(store=True), "input": first_input})).json()
    earlier = [{"type": "reasoning", "summary": []}, *first_input[1:], *first["output"]]  # (stored empty)
    second_input = [reasoning(), *body("Deux é.")["input"]]
    padding = limit - json_size(earlier + second_input)  # exactly `limit` bytes in all
    replies = []
    for extra in (0, 1):
        second_input[0] = reasoning("x" * (padding + extra))
        replies.append(await server.responses({**body(store=True), "input": second_input,
                                               "previous_response_id": first["id"]}))
    assert replies[0].status == 200, replies[0].body
    assert replies[1].status == 413 and replies[1].json()["code"] == "request_too_large"
    assert replies[1].json()["param"] == "previous_response_id"
    # The second turn's padding was a reasoning item, which no prompt reads: it was not
    # stored, so the chain has room for a third turn.
    third = await server.responses({**body("Trois."), "previous_response_id": replies[0].json()["id"]})
    assert third.status == 200, third.body


async def test_another_principal_sees_nothing_of_yours(server):
    mine = (await server.responses(body(store=True), headers=auth(ALICE))).json()
    for method in ("GET", "DELETE"):
        reply = await server.request(method, f"{RESPONSES}/{mine['id']}", headers=auth(BOB))
        assert reply.status == 404 and reply.json()["code"] == "response_not_found"
    task = (await server.request("POST", "/lmsp/v1/tasks", json_body=body(), headers=auth(ALICE))).json()
    for method, path in (("GET", ""), ("GET", "/events"), ("POST", "/cancel")):
        reply = await server.request(method, f"/lmsp/v1/tasks/{task['id']}{path}", headers=auth(BOB))
        assert reply.status == 404 and reply.json()["code"] == "task_not_found"
    # still there for its owner
    assert (await server.request("GET", f"{RESPONSES}/{mine['id']}", headers=auth(ALICE))).status == 200
    assert (await server.request("GET", f"/lmsp/v1/tasks/{task['id']}", headers=auth(ALICE))).status == 200


async def test_without_storage_conversations_are_off(nursery, tiny_path):
    server = await start_server(nursery, await make_service([tiny_path]))  # --no-store
    model = (await server.request("GET", "/lmsp/v1/models")).json()["data"][0]
    assert "conversations" not in model["capabilities"] and "tasks" in model["capabilities"]
    reply = await server.responses(body(store=True))
    assert reply.status == 200  # store: true is ignored
    got = await server.request("GET", f"{RESPONSES}/{reply.json()['id']}")
    assert got.status == 404 and got.json()["code"] == "response_not_found"
    reply = await server.responses({**body(), "previous_response_id": reply.json()["id"]})
    assert reply.status == 400 and reply.json()["code"] == "unsupported_capability"
    assert reply.json()["param"] == "previous_response_id"


async def test_a_stored_response_survives_a_restart_of_the_service(tiny_path, tmp_path):
    """D6: `store: true` is durable: a new service on the same data directory serves the
    response as it was, and continues the conversation from it."""
    import trio

    from server_harness import start_server as start

    data_dir = tmp_path / "data"
    async with trio.open_nursery() as nursery:  # the first service, stopped at the end of the block
        first = await start(nursery, await make_service([tiny_path], data_dir=data_dir))
        reply = await first.responses(body("Remember me.", store=True))
        assert reply.status == 200
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        second = await start(nursery, await make_service([tiny_path], data_dir=data_dir))
        stored = await second.request("GET", f"{RESPONSES}/{reply.json()['id']}")
        assert stored.status == 200 and stored.body == reply.body
        follow_up = await second.responses({**body("And now?"), "previous_response_id": reply.json()["id"]})
        assert follow_up.status == 200, follow_up.body
        alone = (await second.responses(body("And now?"))).json()
        assert follow_up.json()["usage"]["input_tokens"] > alone["usage"]["input_tokens"]  # the first turn came too
        nursery.cancel_scope.cancel()

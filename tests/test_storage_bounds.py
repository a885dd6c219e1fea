"""Bounded storage over real sockets: what a task and a stored response keep, deleting a
task, and the --store-retention purge (docs/protocol.md D3, D6; docs/serving.md)."""

import json
import math
import sqlite3
import time

import pytest
import trio

from lmsp_min.store.sqlite import DB_NAME, SQLiteStore
from server_harness import make_service, start_server, tiny_path  # noqa: F401
from test_tasks import create, gated, wait_final
from waiting import wait_until

TASKS = "/lmsp/v1/tasks"
RESPONSES = "/lmsp/v1/responses"
MODEL = "tiny:chat-q8_0"
DAY = 86400.0
ALICE, BOB, READER = "alice-secret-token", "bob-secret-token", "reader-secret-token"
EVERY_SCOPE = ["models:read", "responses:write", "responses:read", "tasks:write", "tasks:read"]
# A text a prompt carries; the tiny model's output never spells it.
SECRET = "zq7Xv-private-words-Kw93"


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def asking(text: str = f"Remember {SECRET}.", **fields) -> dict:
    return {"model": MODEL, "input": [{"role": "user", "content": text}], "max_output_tokens": 2,
            "temperature": 0, **fields}


def on_disk(data_dir) -> bytes:
    """Every byte the database holds: its file and its write-ahead log."""
    return b"".join(path.read_bytes() for path in sorted(data_dir.glob(DB_NAME + "*")) if path.is_file())


async def serve(nursery, tiny_path, tmp_path, location):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([
        {"token": ALICE, "principal": "alice", "scopes": EVERY_SCOPE},
        {"token": BOB, "principal": "bob", "scopes": EVERY_SCOPE},
        {"token": READER, "principal": "alice", "scopes": ["responses:read", "tasks:read"]},
    ]))
    service = await make_service([tiny_path], tokens_file=tokens, data_dir=location)
    return await start_server(nursery, service)


@pytest.fixture
async def server(nursery, tiny_path, tmp_path, store_location):
    """A served service on each backend (SQLite, PostgreSQL)."""
    return await serve(nursery, tiny_path, tmp_path, store_location)


@pytest.fixture
async def sqlite_server(nursery, tiny_path, tmp_path):
    """On SQLite in tmp_path / "data", whose bytes the test reads."""
    return await serve(nursery, tiny_path, tmp_path, tmp_path / "data")


# -- what is kept ------------------------------------------------------------------------


async def test_a_store_false_task_leaves_no_input_behind(sqlite_server, tmp_path):
    """Finding 5: a task row kept its whole request body for ever, `store: false` too. The
    row keeps the request's parameters, never its input: once the task has ended, the
    prompt's words are nowhere in the database's bytes, while its result is still served."""
    server = sqlite_server
    task = await create(server, asking(), auth(ALICE))
    final = await wait_final_as(server, task["id"], ALICE)
    assert final["status"] in ("completed", "incomplete") and final["response"]["output"]
    assert SECRET.encode() not in on_disk(tmp_path / "data")
    events = await server.request("GET", f"{TASKS}/{task['id']}/events", headers=auth(ALICE))
    assert events.status == 200 and b"response.created" in events.body
    seen = await server.request("GET", f"/v1/responses/{task['response_id']}", headers=auth(ALICE))
    assert seen.status == 200 and seen.json()["temperature"] == 0  # (its parameters are kept)


async def test_a_store_true_task_keeps_its_input_in_its_stored_response_alone(server):
    task = await create(server, asking(store=True), auth(ALICE))
    await wait_final_as(server, task["id"], ALICE)
    row = await server.service.store.get_task(task["id"], None)
    assert "input" not in json.loads(row.request) and SECRET not in row.request
    assert SECRET in json.dumps((await server.service.store.get_response(task["response_id"], "alice")).input)
    follow_up = await server.responses({**asking("What did I say?"), "previous_response_id": task["response_id"]},
                                       headers=auth(ALICE))
    assert follow_up.status == 200, follow_up.body


async def test_input_no_prompt_reads_is_not_stored(sqlite_server, tmp_path):
    """Finding 5: four requests with a 3.9 MB `reasoning` item grew the database by 27 MB.
    What a stored response keeps of its input is what the prompt reads: the reasoning
    item stays in its place, empty, and so do keys no template reads."""
    server = sqlite_server
    data_dir = tmp_path / "data"
    before = len(on_disk(data_dir))
    thought = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "x" * 3_900_000}]}
    message = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi.",
                                                               "annotations": ["y" * 1000]}], "note": "z" * 1000}
    body = {**asking(), "input": [thought, message], "store": True}
    ids = []
    for _ in range(2):
        reply = await server.responses(body, headers=auth(ALICE))
        assert reply.status == 200, reply.body
        ids.append(reply.json()["id"])
        task = await create(server, body, auth(ALICE))
        await wait_final_as(server, task["id"], ALICE)
        ids.append(task["response_id"])
    assert len(on_disk(data_dir)) - before < 1_000_000  # (it was 27 MB)
    stored = await server.service.store.get_response(ids[-1], "alice")
    assert stored.input == [{"type": "reasoning", "id": "rs_1", "summary": []},
                            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}]
    # the conversation goes on from what was kept, and its prompt is the same as with everything
    follow_up = await server.responses({**asking("And?"), "previous_response_id": ids[0]}, headers=auth(ALICE))
    whole = await server.responses({**asking("And?"), "input": [thought, message, *json.loads(
        (await server.request("GET", f"{RESPONSES}/{ids[0]}", headers=auth(ALICE))).body)["output"],
        asking("And?")["input"][0]]}, headers=auth(ALICE))
    assert follow_up.status == whole.status == 200
    assert follow_up.json()["usage"]["input_tokens"] == whole.json()["usage"]["input_tokens"]


# -- DELETE /lmsp/v1/tasks/{id} ---------------------------------------------------------------


async def test_deleting_a_final_task(server):
    task = await create(server, asking(store=True), auth(ALICE))
    await wait_final_as(server, task["id"], ALICE)
    path = f"{TASKS}/{task['id']}"
    for token, status in ((READER, 403), (BOB, 404)):  # tasks:write; another principal's is unknown
        reply = await server.request("DELETE", path, headers=auth(token))
        assert reply.status == status, reply.body
    assert (await server.request("GET", path, headers=auth(ALICE))).status == 200
    reply = await server.request("DELETE", path, headers=auth(ALICE))
    assert reply.status == 200 and reply.json() == {"id": task["id"], "object": "task.deleted", "deleted": True}
    for method, suffix in (("GET", ""), ("GET", "/events"), ("POST", "/cancel"), ("DELETE", "")):
        gone = await server.request(method, path + suffix, headers=auth(ALICE))
        assert gone.status == 404 and gone.json()["code"] == "task_not_found", (method, suffix)
    # the response it stored is a resource of its own
    assert (await server.request("GET", f"{RESPONSES}/{task['response_id']}", headers=auth(ALICE))).status == 200
    assert await server.service.store.read_events(task["id"], 0) == []


async def test_a_running_task_is_cancelled_before_it_is_deleted(server, monkeypatch):
    gate = gated(server.service.registry.get(MODEL).model, monkeypatch)  # it runs until let go
    task = await create(server, asking(max_output_tokens=64), auth(ALICE))
    path = f"{TASKS}/{task['id']}"
    refused = await server.request("DELETE", path, headers=auth(ALICE))
    assert refused.status == 409 and refused.json()["code"] == "task_running"
    assert (await server.request("GET", path, headers=auth(ALICE))).json()["status"] in ("queued", "in_progress")
    with trio.fail_after(30):
        cancelled = await server.request("POST", path + "/cancel", headers=auth(ALICE))
    assert cancelled.json()["status"] == "cancelled"
    assert (await server.request("DELETE", path, headers=auth(ALICE))).status == 200
    gate.allow(math.inf)


async def test_deleting_a_background_response_deletes_its_task(server, monkeypatch):
    """The OpenAI face: a background response is its task and the response it stored; DELETE
    /v1/responses/{id} takes both (tasks:write too), and is 409 while it runs, as on /lmsp/v1."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "background": True}
    gate = gated(server.service.registry.get(MODEL).model, monkeypatch)
    running = (await server.request("POST", "/v1/responses", json_body=body, headers=auth(ALICE))).json()
    refused = await server.request("DELETE", f"/v1/responses/{running['id']}", headers=auth(ALICE))
    assert refused.status == 409 and refused.json()["error"]["code"] == "task_running"
    gate.allow(math.inf)
    row = await server.service.store.get_task_of_response(running["id"], "alice")
    await wait_final_as(server, row.id, ALICE)
    reader = await server.request("DELETE", f"/v1/responses/{running['id']}", headers=auth(READER))
    assert reader.status == 403 and "tasks:write" in reader.json()["error"]["message"]
    deleted = await server.request("DELETE", f"/v1/responses/{running['id']}", headers=auth(ALICE))
    assert deleted.status == 200 and deleted.json() == {"id": running["id"], "object": "response.deleted",
                                                        "deleted": True}
    for path in (f"/v1/responses/{running['id']}", f"{RESPONSES}/{running['id']}", f"{TASKS}/{row.id}"):
        assert (await server.request("GET", path, headers=auth(ALICE))).status == 404, path
    again = await server.request("DELETE", f"/v1/responses/{running['id']}", headers=auth(ALICE))
    assert again.status == 404


# -- --store-retention ------------------------------------------------------------------------


async def test_the_service_purges_what_outlived_its_retention(nursery, tiny_path, store_location, monkeypatch):
    """The purge runs in the service's nursery, by the service's clock (moved here, not
    waited for): past the retention, stored responses and final tasks are gone; a running
    task, and what is younger, stay."""
    service = await make_service([tiny_path], data_dir=store_location, event_retention=2.0)  # (a purge every 0.5 s)
    service.tasks.store_retention = 30 * DAY
    offset = 0.0
    service.tasks.clock = lambda: time.time() + offset
    server = await start_server(nursery, service)
    old_response = (await server.responses(asking(store=True))).json()
    old_task = await create(server, asking(store=False))
    await wait_final(server, old_task["id"])
    gate = gated(service.registry.get(MODEL).model, monkeypatch)
    running = await create(server, asking(max_output_tokens=64))
    offset = 30 * DAY + 60
    async def purged():
        return (await server.request("GET", f"{TASKS}/{old_task['id']}")).status == 404

    await wait_until(purged, "the old task purged", seconds=10, every=0.05)
    assert (await server.request("GET", f"{RESPONSES}/{old_response['id']}")).status == 404
    assert (await server.request("GET", f"{TASKS}/{running['id']}")).status == 200
    offset = 30 * DAY - 60  # from now on, only what ended over a minute ago is old enough
    gate.allow(math.inf)
    await wait_final(server, running["id"])
    young = (await server.responses(asking(store=True))).json()
    await service.tasks.purge()
    assert (await server.request("GET", f"{RESPONSES}/{young['id']}")).status == 200
    assert (await server.request("GET", f"{TASKS}/{running['id']}")).status == 200


async def test_a_retention_of_zero_keeps_everything(nursery, tiny_path, store_location):
    service = await make_service([tiny_path], data_dir=store_location)
    service.tasks.store_retention = 0
    service.tasks.clock = lambda: time.time() + 3650 * DAY
    server = await start_server(nursery, service)
    stored = (await server.responses(asking(store=True))).json()
    task = await create(server, asking())
    await wait_final(server, task["id"])
    await service.tasks.purge()
    assert (await server.request("GET", f"{RESPONSES}/{stored['id']}")).status == 200
    assert (await server.request("GET", f"{TASKS}/{task['id']}")).status == 200


async def test_the_database_file_reuses_what_the_purge_freed(tmp_path):
    """The size bound: a purge's pages go to SQLite's freelist and the next writes reuse
    them, so a second retention window of the same data does not grow the file."""
    store = await SQLiteStore.open(tmp_path)
    path = tmp_path / DB_NAME
    body = json.dumps({"created_at": 0, "model": MODEL, "status": "completed", "output": []})

    async def fill(prefix: str) -> int:
        for index in range(40):  # 40 responses of 100 KB: 4 MB
            await store.put_response(f"resp_{prefix}{index}", "alice", [{"role": "user", "content": "w" * 100_000}],
                                     body)
        with sqlite3.connect(path) as conn:  # (into the file: the size compared is the file's)
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return path.stat().st_size

    first = await fill("a")
    assert await store.purge_stored(older_than=0) == (40, 0)
    second = await fill("b")
    assert first > 4_000_000 and second < first * 1.1
    store.close()


async def wait_final_as(server, task_id: str, token: str, seconds: float = 30) -> dict:
    async def final():
        task = (await server.request("GET", f"{TASKS}/{task_id}", headers=auth(token))).json()
        return task if task["status"] in ("completed", "incomplete", "failed", "cancelled") else None

    return await wait_until(final, f"task {task_id} final", seconds, every=0.02)


def test_store_retention_is_a_duration():
    from lmsp_min.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).store_retention == 30 * DAY
    assert [parse(["serve", "--store-retention", text]).store_retention for text in ("12h", "90m", "45s", "0", "7")] \
        == [43200, 5400, 45, 0, 7]
    with pytest.raises(SystemExit):
        parse(["serve", "--store-retention", "-1d"])

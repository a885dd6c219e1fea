"""Auth (D7): bearer tokens, scopes per route, loopback-only without tokens."""

import json

import pytest

from lmsp_min.auth import Auth, host_name, is_loopback
from lmsp_min.service import serve
from server_harness import make_service, start_server, tiny_path  # noqa: F401
from waiting import wait_until

TINY_ID = "tiny:chat-q8_0"
ADMIN = "s3cret-admin-token"
READER = "s3cret-reader-token"


@pytest.fixture
def tokens_file(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps([
        {"token": ADMIN, "principal": "alice",
         "scopes": ["models:read", "responses:write", "responses:read", "tasks:write", "tasks:read"]},
        {"token": READER, "principal": "bob", "scopes": ["models:read"]},
    ]))
    return path


@pytest.fixture
async def guarded(nursery, tiny_path, tokens_file):
    lines = []
    service = await make_service([tiny_path], tokens_file=tokens_file, log=lines.append)
    server = await start_server(nursery, service)
    server.lines = lines
    return server


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


async def test_missing_or_unknown_token_is_401_with_challenge(guarded):
    for headers in ({}, _bearer("wrong"), {"Authorization": "Basic YWxpY2U6eA=="}, {"Authorization": "Bearer"}):
        reply = await guarded.request("GET", "/lmsp/v1/models", headers=headers)
        assert reply.status == 401
        assert reply.headers["www-authenticate"].startswith("Bearer")
        assert reply.headers["content-type"] == "application/problem+json"
        assert reply.json()["code"] == "unauthorized"


async def test_healthz_needs_no_token_and_says_whether_a_balancer_may_send_requests(guarded, monkeypatch):
    """GET /healthz (outside both faces, without auth): 200 while serving; 503 with Retry-After
    while the node drains or cannot reach its store, a tiny body saying which."""
    reply = await guarded.request("GET", "/healthz")
    assert (reply.status, reply.json()) == (200, {"status": "serving"})
    assert (await guarded.request("GET", "/lmsp/v1/models")).status == 401  # (the rest needs a token)
    store = guarded.service.store
    monkeypatch.setattr(type(store), "reachable", property(lambda self: False))
    reply = await guarded.request("GET", "/healthz")
    assert (reply.status, reply.json()) == (503, {"status": "store_unavailable"}) and "retry-after" in reply.headers
    guarded.service.draining = True  # (as Service.drain does first)
    reply = await guarded.request("GET", "/healthz")
    assert (reply.status, reply.json()) == (503, {"status": "draining"}) and "retry-after" in reply.headers


async def test_scopes_per_route(guarded):
    body = {"model": TINY_ID, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 1}
    assert (await guarded.request("GET", "/lmsp/v1/models", headers=_bearer(READER))).status == 200
    assert (await guarded.request("GET", f"/lmsp/v1/models/{TINY_ID}", headers=_bearer(READER))).status == 200
    refused = await guarded.responses(body, headers=_bearer(READER))
    assert refused.status == 403 and refused.json()["code"] == "insufficient_scope"
    allowed = await guarded.responses(body, headers=_bearer(ADMIN))
    assert allowed.status == 200


# D7's route scopes: every route, the one scope it needs (HEAD is GET's route)
ROUTE_SCOPES = [
    ("GET", "/lmsp/v1/models", "models:read"),
    ("GET", f"/lmsp/v1/models/{TINY_ID}", "models:read"),
    ("POST", "/lmsp/v1/responses", "responses:write"),
    ("GET", "/lmsp/v1/responses/resp_x", "responses:read"),
    ("DELETE", "/lmsp/v1/responses/resp_x", "responses:read"),
    ("POST", "/lmsp/v1/tasks", "tasks:write"),
    ("POST", "/lmsp/v1/tasks/task_x/cancel", "tasks:write"),
    ("GET", "/lmsp/v1/tasks/task_x", "tasks:read"),
    ("HEAD", "/lmsp/v1/tasks/task_x", "tasks:read"),
    ("GET", "/lmsp/v1/tasks/task_x/events", "tasks:read"),
]


@pytest.fixture
async def one_scope_each(nursery, tiny_path, tmp_path):
    """A server with one token per scope (named after it) and one with every scope but it."""
    from lmsp_min.auth import SCOPES

    entries = []
    for scope in SCOPES:
        entries.append({"token": f"only-{scope}", "principal": "p", "scopes": [scope]})
        entries.append({"token": f"all-but-{scope}", "principal": "p", "scopes": [s for s in SCOPES if s != scope]})
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(entries))
    return await start_server(nursery, await make_service([tiny_path], tokens_file=path))


@pytest.mark.parametrize("method, path, scope", ROUTE_SCOPES)
async def test_each_route_needs_its_scope_and_only_it(one_scope_each, method, path, scope):
    # (an empty JSON object: a POST that passes auth is refused by validation, cheaply)
    kwargs = {"json_body": {}} if method == "POST" else {}
    refused = await one_scope_each.request(method, path, headers=_bearer(f"all-but-{scope}"), **kwargs)
    assert refused.status == 403, refused.body
    assert 'error="insufficient_scope"' in refused.headers["www-authenticate"]
    if method != "HEAD":
        assert refused.json()["code"] == "insufficient_scope" and scope in refused.json()["detail"]
    allowed = await one_scope_each.request(method, path, headers=_bearer(f"only-{scope}"), **kwargs)
    assert allowed.status not in (401, 403), allowed.body
    # tools:execute is reserved: it grants nothing in 1.0
    nothing = await one_scope_each.request(method, path, headers=_bearer("only-tools:execute"), **kwargs)
    assert nothing.status == 403


async def test_tokens_never_reach_the_log(guarded):
    await guarded.request("GET", "/lmsp/v1/models", headers=_bearer(ADMIN))
    await guarded.request("GET", "/lmsp/v1/models", headers=_bearer("a-wrong-guess"))
    # each line is written once its response is sent
    await wait_until(lambda: sum("GET /lmsp/v1/models" in line for line in guarded.lines) >= 2, "both logged")
    assert not any(ADMIN in line or "a-wrong-guess" in line for line in guarded.lines)
    assert ADMIN not in repr(guarded.service.auth.tokens)


async def test_without_tokens_everyone_is_local_on_loopback(nursery, tiny_path):
    service = await make_service([tiny_path])
    server = await start_server(nursery, service)
    assert (await server.request("GET", "/lmsp/v1/models")).status == 200
    assert Auth().authenticate(None, "responses:write", "localhost:8080") == "local"


@pytest.mark.parametrize("host, status", [
    ("localhost:8080", 200), ("127.0.0.1", 200), ("[::1]:8080", 200), ("app.localhost", 200),
    ("LOCALHOST.", 200), ("attacker.example:8080", 400), ("192.168.1.2", 400), ("localhost.evil", 400),
])
async def test_without_tokens_only_a_request_to_a_loopback_name_is_local(nursery, tiny_path, host, status):
    """A page whose domain rebinds to 127.0.0.1 gets the browser to send its Host: refused."""
    server = await start_server(nursery, await make_service([tiny_path]))
    reply = await server.request("GET", "/lmsp/v1/models", headers={"Host": host})
    assert reply.status == status
    if status == 400:
        assert reply.json()["code"] == "invalid_request" and "loopback" in reply.json()["detail"]


async def test_with_tokens_any_host_is_fine(guarded):
    reply = await guarded.request("GET", "/lmsp/v1/models", headers={"Host": "models.example", **_bearer(ADMIN)})
    assert reply.status == 200


async def test_non_loopback_without_tokens_is_refused(tiny_path):
    service = await make_service([tiny_path])
    with pytest.raises(ValueError, match="loopback"):
        await serve(service, "0.0.0.0", 0)


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.com")


@pytest.mark.parametrize("content, message", [
    ("not json", "not valid JSON"),
    ("[]", "non-empty JSON list"),
    ('[{"token": "t", "principal": "p", "scopes": ["root"]}]', "unknown scope"),
    ('[{"token": "", "principal": "p", "scopes": []}]', "'token'"),
    ('[{"token": "t", "principal": "p", "scopes": []}, {"token": "t", "principal": "q", "scopes": []}]',
     "twice"),
])
def test_bad_tokens_files_are_refused_without_quoting_tokens(tmp_path, content, message):
    path = tmp_path / "tokens.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        Auth.from_file(path)
    assert '"t"' not in str(info.value)


@pytest.mark.parametrize("token", ["caf\u00e9-token", " padded-token", "padded-token ", "tab\there"])
def test_a_token_no_request_can_present_is_refused(tmp_path, token):
    """Header values arrive as ASCII (UTF-8 bytes are read as Latin-1) and the credentials
    are stripped: such a token was accepted, and its principal only ever got 401."""
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps([{"token": token, "principal": "p", "scopes": []}]), encoding="utf-8")
    with pytest.raises(ValueError, match="printable ASCII") as info:
        Auth.from_file(path)
    assert token.strip() not in str(info.value)


@pytest.mark.parametrize("host, status", [
    ("host.docker.internal:8080", 200), ("HOST.docker.internal.", 200), ("localhost:8080", 200),
    ("docker.internal", 400), ("host.docker.internal.evil", 400), ("attacker.example", 400),
])
async def test_a_name_given_with_allow_host_is_answered_without_tokens(nursery, tiny_path, host, status):
    """--allow-host host.docker.internal: a container's request passes, a rebound domain still does not."""
    service = await make_service([tiny_path], allowed_hosts=[host_name("host.docker.internal")])
    server = await start_server(nursery, service)
    reply = await server.request("GET", "/lmsp/v1/models", headers={"Host": host})
    assert reply.status == status
    if status == 400:
        assert "--allow-host" in reply.json()["detail"]


async def test_allow_host_does_not_open_a_public_address_without_tokens(tiny_path):
    """Any program on the network can send `Host: host.docker.internal`: the name is no credential."""
    service = await make_service([tiny_path], allowed_hosts=["host.docker.internal"])
    with pytest.raises(ValueError, match="loopback"):
        await serve(service, "0.0.0.0", 0)


@pytest.mark.parametrize("text, name", [("host.docker.internal", "host.docker.internal"),
                                        ("Box.LAN.", "box.lan"), ("10.0.0.2", "10.0.0.2"), ("[fd00::2]", "[fd00::2]")])
def test_an_allowed_host_is_written_as_a_host_header_names_it(text, name):
    assert host_name(text) == name


@pytest.mark.parametrize("text", ["*", "", "host.docker.internal:8080", "http://box", "a b", "-box"])
def test_an_allowed_host_is_a_name_or_address_alone(text):
    with pytest.raises(ValueError, match="host name"):
        host_name(text)

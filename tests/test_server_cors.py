"""CORS (`--cors-origin`): preflights, listed and unlisted origins, `*`, both faces, streams."""

import json

import pytest

from lmsp_min.cors import CorsPolicy, parse_origin
from lmsp_min.service import serve
from server_harness import close_service, make_service, start_server, tiny_path  # noqa: F401

TINY_ID = "tiny:chat-q8_0"
PAGE = "http://localhost:3000"  # the listed origin
OTHER = "http://evil.example"
TOKEN = "s3cret-page-token"
CHAT = {"model": TINY_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture
async def server(nursery, tiny_path):
    return await start_server(nursery, await make_service([tiny_path], cors_origins=[PAGE]))


@pytest.fixture
async def guarded(nursery, tiny_path, tmp_path):
    """Tokens, and any origin."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"token": TOKEN, "principal": "page",
                                   "scopes": ["models:read", "responses:write"]}]))
    return await start_server(nursery, await make_service([tiny_path], tokens_file=tokens, cors_origins=["*"]))


def preflight_headers(origin: str, method: str = "POST", headers: str = "authorization, content-type") -> dict:
    return {"Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers}


def cors_headers(reply) -> dict:
    return {name: value for name, value in reply.headers.items() if name.startswith("access-control-")}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/lmsp/v1/responses"])
async def test_a_preflight_from_a_listed_origin_is_204_with_what_the_request_may_send(server, path):
    asked = "authorization, content-type, x-stainless-lang, x-stainless-retry-count, x-custom"
    reply = await server.request("OPTIONS", path, headers=preflight_headers(PAGE, headers=asked))
    assert reply.status == 204 and reply.body == b"" and "content-length" not in reply.headers
    assert reply.headers["access-control-allow-origin"] == PAGE
    assert reply.headers["access-control-allow-credentials"] == "true"
    assert reply.headers["vary"] == "Origin"
    assert "POST" in reply.headers["access-control-allow-methods"].split(", ")
    allowed = {name.lower() for name in reply.headers["access-control-allow-headers"].split(", ")}
    assert {"authorization", "content-type", "lmsp-version", "idempotency-key", "last-event-id",
            "x-stainless-lang", "x-stainless-retry-count"} <= allowed
    assert "x-custom" not in allowed  # (the browser then refuses a request that sends it)
    assert int(reply.headers["access-control-max-age"]) > 0


@pytest.mark.parametrize("path, error_key", [("/v1/chat/completions", "error"), ("/lmsp/v1/responses", "code")])
async def test_a_preflight_from_an_unlisted_origin_gets_no_cors_header(server, path, error_key):
    reply = await server.request("OPTIONS", path, headers=preflight_headers(OTHER))
    assert reply.status == 400 and error_key in reply.json()  # the face's error format
    assert cors_headers(reply) == {} and reply.headers["vary"] == "Origin"
    assert "--cors-origin" in json.dumps(reply.json())


async def test_a_public_page_may_call_the_private_service_when_its_origin_is_listed(server):
    """Chromium's Private Network Access: a page on a public address calling loopback asks first."""
    asking = {**preflight_headers(PAGE), "Access-Control-Request-Private-Network": "true"}
    allowed = await server.request("OPTIONS", "/v1/chat/completions", headers=asking)
    assert allowed.status == 204 and allowed.headers["access-control-allow-private-network"] == "true"
    refused = await server.request("OPTIONS", "/v1/chat/completions", headers={**asking, "Origin": OTHER})
    assert refused.status == 400 and cors_headers(refused) == {}
    plain = await server.request("OPTIONS", "/v1/chat/completions", headers=preflight_headers(PAGE))
    assert "access-control-allow-private-network" not in plain.headers


async def test_a_preflight_needs_no_token(guarded):
    """The browser sends a preflight without credentials: it is answered before authentication."""
    reply = await guarded.request("OPTIONS", "/v1/models", headers=preflight_headers(OTHER, "GET", "authorization"))
    assert reply.status == 204 and reply.headers["access-control-allow-origin"] == "*"


async def test_a_preflight_for_no_route_is_404_and_for_another_method_405(server):
    missing = await server.request("OPTIONS", "/v1/nothing", headers=preflight_headers(PAGE))
    assert missing.status == 404 and missing.headers["access-control-allow-origin"] == PAGE
    other = await server.request("OPTIONS", "/v1/models", headers=preflight_headers(PAGE, "PUT"))
    assert other.status == 405


@pytest.mark.parametrize("method, path, body, status", [
    ("GET", "/lmsp/v1/models", None, 200), ("GET", "/v1/models", None, 200),
    ("POST", "/v1/chat/completions", CHAT, 200),
    ("GET", "/lmsp/v1/models/no-such-model", None, 404), ("GET", "/v1/models/no-such-model", None, 404),
    ("POST", "/v1/chat/completions", {**CHAT, "n": 9}, 400),
])
async def test_every_answer_to_a_listed_origin_lets_its_page_read_it(server, method, path, body, status):
    reply = await server.request(method, path, json_body=body, headers={"Origin": PAGE})
    assert reply.status == status
    assert reply.headers["access-control-allow-origin"] == PAGE
    assert reply.headers["access-control-allow-credentials"] == "true"
    exposed = reply.headers["access-control-expose-headers"].split(", ")
    assert {"X-Request-Id", "Retry-After", "Location", "Idempotent-Replayed", "LMSP-Version"} <= set(exposed)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {**CHAT, "stream": True}),
                                        ("/lmsp/v1/responses", {"model": TINY_ID, "stream": True,
                                                                "input": [{"role": "user", "content": "hi"}],
                                                                "max_output_tokens": 3})])
async def test_a_stream_to_a_listed_origin_carries_its_cors_headers(server, path, body):
    reply = await server.request("POST", path, json_body=body, headers={"Origin": PAGE})
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    assert reply.headers["access-control-allow-origin"] == PAGE and b"data: " in reply.body


async def test_an_unlisted_origin_is_answered_without_cors_headers(server):
    """Its browser then keeps the answer from the page (CORS is the browser's rule to enforce)."""
    reply = await server.request("GET", "/v1/models", headers={"Origin": OTHER})
    assert reply.status == 200 and cors_headers(reply) == {} and reply.headers["vary"] == "Origin"


async def test_any_origin_is_answered_star_and_never_with_credentials(guarded):
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for headers, status in [({"Origin": OTHER, **bearer}, 200), ({"Origin": OTHER}, 401)]:
        for path in ("/v1/models", "/lmsp/v1/models"):
            reply = await guarded.request("GET", path, headers=headers)
            assert reply.status == status
            assert reply.headers["access-control-allow-origin"] == "*"
            assert "access-control-allow-credentials" not in reply.headers


async def test_without_cors_origin_nothing_is_said_and_options_is_405(nursery, tiny_path):
    server = await start_server(nursery, await make_service([tiny_path]))
    assert (await server.request("OPTIONS", "/v1/models", headers=preflight_headers(PAGE))).status == 405
    reply = await server.request("GET", "/v1/models", headers={"Origin": PAGE})
    assert cors_headers(reply) == {} and "vary" not in reply.headers


async def test_any_origin_without_tokens_is_loopback_only(tiny_path):
    """`*` without tokens lets any page read the service's answers: on loopback only, where a
    service without tokens listens anyway."""
    service = await make_service([tiny_path], cors_origins=["*"])
    try:
        with pytest.raises(ValueError, match="loopback"):
            await serve(service, "0.0.0.0", 0)
    finally:
        await close_service(service)


@pytest.mark.parametrize("text, origin", [
    ("http://localhost:3000", "http://localhost:3000"), ("HTTP://LocalHost:3000/", "http://localhost:3000"),
    ("http://box:80", "http://box"), ("https://box:443", "https://box"), ("https://box:80", "https://box:80"),
    ("http://[::1]:3000", "http://[::1]:3000"), ("chrome-extension://abcdef", "chrome-extension://abcdef"),
    ("*", "*"),
])
def test_an_origin_is_written_as_browsers_send_it(text, origin):
    assert parse_origin(text) == origin


@pytest.mark.parametrize("text", ["null", "localhost:3000", "http://box/app", "http://box?x", "http://user@box", ""])
def test_an_origin_is_a_scheme_host_and_port_alone(text):
    with pytest.raises(ValueError, match="not an origin"):
        parse_origin(text)


def test_a_policy_reads_its_origins_as_the_command_line_does():
    """A ServiceConfig written by hand is read like --cors-origin: its origins match what browsers send."""
    headers = dict(CorsPolicy(["HTTP://LocalHost:3000/"]).response_headers(PAGE))
    assert headers["Access-Control-Allow-Origin"] == PAGE
    with pytest.raises(ValueError, match="not an origin"):
        CorsPolicy(["localhost:3000"])

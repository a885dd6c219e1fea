"""A real browser calls the service from a page of another origin (`--cors-origin`).

Headless Chromium (Debian's `chromium`; `.ci/run` installs it) loads a page from a second
local server, on another port, so another origin. The page's script calls the service
with `fetch` (a JSON body and `Authorization`: the browser sends a preflight first),
reads the streamed answer, and reports what it read to its own server, where the test
reads it. No new Python dependency: no driver, no websocket.
"""

import json
import shutil
from subprocess import DEVNULL

import pytest
import trio

from lmsp_min.http import HTTPServer, Response
from server_harness import make_service, start_server, tiny_path  # noqa: F401

TINY_ID = "tiny:chat-q8_0"
CHAT = {"model": TINY_ID, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}
BROWSER_DEADLINE = 120  # seconds for Chromium to start, load the page and report, on a loaded machine
# The page reports the answer it read (`RESULT {...}`), or the error its fetch raised (`REFUSED ...`).
PAGE = """<!doctype html><html><body><script>
async function ask() {
  const reply = await fetch(API + "/v1/chat/completions", {
    method: "POST", body: JSON.stringify(BODY),
    headers: {"Content-Type": "application/json", "Authorization": "Bearer any", "X-Stainless-Lang": "js"},
  });
  const reader = reply.body.getReader(), decoder = new TextDecoder();
  let text = "", chunks = 0;
  for (;;) {
    const {done, value} = await reader.read();
    if (done) break;
    chunks += 1;
    text += decoder.decode(value, {stream: true});
  }
  let answer = "";
  for (const line of text.split("\\n")) {
    if (line.startsWith("data: {")) answer += JSON.parse(line.slice(6)).choices.map(c => c.delta.content || "").join("");
  }
  return {status: reply.status, request_id: reply.headers.get("X-Request-Id"), chunks, answer,
          done: text.includes("data: [DONE]")};
}
const report = text => fetch("/report", {method: "POST", body: text});
ask().then(r => report("RESULT " + JSON.stringify(r)), e => report("REFUSED " + e));
</script></body></html>"""

pytestmark = pytest.mark.skipif(shutil.which("chromium") is None,
                                reason="Debian's chromium is not installed (.ci/run installs it: apt-get install chromium)")


class Page:
    """A second server, on a port of its own (another origin): it serves the page that calls the
    service at `api` (set once the service runs, which lists the page's origin), and takes
    the page's report of what it read (`POST /report`, from the same origin)."""

    def __init__(self):
        self.api = ""
        self.origin = ""
        self.report: str | None = None
        self.reported = trio.Event()

    async def start(self, nursery) -> None:
        (host, port), *_ = await nursery.start(HTTPServer(self._handle, log=lambda line: None).serve, "127.0.0.1", 0)
        self.origin = f"http://{host}:{port}"

    async def _handle(self, request):
        if request.method == "POST":
            self.report = (await request.body()).decode("utf-8")
            self.reported.set()
            return Response(204, b"", None)
        page = PAGE.replace("API", json.dumps(self.api), 1).replace("BODY", json.dumps({**CHAT, "stream": True}), 1)
        return Response(200, page.encode("utf-8"), "text/html; charset=utf-8")

    async def read_in_chromium(self, profile) -> str:
        """Headless Chromium loads the page; what its script reported."""
        command = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                   f"--user-data-dir={profile}", f"{self.origin}/page.html"]
        async def chromium():
            done = await trio.run_process(command, stdout=DEVNULL, capture_stderr=True, check=False)
            raise AssertionError(f"Chromium ended ({done.returncode}) before the page reported:\n"
                                 + done.stderr.decode("utf-8", "replace")[-2000:])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(chromium)
            with trio.fail_after(BROWSER_DEADLINE):
                await self.reported.wait()
            nursery.cancel_scope.cancel()  # (which ends Chromium)
        return self.report


async def page_and_service(nursery, tiny_path, listed) -> tuple[Page, object]:
    """The page, and a service listing `listed(page's origin)` as its CORS origins."""
    page = Page()
    await page.start(nursery)
    server = await start_server(nursery, await make_service([tiny_path], cors_origins=listed(page.origin)))
    page.api = f"http://127.0.0.1:{server.port}"
    return page, server


async def test_a_page_of_a_listed_origin_reads_a_streamed_answer(nursery, tiny_path, tmp_path):
    page, server = await page_and_service(nursery, tiny_path, lambda origin: [origin])
    expected = (await server.request("POST", "/v1/chat/completions", json_body=CHAT)).json()
    read = await page.read_in_chromium(tmp_path / "profile")
    assert read.startswith("RESULT "), read
    result = json.loads(read[len("RESULT "):])
    assert result["status"] == 200 and result["done"] and result["chunks"] >= 1
    assert result["answer"] and result["answer"] == expected["choices"][0]["message"]["content"]
    assert result["request_id"].startswith("req_")  # an exposed header: the page could read it


async def test_a_page_of_an_unlisted_origin_is_refused_and_nothing_is_generated(nursery, tiny_path, tmp_path):
    page, server = await page_and_service(nursery, tiny_path, lambda origin: ["http://localhost:3000"])
    read = await page.read_in_chromium(tmp_path / "profile")
    assert read.startswith("REFUSED TypeError"), read  # fetch's "Failed to fetch"
    log = server.service.log_lines
    assert any(line.startswith("OPTIONS /v1/chat/completions 400") for line in log), log
    assert not any(line.startswith("POST") for line in log), log  # the browser never sent the request

"""A full disk under the store, a real one (a tmpfs of a few MiB): a write is a 503 with
Retry-After, said once in the log, never a 500 with a traceback per request; what is
stored reads on; once there is room, writes go on. (PostgreSQL's disk_full, SQLSTATE
53100, is tests/test_store_postgres.py's.)"""

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_harness import make_service, parse_sse, start_server, tiny_path  # noqa: F401
from test_tasks import TASKS, all_events, task_body, wait_final

DISK_SIZE = "4m"  # room for the database and its WAL, small enough to fill in a blink


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A tmpfs of DISK_SIZE mounted at tmp_path/disk, unmounted at the end (after the
    test's trio fixtures, so after the server closed its database)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def fill(directory: Path) -> Path:
    """A file that takes every free block of the file system `directory` is on."""
    path = directory / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return path


async def test_a_full_disk_is_a_503_with_retry_after_and_what_is_stored_reads_on(nursery, tiny_path, small_disk):
    server = await start_server(nursery, await make_service([tiny_path], data_dir=small_disk / "data"))
    stored = await server.responses(task_body(store=True))
    assert stored.status == 200
    task = (await server.request("POST", TASKS, json_body=task_body())).json()
    await wait_final(server, task["id"])
    events = [(e.id, e.event) for e in await all_events(server, task["id"])]
    filler = fill(small_disk)

    for path in ("/lmsp/v1/responses", TASKS):
        refused = await server.request("POST", path, json_body=task_body(store=True))
        assert refused.status == 503, refused.body  # (it was 500 internal_error)
        assert refused.headers["retry-after"] == "30" and refused.json()["code"] == "model_unavailable"
    streamed = parse_sse((await server.responses(task_body(store=True, stream=True))).body)
    assert streamed[-1].event == "error" and streamed[-1].data["error"]["status"] == 503
    again = await server.request("GET", f"/lmsp/v1/responses/{stored.json()['id']}")
    assert again.status == 200 and again.body == stored.body
    assert [(e.id, e.event) for e in await all_events(server, task["id"])] == events
    log = server.service.log_lines
    assert sum(line.startswith("error: the database's disk is full") for line in log) == 1  # for all three
    assert not any("Traceback" in line for line in log)

    filler.unlink()  # room again: the same request succeeds
    assert (await server.responses(task_body(store=True))).status == 200
    assert any(line.startswith("the database's disk has room again") for line in log)

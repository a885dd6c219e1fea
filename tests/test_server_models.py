"""Models (D2): ids from file names, model objects from GGUF headers, lazy shared loading."""

import os
import shutil
import struct
import threading
from collections import Counter
from pathlib import Path

import gguf
import pytest
import trio
import trio.testing

from engine.gguf_header import read_header
from lmsp_min.registry import ModelEntry, Registry, model_id_for
from lmsp_min.service import Service, ServiceConfig
from server_harness import make_service, open_service, server, start_server, tiny_path  # noqa: F401

TINY_ID = "tiny:chat-q8_0"
MODEL_FIELDS = {"id", "object", "created_at", "owned_by", "capabilities", "context_window",
                "architecture", "quantization", "parameters", "size_bytes"}


@pytest.mark.parametrize("name, expected", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2:135m-instruct-q4_1"),
    ("gemma-3-270m-q4_k_m.gguf", "gemma3:270m-q4_k_m"),
    ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "llama3.2:1b-instruct-q4_k_m"),
    ("qwen2.5-0.5b-instruct-q8_0.gguf", "qwen2.5:0.5b-instruct-q8_0"),
    ("Qwen3-0.6B-Q8_0.gguf", "qwen3:0.6b-q8_0"),
    ("model.gguf", "model"),
    ("my model (v2).gguf", "my:model-v2"),
])
def test_model_ids_from_file_names(name, expected):
    assert model_id_for(Path(name)) == expected


async def test_header_agrees_with_the_engine(server, tiny_path):
    header = read_header(tiny_path)
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["tokenizer.ggml.tokens"] == 49152  # arrays are skipped: their length
    info = server.service.registry.get(TINY_ID).model.info
    assert header.n_parameters == info.n_params
    entry = ModelEntry.from_file(tiny_path)
    assert (entry.quantization, entry.context_window) == (info.quantization, info.context_length)


async def test_capabilities_predicted_from_the_header_are_the_engine_s(server, tiny_path):
    loaded = server.service.registry.get(TINY_ID).model.info.capabilities
    assert sorted(ModelEntry.from_file(tiny_path).capabilities) == sorted(loaded)


@pytest.mark.parametrize("template, tokenizer, expected", [
    ("{{ '<think>' }}{{ messages }}", "gpt2", ("reasoning", "tools", "structured_output")),
    ("{{ messages }}", "llama", ("tools", "structured_output")),
    ("{{ '<think>' }}", "bert", ("reasoning",)),
    (None, "rwkv", ()),
])
def test_capabilities_before_a_load_come_from_the_template_and_the_tokenizer_s_kind(
        tmp_path, template, tokenizer, expected):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_tokenizer_model(tokenizer)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert ModelEntry.from_file(path).capabilities == expected


def test_a_file_without_a_file_type_is_listed_by_its_matrices_type(tmp_path, tiny_path):
    """As the engine names it: the type most of the 2-D tensors have (gguf-py counts them here)."""
    path = tmp_path / "untyped.gguf"
    path.write_bytes(tiny_path.read_bytes().replace(b"general.file_type", b"general.file_typ_"))
    matrices = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2)
    assert ModelEntry.from_file(path).quantization == matrices.most_common(1)[0][0]


async def test_list_and_get(server):
    reply = await server.request("GET", "/lmsp/v1/models")
    assert reply.status == 200 and reply.headers["content-type"] == "application/json"
    listing = reply.json()
    assert listing["object"] == "list" and len(listing["data"]) == 1
    model = listing["data"][0]
    assert set(model) == MODEL_FIELDS
    assert model["id"] == TINY_ID and model["object"] == "model" and model["owned_by"] == "local"
    assert model["architecture"] == "llama" and model["quantization"] == "Q8_0"
    assert model["context_window"] == 512
    assert model["size_bytes"] == server.service.registry.get(TINY_ID).path.stat().st_size
    assert "streaming" in model["capabilities"]
    assert "conversations" not in model["capabilities"]  # this service stores nothing
    one = await server.request("GET", f"/lmsp/v1/models/{TINY_ID}")
    assert one.status == 200 and one.json() == model
    encoded = await server.request("GET", "/lmsp/v1/models/tiny%3Achat-q8_0")
    assert encoded.status == 200 and encoded.json()["id"] == TINY_ID


async def test_unknown_model_is_404_model_not_found(server):
    reply = await server.request("GET", "/lmsp/v1/models/nope:1b")
    assert reply.status == 404 and reply.json()["code"] == "model_not_found"


async def test_listing_does_not_load_models(nursery, tmp_path, tiny_path):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_path, models / "SmolLM2-135M-Instruct.Q4_1.gguf")
    (models / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")  # truncated: skipped
    for name, length in [("odd-text", "big"), ("odd-nan", float("nan"))]:  # a context length that is no count
        writer = gguf.GGUFWriter(models / f"{name}.gguf", "llama")
        if isinstance(length, str):
            writer.add_string("llama.context_length", length)
        else:
            writer.add_float32("llama.context_length", length)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
    (models / "notes.txt").write_text("not a model")
    lines = []
    service = await open_service(ServiceConfig(models_dir=models, store=False), log=lines.append)
    server = await start_server(nursery, service)
    reply = await server.request("GET", "/lmsp/v1/models")
    assert [m["id"] for m in reply.json()["data"]] == ["smollm2:135m-instruct-q4_1"]
    assert all(entry.model is None for entry in service.registry)
    assert all(any(f"{name}.gguf" in line for line in lines) for name in ("broken", "odd-text", "odd-nan"))


async def test_a_header_of_arrays_nested_too_deeply_is_skipped(tmp_path, tiny_path):
    """Each level of arrays of arrays was one more recursion: 5,000 of them (60 kB) raised
    RecursionError, which stopped the start of a service serving that directory."""
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_path, models / "tiny-chat-q8_0.gguf")
    key = b"general.nested"
    nested = struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 0, 0)  # [[[...[]...]]]
    (models / "nested.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key))
                                         + key + struct.pack("<I", 9) + nested)
    lines = []
    registry = await Registry.scan([], models, lines.append)
    assert [entry.id for entry in registry] == ["tiny:chat-q8_0"]
    assert lines == ["warning: skipping nested.gguf: arrays nested too deeply"]


async def test_a_bad_model_path_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="cannot serve"):
        await Registry.scan([tmp_path / "missing.gguf"], None)


async def test_concurrent_first_requests_share_one_load(monkeypatch, tiny_path):
    import engine

    calls = []

    class Loaded:
        class info:
            capabilities = ("tools",)
            context_length = 256

    all_asked = threading.Event()

    def slow_load(path, n_ctx=None, kv_cache_bytes=None, speculate=True, max_batch=8):
        calls.append(path)
        all_asked.wait(30)  # (until the three first uses have asked for the model)
        return Loaded()

    monkeypatch.setattr(engine, "load_model", slow_load)
    entry = ModelEntry.from_file(tiny_path)
    results = []

    async def first_use():
        results.append(await entry.load())

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(first_use)
        await trio.testing.wait_all_tasks_blocked()  # one loading, two waiting for it
        all_asked.set()
    assert len(calls) == 1 and len({id(r) for r in results}) == 1
    assert entry.capabilities == ("tools",) and entry.context_window == 256


async def test_a_model_that_fails_to_load_is_503(monkeypatch, nursery, tiny_path):
    import engine
    from engine.errors import ModelFileError

    def broken(path, n_ctx=None):
        raise ModelFileError(f"{path}: tensor data lies past the end of the file")

    monkeypatch.setattr(engine, "load_model", broken)
    lines = []
    service = await open_service(ServiceConfig(model_paths=[tiny_path], store=False), log=lines.append)
    server = await start_server(nursery, service)
    reply = await server.responses({"model": TINY_ID, "input": [{"role": "user", "content": "hi"}]})
    assert reply.status == 503
    doc = reply.json()
    assert doc["code"] == "model_unavailable" and str(tiny_path.parent) not in doc["detail"]
    assert any("failed to load" in line for line in lines)  # the reason is in the log


def test_serve_without_models_pulls_the_default_one(tmp_path, monkeypatch, tiny_path):
    from lmsp_min import fetch
    from lmsp_min.service import ensure_default_model

    pulled = []
    monkeypatch.setattr(fetch, "pull", lambda name: pulled.append(name) or tiny_path)
    empty = ServiceConfig(models_dir=tmp_path, store=False)
    ensure_default_model(empty, log=lambda line: None)
    assert pulled == [fetch.DEFAULT_MODEL] and empty.model_paths == [tiny_path]
    given = ServiceConfig(model_paths=[tiny_path], models_dir=tmp_path, store=False)
    ensure_default_model(given, log=lambda line: None)
    assert pulled == [fetch.DEFAULT_MODEL]  # a model was given: nothing fetched


async def test_a_model_that_appears_in_the_models_directory_is_served_without_a_restart(nursery, tiny_path, tmp_path):
    """`lmsp-min pull` while the service runs: the listing and a request for the new id look again."""
    models = tmp_path / "models"
    models.mkdir()
    lines = []
    config = ServiceConfig(models_dir=models, store=False)
    server = await start_server(nursery, await open_service(config, log=lines.append))
    assert (await server.request("GET", "/lmsp/v1/models")).json()["data"] == []
    os.link(tiny_path, models / "later-chat-q8_0.gguf")  # as pull does, on one file system
    reply = await server.request("GET", "/lmsp/v1/models/later:chat-q8_0")
    assert reply.status == 200, reply.body
    assert [m["id"] for m in (await server.request("GET", "/lmsp/v1/models")).json()["data"]] == ["later:chat-q8_0"]
    assert any("model later:chat-q8_0 found" in line for line in lines)
    (models / "broken.gguf").write_bytes(b"not a gguf")
    assert (await server.request("GET", "/lmsp/v1/models/broken")).status == 404
    assert sum("skipping broken.gguf" in line for line in lines) == 1
    await server.request("GET", "/lmsp/v1/models")  # read once: a file that cannot be read is not read again
    assert sum("skipping broken.gguf" in line for line in lines) == 1


async def test_ctx_caps_the_context_window_of_every_model(nursery, tiny_path):
    """D4: the window is the model's trained length, capped by configuration (`serve --ctx`)."""
    service = await open_service(ServiceConfig(model_paths=[tiny_path], store=False, context_cap=64),
                                log=lambda line: None)
    server = await start_server(nursery, service)
    listed = await server.request("GET", f"/lmsp/v1/models/{TINY_ID}")
    assert listed.json()["context_window"] == 64  # from the header, before the model is loaded
    body = {"model": TINY_ID, "input": [{"role": "user", "content": "Hello there!"}], "max_output_tokens": 60,
            "temperature": 0}
    reply = await server.responses(body)
    assert reply.status == 400 and reply.json()["code"] == "context_length_exceeded"  # fits 512, not 64
    assert service.registry.get(TINY_ID).model.n_ctx == 64
    reply = await server.responses({**body, "max_output_tokens": 2})
    assert reply.status == 200 and reply.json()["usage"]["total_tokens"] <= 64
    listed = await server.request("GET", f"/lmsp/v1/models/{TINY_ID}")
    assert listed.json()["context_window"] == 64  # and once it is loaded


def test_serve_passes_ctx_on(monkeypatch, tiny_path):
    from lmsp_min import cli, service

    configs = []
    monkeypatch.setattr(service, "run", lambda config, host, port: configs.append(config))
    assert cli.main(["serve", "--model", str(tiny_path), "--ctx", "64"]) == 0
    assert configs[0].context_cap == 64
    cli.main(["serve", "--model", str(tiny_path)])
    assert configs[1].context_cap is None  # each model's own window


def test_serve_passes_the_kv_cache_bound_on(monkeypatch, tiny_path):
    from lmsp_min import cli, service

    configs = []
    monkeypatch.setattr(service, "run", lambda config, host, port: configs.append(config))
    assert cli.main(["serve", "--model", str(tiny_path), "--kv-cache-mib", "3"]) == 0
    assert cli.main(["serve", "--model", str(tiny_path)]) == 0
    assert [config.kv_cache_bytes for config in configs] == [3 << 20, 1024 << 20]
    assert service.ServiceConfig().kv_cache_bytes == 1024 << 20  # the same default in a program of one's own


async def test_the_kv_cache_bound_reaches_the_loaded_models_scheduler(nursery, tiny_path):
    service = await open_service(ServiceConfig(model_paths=[tiny_path], store=False, kv_cache_bytes=3 << 20),
                                log=lambda line: None)
    server = await start_server(nursery, service)
    body = {"model": TINY_ID, "input": [{"role": "user", "content": "Hello there!"}], "max_output_tokens": 2}
    assert (await server.responses(body)).status == 200
    assert service.registry.get(TINY_ID).model.scheduler.kv_budget.max_bytes == 3 << 20


def test_serve_no_speculate_reaches_the_loaded_models_scheduler(monkeypatch, tiny_path):
    from lmsp_min import cli, service

    configs = []
    monkeypatch.setattr(service, "run", lambda config, host, port: configs.append(config))
    assert cli.main(["serve", "--model", str(tiny_path), "--no-speculate"]) == 0
    assert cli.main(["serve", "--model", str(tiny_path)]) == 0
    assert [config.speculate for config in configs] == [False, True]


async def test_speculation_off_reaches_the_loaded_models_scheduler(nursery, tiny_path):
    service = await open_service(ServiceConfig(model_paths=[tiny_path], store=False, speculate=False),
                                log=lambda line: None)
    server = await start_server(nursery, service)
    body = {"model": TINY_ID, "input": [{"role": "user", "content": "Hello there!"}], "max_output_tokens": 2}
    assert (await server.responses(body)).status == 200
    assert service.registry.get(TINY_ID).model.scheduler.speculate is False


async def test_a_model_id_with_a_dot_and_a_colon_is_served(nursery, tiny_path, tmp_path):
    """D2: model ids may contain `:` and `.` (llama3.2:1b...): listed, fetched and used by that id."""
    dotted = tmp_path / "Tiny2.5-chat-q8_0.gguf"
    shutil.copy(tiny_path, dotted)
    server = await start_server(nursery, await make_service([dotted]))
    (model,) = (await server.request("GET", "/lmsp/v1/models")).json()["data"]
    assert model["id"] == "tiny2.5:chat-q8_0"
    assert (await server.request("GET", "/lmsp/v1/models/tiny2.5:chat-q8_0")).json() == model
    reply = await server.responses({"model": model["id"], "input": [{"role": "user", "content": "Hi."}],
                                   "max_output_tokens": 2})
    assert reply.status == 200 and reply.json()["model"] == model["id"], reply.body

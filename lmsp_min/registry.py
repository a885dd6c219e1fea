"""The models a service offers (decisions.md D2): ids, model objects, lazy loading.

Start-up must be fast and listing must not load anything, so a model is first
known only by its GGUF header, read here with the standard library: the
key/value metadata (strings and numbers; arrays such as the vocabulary are
skipped, not decoded) and the tensor records (to count parameters). The
weights are loaded by the engine on the first request that needs them, in a
worker thread; requests that arrive during that load wait for the same load.

Model ids come from file names, lowercased:

    <family>:<tag>    family = the text before the first "-", joined with the
                      next part when that part is a version number
                      ("gemma-3" -> "gemma3", "llama-3.2" -> "llama3.2");
                      tag = the rest, where a "." before a letter becomes "-"

    SmolLM2-135M-Instruct.Q4_1.gguf  ->  smollm2:135m-instruct-q4_1
    gemma-3-270m-q4_k_m.gguf         ->  gemma3:270m-q4_k_m
    Llama-3.2-1B-Instruct-Q4_K_M     ->  llama3.2:1b-instruct-q4_k_m

Characters other than [a-z0-9._:-] become "-". When two files give the same
id, the first one found wins (the `--model` paths, then the models directory
in name order) and the other is reported at start-up.
"""

import functools
import mmap
import re
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from lmsp_min.problems import Problem

# llama.cpp's `llama_ftype` (general.file_type) -> the quantization name in ids and model objects.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
}
# The engine's capabilities are known for sure once a model is loaded (ModelInfo);
# until then they are predicted from the header with the engine's rules: a template
# that thinks in <think> tags makes a reasoning model, and constrained decoding
# (tools, structured output) needs every printable ASCII byte as a token, which
# byte-level BPE ("gpt2") and SentencePiece with byte fallback ("llama") vocabularies have.
BYTE_COMPLETE_TOKENIZERS = ("gpt2", "llama")
# Capability names in the order model objects list them.
CAPABILITY_ORDER = ("streaming", "tools", "structured_output", "reasoning", "conversations", "tasks")


# -- the GGUF header ---------------------------------------------------------------

# GGUF value types: struct format of the fixed-size ones.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# How deep arrays of arrays may nest: deeper is a corrupt header (each level is a
# recursion of the parser, and a few thousand, 12 bytes each, raised RecursionError).
_MAX_ARRAY_DEPTH = 16


class GGUFHeaderError(Exception):
    """The file is not a GGUF file we can read the header of."""


@dataclass
class GGUFHeader:
    metadata: dict  # key -> int | float | bool | str; arrays are replaced by their length
    n_parameters: int  # the sum of the tensors' element counts


def read_gguf_header(path: Path) -> GGUFHeader:
    """Read a GGUF file's metadata and tensor records, without touching the weights."""
    with open(path, "rb") as file:
        try:
            view = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise GGUFHeaderError("the file is empty") from None
    with view:
        try:
            return _parse_header(view)
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise GGUFHeaderError(f"truncated or corrupt GGUF header ({exc})") from None


def _parse_header(view) -> GGUFHeader:
    if view[:4] != b"GGUF":
        raise GGUFHeaderError("not a GGUF file (bad magic number)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", view, 4)
    if version not in (2, 3):
        raise GGUFHeaderError(f"unsupported GGUF version {version}")
    offset = 24

    def string() -> str:
        nonlocal offset
        (length,) = struct.unpack_from("<Q", view, offset)
        offset += 8
        text = view[offset:offset + length].decode("utf-8")
        if len(text.encode("utf-8")) != length:
            raise GGUFHeaderError("a string runs past the end of the file")
        offset += length
        return text

    def value(kind: int, depth: int = 0):
        nonlocal offset
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            (result,) = struct.unpack_from(fmt, view, offset)
            offset += struct.calcsize(fmt)
            return result
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item_kind, count = struct.unpack_from("<IQ", view, offset)
            offset += 12
            if item_kind in _SCALARS:
                offset += count * struct.calcsize(_SCALARS[item_kind])
            elif item_kind == _STRING:  # a vocabulary: skip the strings without decoding them
                length_of = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    offset += 8 + length_of(view, offset)[0]
            else:
                if depth == _MAX_ARRAY_DEPTH:
                    raise GGUFHeaderError("arrays nested too deeply")
                for _ in range(count):
                    value(item_kind, depth + 1)
            if offset > len(view):
                raise GGUFHeaderError("an array runs past the end of the file")
            return count
        raise GGUFHeaderError(f"unknown GGUF value type {kind}")

    metadata = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", view, offset)
        offset += 4
        metadata[key] = value(kind)
    n_parameters = 0
    for _ in range(n_tensors):
        string()  # the tensor's name
        (n_dims,) = struct.unpack_from("<I", view, offset)
        dims = struct.unpack_from(f"<{n_dims}Q", view, offset + 4)
        offset += 4 + 8 * n_dims + 4 + 8  # dims, ggml type, data offset
        count = 1
        for dim in dims:
            count *= dim
        n_parameters += count
    return GGUFHeader(metadata, n_parameters)


def _count(value, key: str) -> int:
    """A metadata value that must be a non-negative integer (a context length), else the
    header is unreadable: a file saying "big" or NaN is skipped, not a crash."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GGUFHeaderError(f"the metadata's {key} is not a count of tokens: {str(value)[:40]!r}")
    return value


def _capped(window: int, cap: int | None) -> int:
    """The context window served: the trained one, at most `cap` (`serve --ctx`)."""
    return window if cap is None else min(window, cap)


# -- ids ------------------------------------------------------------------------------


def model_id_for(path: Path) -> str:
    """The model id of a GGUF file name (the rule is in the module docstring)."""
    stem = path.name.lower().removesuffix(".gguf")
    stem = re.sub(r"[^a-z0-9._-]+", "-", stem).strip("-") or "model"
    family, _, tag = stem.partition("-")
    head, _, rest = tag.partition("-")
    if re.fullmatch(r"\d+(\.\d+)*", head):
        family, tag = family + head, rest
    tag = re.sub(r"\.(?=[a-z])", "-", tag)
    return f"{family}:{tag}" if tag else family


# -- the registry ---------------------------------------------------------------------


@dataclass
class ModelEntry:
    """One servable model: what its header says, and the engine model once loaded."""

    id: str
    path: Path
    created_at: int
    size_bytes: int
    architecture: str
    quantization: str
    context_window: int
    parameters: int
    capabilities: tuple[str, ...]  # the engine's: among tools, structured_output, reasoning
    context_cap: int | None = None  # `serve --ctx`: the window is at most this (D4)
    kv_cache_bytes: int | None = None  # `serve --kv-cache-mib`: its running requests' KV caches together
    model: object | None = None
    admitted: int = 0  # requests of this model admitted (`admit`) and not yet released
    _load_lock: trio.Lock = field(default_factory=trio.Lock, repr=False)
    _loaded_here: bool = field(default=False, repr=False)  # `load` made the model: `close` closes it

    @classmethod
    def from_file(cls, path: Path, context_cap: int | None = None,
                  kv_cache_bytes: int | None = None) -> "ModelEntry":
        header = read_gguf_header(path)
        meta = header.metadata
        architecture = meta.get("general.architecture")
        if not isinstance(architecture, str):
            raise GGUFHeaderError("the metadata has no general.architecture")
        stat = path.stat()
        template = meta.get("tokenizer.chat_template")
        capabilities = ("reasoning",) if isinstance(template, str) and "<think>" in template else ()
        if meta.get("tokenizer.ggml.model") in BYTE_COMPLETE_TOKENIZERS:
            capabilities += ("tools", "structured_output")
        return cls(
            id=model_id_for(path),
            path=path,
            created_at=int(stat.st_mtime),
            size_bytes=stat.st_size,
            architecture=architecture,
            quantization=FILE_TYPES.get(meta.get("general.file_type"), "unknown"),
            context_window=_capped(_count(meta.get(f"{architecture}.context_length", 0), "context_length"),
                                   context_cap),
            parameters=header.n_parameters,
            capabilities=capabilities,
            context_cap=context_cap,
            kv_cache_bytes=kv_cache_bytes,
        )

    def model_object(self, service_capabilities: tuple[str, ...]) -> dict:
        """The model object of D2."""
        names = set(self.capabilities) | set(service_capabilities)
        return {
            "id": self.id,
            "object": "model",
            "created_at": self.created_at,
            "owned_by": "local",
            "capabilities": [name for name in CAPABILITY_ORDER if name in names],
            "context_window": self.context_window,
            "architecture": self.architecture,
            "quantization": self.quantization,
            "parameters": self.parameters,
            "size_bytes": self.size_bytes,
        }

    async def load(self, log=None):
        """The engine model, loaded in a worker thread on first use; 503 if it cannot be.
        The entry owns a model it loaded: `close` closes it."""
        if self.model is not None:
            return self.model
        async with self._load_lock:  # concurrent first requests wait for one load
            if self.model is None:
                import engine

                started = time.perf_counter()
                try:
                    model = await trio.to_thread.run_sync(functools.partial(
                        engine.load_model, self.path, self.context_cap, kv_cache_bytes=self.kv_cache_bytes))
                except Exception as exc:
                    if log is not None:
                        log(f"error: model {self.id} failed to load: {type(exc).__name__}: {exc}")
                    raise Problem("model_unavailable", f"model '{self.id}' could not be loaded") from None
                self.use(model)
                self._loaded_here = True
                if log is not None:
                    log(f"loaded model {self.id} in {time.perf_counter() - started:.1f}s")
        return self.model

    def use(self, model) -> None:
        """Serve an engine model loaded elsewhere (tests share one across services): what
        it says of itself replaces what the header said. Its owner closes it, not `close`."""
        info = model.info
        self.capabilities = tuple(info.capabilities)
        self.context_window = info.context_length
        self.model = model

    def close(self) -> None:
        """Close the model `load` loaded (it blocks for up to one forward step: async code
        calls it in a worker thread); the next `load` loads it again."""
        if self._loaded_here:
            model, self.model, self._loaded_here = self.model, None, False
            model.close()

    @property
    def full(self) -> bool:
        """Whether `admit` would refuse now (asked once the model is loaded)."""
        return self.admitted >= self.model.scheduler.max_queue

    def admit(self) -> "Admission":
        """Count in one more request of this (loaded) model, or 429 past its scheduler's
        queue (D9); the `Admission` returned counts it out when released.

        Requests are counted when admitted, not when they reach the engine's queue: a
        burst of concurrent requests all passed a look at the queue before any of them
        was in it, and got a 200 or a 202 whose response then failed `rate_limited`.
        At most `max_queue` are admitted, running or waiting, so the scheduler's queue,
        which fills in a burst before its first step moves any of them into the batch,
        never refuses one of them. Admitting and releasing happen on the trio loop.
        """
        if self.full:
            raise Problem("rate_limited", "too many requests are waiting for this model; retry in a moment",
                          headers=[("Retry-After", "1")])
        self.admitted += 1
        return Admission(self)


class Admission:
    """One admitted request of a model (`ModelEntry.admit`). Its owner releases it
    explicitly (`release`, or `with admission:`) once the request's generation is
    over or will never start; releasing again does nothing."""

    def __init__(self, entry: ModelEntry):
        self._entry: ModelEntry | None = entry

    def release(self) -> None:
        if self._entry is not None:
            self._entry.admitted -= 1
            self._entry = None

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


class Registry:
    """The models by id, in the order they were found.

    With a models directory, `refresh` adds the files that appeared in it since (a
    model pulled while the service runs), so the model listing and a request for an
    unknown id look again before they answer.
    """

    def __init__(self, entries: list[ModelEntry], models_dir: Path | None = None, log=None,
                 context_cap: int | None = None, kv_cache_bytes: int | None = None):
        self._entries = {entry.id: entry for entry in entries}
        self.models_dir = models_dir
        self.context_cap = context_cap  # caps the context window of every model found (D4)
        self.kv_cache_bytes = kv_cache_bytes  # bounds each model's running KV caches together
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._known = {entry.path.resolve() for entry in entries}  # files read, served or not

    @classmethod
    async def scan(cls, paths: list[Path], models_dir: Path | None, log=None,
                   context_cap: int | None = None, kv_cache_bytes: int | None = None) -> "Registry":
        """Read the headers of every `--model` path and every .gguf in `models_dir`.

        A `--model` that cannot be read is an error (raised as ValueError with a
        message for the command line); an unreadable file in the models
        directory is reported and skipped.
        """
        registry = cls([], models_dir, log, context_cap, kv_cache_bytes)
        await registry._add([Path(path) for path in paths], _gguf_files(models_dir))
        return registry

    async def refresh(self) -> None:
        """Add the models directory's files that were not there (or not read) before."""
        if self.models_dir is not None:
            await self._add([], _gguf_files(self.models_dir), announce=True)

    async def _add(self, explicit: list[Path], found: list[Path], announce: bool = False) -> None:
        """Read the files' headers in a worker thread, then add their entries here, on the
        trio loop, where requests iterate the entries."""
        paths = []
        for path in [*explicit, *found]:
            resolved = path.resolve()
            if resolved not in self._known:
                self._known.add(resolved)
                paths.append(path)
        if not paths:  # (no thread for nothing new: the listing looks on every request)
            return
        read = await trio.to_thread.run_sync(self._read, paths, set(explicit))
        for path, entry in read:
            if entry.id in self._entries:
                self._log(f"warning: {path} has the id {entry.id!r} of {self._entries[entry.id].path}; skipped")
                continue
            self._entries[entry.id] = entry
            if announce:
                self._log(f"model {entry.id} found in {path.parent}")

    def _read(self, paths: list[Path], explicit: set[Path]) -> list[tuple[Path, ModelEntry]]:
        read = []
        for path in paths:
            try:
                read.append((path, ModelEntry.from_file(path, self.context_cap, self.kv_cache_bytes)))
            except (OSError, GGUFHeaderError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                if path in explicit:
                    raise ValueError(f"cannot serve {path}: {reason}") from None
                self._log(f"warning: skipping {path.name}: {reason}")
        return read

    def __iter__(self):
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, model_id: str, param: str | None = None) -> ModelEntry:
        entry = self._entries.get(model_id)
        if entry is None:
            raise Problem("model_not_found", f"no model has the id '{model_id}'", param=param)
        return entry

    async def find(self, model_id: str, param: str | None = None) -> ModelEntry:
        """`get`, looking in the models directory again for an id not known yet."""
        if model_id not in self._entries:
            await self.refresh()
        return self.get(model_id, param)


def _gguf_files(models_dir: Path | None) -> list[Path]:
    return sorted(models_dir.glob("*.gguf")) if models_dir is not None and models_dir.is_dir() else []

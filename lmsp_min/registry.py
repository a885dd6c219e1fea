"""The models a service offers (docs/protocol.md D2): ids, model objects, lazy loading.

Start-up must be fast and listing must not load anything, so a model is first
known only by its GGUF header (engine/gguf_header.py, standard library only):
the key/value metadata (arrays such as the vocabulary are skipped, not decoded)
and the tensor records (to count parameters). It is described by the engine's
own rules (engine/describe.py: the quantization's name, the capabilities). The
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
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

import engine
from engine import describe
from engine.gguf_header import GGUFHeaderError, read_header
from lmsp_min.admission import Admission, Admissions
from lmsp_min.problems import Problem, quoted

DEFAULT_MAX_BATCH = 8  # requests each model's engine steps together (`serve --max-batch`): engine/tuning.py's
                       # MAX_BATCH, written out here, where the engine's modules with numpy are not imported
QUEUE_PER_SLOT = 4  # `serve --queue-depth` is this many times `--max-batch` unless given: one principal's
                    # share of it (all but an eighth) still fills the batch three times over
DEFAULT_QUEUE_DEPTH = QUEUE_PER_SLOT * DEFAULT_MAX_BATCH  # requests admitted per model, generating or waiting (32)

# Capability names in the order model objects list them.
CAPABILITY_ORDER = ("streaming", "tools", "structured_output", "reasoning", "conversations", "tasks")


# -- values of the header ------------------------------------------------------------


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


def rate_limited() -> Problem:
    """The 429 of a request past its model's queue, or past its principal's share of it."""
    return Problem("rate_limited", "too many requests are waiting for this model; retry in a moment",
                   headers=[("Retry-After", "1")])


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
    queue_depth: int = DEFAULT_QUEUE_DEPTH  # requests admitted at once; past it: 429
    speculate: bool = True  # `serve --no-speculate` turns drafts off (engine/speculate.py)
    max_batch: int = DEFAULT_MAX_BATCH  # `serve --max-batch`: requests its engine steps together
    model: object | None = None
    admissions: Admissions = field(init=False, repr=False)  # its admitted requests, and their turns
    _load_lock: trio.Lock = field(default_factory=trio.Lock, repr=False)
    _loaded_here: bool = field(default=False, repr=False)  # `load` made the model: `close` closes it

    def __post_init__(self):
        # as many generate at once as the engine batches; the others wait their turn here
        self.admissions = Admissions(lambda: self.model.scheduler.max_batch)

    @classmethod
    def from_file(cls, path: Path, context_cap: int | None = None,
                  kv_cache_bytes: int | None = None, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                  speculate: bool = True, max_batch: int = DEFAULT_MAX_BATCH) -> "ModelEntry":
        header = read_header(path)  # arrays skipped: their length only
        meta = header.metadata
        architecture = meta.get("general.architecture")
        if not isinstance(architecture, str):
            raise GGUFHeaderError("the metadata has no general.architecture")
        stat = path.stat()
        return cls(
            id=model_id_for(path),
            path=path,
            created_at=int(stat.st_mtime),
            size_bytes=stat.st_size,
            architecture=architecture,
            quantization=describe.quantization(header),
            context_window=_capped(_count(meta.get(f"{architecture}.context_length", 0), "context_length"),
                                   context_cap),
            parameters=header.n_parameters,
            # until the load says for sure (can_constrain on the vocabulary; see `load`)
            capabilities=describe.capabilities(meta.get("tokenizer.chat_template"),
                                               describe.predict_constrainable(meta)),
            context_cap=context_cap,
            kv_cache_bytes=kv_cache_bytes,
            queue_depth=queue_depth,
            speculate=speculate,
            max_batch=max_batch,
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
                started = time.perf_counter()
                try:
                    model = await trio.to_thread.run_sync(functools.partial(
                        engine.load_model, self.path, self.context_cap, kv_cache_bytes=self.kv_cache_bytes,
                        speculate=self.speculate, max_batch=self.max_batch))
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
    def admitted(self) -> int:
        """Requests of this model admitted (`admit`) and not yet released."""
        return self.admissions.admitted

    def full_for(self, principal: str) -> bool:
        """Whether `admit` would refuse `principal` now: the queue is full, or the
        principal holds its share of it (lmsp_min/admission.py)."""
        return not self.admissions.has_room(principal, self.queue_depth)

    def admit(self, principal: str) -> Admission:
        """Count in one more request of this (loaded) model, or 429 past `queue_depth` or
        past the principal's share of it (D9); the `Admission` returned waits for its turn
        to generate (lmsp_min/admission.py, fair between principals) and counts it out
        when released.

        Requests are counted when admitted, not when they reach a queue: a burst of
        concurrent requests all passed a look at the queue before any of them was in
        it, and got a 200 or a 202 whose response then failed `rate_limited`. Only
        those given a turn reach the engine, at most its batch size, so its scheduler's
        queue never refuses one of them. Admitting and releasing happen on the trio loop.
        """
        if self.full_for(principal):
            raise rate_limited()
        return self.admissions.admit(principal)


class Registry:
    """The models by id, in the order they were found.

    With a models directory, `refresh` adds the files that appeared in it since (a
    model pulled while the service runs), so the model listing and a request for an
    unknown id look again before they answer.
    """

    def __init__(self, entries: list[ModelEntry], models_dir: Path | None = None, log=None,
                 context_cap: int | None = None, kv_cache_bytes: int | None = None,
                 queue_depth: int = DEFAULT_QUEUE_DEPTH, speculate: bool = True,
                 max_batch: int = DEFAULT_MAX_BATCH):
        self._entries = {entry.id: entry for entry in entries}
        self.models_dir = models_dir
        self.context_cap = context_cap  # caps the context window of every model found (D4)
        self.kv_cache_bytes = kv_cache_bytes  # bounds each model's running KV caches together
        self.queue_depth = queue_depth  # requests each model admits at once
        self.speculate = speculate  # drafts from the context and forced text, for every model found
        self.max_batch = max_batch  # requests each model's engine steps together
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._known = {entry.path.resolve() for entry in entries}  # files read, served or not

    @classmethod
    async def scan(cls, paths: list[Path], models_dir: Path | None, log=None,
                   context_cap: int | None = None, kv_cache_bytes: int | None = None,
                   queue_depth: int = DEFAULT_QUEUE_DEPTH, speculate: bool = True,
                   max_batch: int = DEFAULT_MAX_BATCH) -> "Registry":
        """Read the headers of every `--model` path and every .gguf in `models_dir`.

        A `--model` that cannot be read is an error (raised as ValueError with a
        message for the command line); an unreadable file in the models
        directory is reported and skipped.
        """
        registry = cls([], models_dir, log, context_cap, kv_cache_bytes, queue_depth, speculate, max_batch)
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
                read.append((path, ModelEntry.from_file(path, self.context_cap, self.kv_cache_bytes, self.queue_depth,
                                                         self.speculate, self.max_batch)))
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
            raise Problem("model_not_found", f"no model has the id {quoted(model_id)}", param=param)
        return entry

    async def find(self, model_id: str, param: str | None = None) -> ModelEntry:
        """`get`, looking in the models directory again for an id not known yet."""
        if model_id not in self._entries:
            await self.refresh()
        return self.get(model_id, param)


def _gguf_files(models_dir: Path | None) -> list[Path]:
    return sorted(models_dir.glob("*.gguf")) if models_dir is not None and models_dir.is_dir() else []

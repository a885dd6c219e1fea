"""Run every benchmark, print one table, and save the results as JSON.

    python benchmarks/run.py                 # all of them (or: lmsp-min bench)
    python benchmarks/run.py engine server   # some of them
    python benchmarks/run.py --list

Each benchmark is a module of this directory run in a child process of its own
(engine: the engine alone; perf: both real models side by side with llama.cpp,
engine and HTTP; server: the server's own overhead; tasks: task event logs;
constrained: the cost of constrained decoding), from the source checkout, as
`python -m benchmarks.NAME --json FILE`: its memory, threads and models do not
mix with the next one's, and one that fails does not stop the others. A
benchmark writes to FILE a list of rows (or `{"rows": [...]}`), each a JSON
object with at least `name` and `value`, and optionally `unit` and whatever
else it measured (shown as `key=value`). Whatever it prints goes to the
terminal (stderr) as it runs; a benchmark that takes no `--json` has the lines
it printed in the table instead. Arguments after `--` go to each benchmark run,
so they are meant for one NAME at a time (`run.py tasks -- --events 2000`).

The results of the whole run, with the machine they ran on, go to
benchmarks/results/<date>-<time>.json (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHMARKS = ("engine", "perf", "server", "tasks", "constrained")


def available() -> list[str]:
    return [name for name in BENCHMARKS if (HERE / f"{name}.py").is_file()]


def accepts_json(name: str) -> bool:
    """Whether benchmarks/NAME.py takes `--json FILE` (its --help says so)."""
    help_text = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    return "--json" in help_text


def run_one(name: str, extra: list[str]) -> dict:
    """Run benchmarks/NAME.py in a child process; its rows, or why there are none.

    What the benchmark prints is passed through as it comes. A benchmark without
    `--json` gets one row per line it printed, so the table still shows it.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", f"benchmarks.{name}", *extra]
        if accepts_json(name):
            command[3:3] = ["--json", str(out)]
        print(f"== {name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        printed = []
        with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) as child:
            for line in child.stdout:
                sys.stderr.write(line)
                printed.append(line.rstrip("\n"))
        code = child.returncode
        result = {"benchmark": name, "exit_code": code, "seconds": round(time.perf_counter() - started, 1), "rows": []}
        if out.is_file():
            try:
                data = json.loads(out.read_text())
                result["rows"] = data["rows"] if isinstance(data, dict) else list(data)
            except (ValueError, KeyError, TypeError) as e:
                result["error"] = f"unreadable results: {e}"
        else:
            result["rows"] = [{"name": "(printed)", "value": line} for line in printed if line.strip()]
        if code != 0:
            result["error"] = f"exited with status {code}"
    return result


def table(results: list[dict]) -> str:
    """One plain-text table: benchmark, measure, value, other fields."""
    lines = [("BENCHMARK", "MEASURE", "VALUE", "DETAILS")]
    for result in results:
        if result.get("error"):
            lines.append((result["benchmark"], "-", "-", result["error"]))
        for row in result["rows"]:
            value = row.get("value")
            value = f"{value:.4g}" if isinstance(value, float) else str(value)
            if row.get("unit"):
                value += f" {row['unit']}"
            details = " ".join(f"{k}={v}" for k, v in row.items() if k not in ("name", "value", "unit"))
            lines.append((result["benchmark"], str(row.get("name", "?")), value, details))
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line[:3], widths)) + "  " + line[3] for line in lines
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lmsp-min bench",
        description="Run the benchmarks (each in its own process), print one table, save JSON.",
        epilog="Arguments after `--` go to every benchmark named, e.g. `tasks -- --events 2000`.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--list", action="store_true", help="list the benchmarks present and exit")
    parser.add_argument("--results-dir", type=Path, default=HERE / "results", help="where the JSON goes")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    present = available()
    if args.list:
        print("\n".join(present) or "no benchmarks present")
        return 0
    unknown = [n for n in args.names if n not in present]
    if unknown:
        parser.error(f"no benchmark {', '.join(unknown)} (present: {', '.join(present) or 'none'})")
    names = args.names or present
    if not names:
        print("no benchmarks present in benchmarks/", file=sys.stderr)
        return 1

    results = [run_one(name, extra) for name in names]
    print(table(results))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    path = args.results_dir / time.strftime("%Y%m%d-%H%M%S.json")
    machine = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    path.write_text(json.dumps({"machine": machine, "results": results}, indent=2) + "\n")
    print(f"results: {path}", file=sys.stderr)
    return 0 if all(not r.get("error") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

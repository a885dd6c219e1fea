"""The benchmarks that need no real model run, in a small configuration: their stand-in
engines must keep up with what the server asks of a model, or `lmsp-min bench` fails."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name, args", [("server", ["--requests", "20"]), ("tasks", ["--events", "200"])])
def test_a_benchmark_runs_and_writes_its_rows(tmp_path, name, args):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert rows and all("name" in row and "value" in row for row in rows)

